"""``PagedKVCache.steps``: what the engine's step needs of an open token transaction beyond
SPEC's ``begin_token`` / ``write_token_layer`` / ``commit_token`` / ``abort_token``: its device
metadata, the writers' backup, how many layers are written, a whole-step write (a CUDA-graph
replay) and the legacy one-layer append with a caller's writer. One object per cache, over the
cache's own state (the open transaction and the groups); the per-layer write
(``write_token_layer_with``) stays on the cache, since it is called once per layer per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from flashdec.cache.slots import TransactionSlots, fresh_slots
from flashdec.cache.state import RequestId
from flashdec.cache.transaction import TokenTransactionView

if TYPE_CHECKING:
    import torch

    from flashdec.cache.core import CacheCore

T = TypeVar("T")
# a writer stores one layer's K/V of a reservation: writer(k_layer, v_layer, slots)
LayerWriter = Callable[["torch.Tensor", "torch.Tensor", TransactionSlots], T]


class StepAccess:
    """The engine's access to a :class:`~flashdec.cache.PagedKVCache`'s token transactions."""

    def __init__(self, cache: CacheCore) -> None:
        self._cache = cache

    @property
    def open_transaction_id(self) -> int | None:
        tx = self._cache._tx.open
        return None if tx is None else tx.transaction_id

    def transaction_slots(
        self, tx: TokenTransactionView | int, *, group: int = 0
    ) -> TransactionSlots:
        """The open transaction's device metadata in ``group`` (the cache's own tensors: read,
        never write)."""
        open_tx = self._cache._tx.resolve(tx)
        if group == 0 and type(group) is int:
            return open_tx.slots
        return open_tx.group_slots[self._cache._layout._group(group).index]

    def layers_written(self, tx: TokenTransactionView | int) -> int:
        """How many layers of an open transaction are written (they go in order from 0)."""
        return self._cache._tx.resolve(tx).next_layer

    def transaction_backup(
        self, tx: TokenTransactionView | int, *, group: int = 0
    ) -> torch.Tensor | None:
        """Where the writers of an open ``backup_by_writer`` transaction save the old bytes of
        ``group``'s slots: ``[2 * layers_in_group, T * Hkv, D]`` in the group's dtype; layer
        ``i`` of the group (its i-th layer) has K rows at ``[i]`` and V rows at
        ``[layers_in_group + i]``, slot row ``t * Hkv + h`` for token ``t``, KV head ``h``.
        Fixed addresses for a batch size (until a bigger batch replaces the slot buffers). None
        when the transaction's backup is not the writers' (or there is none)."""
        open_tx = self._cache._tx.resolve(tx)
        return open_tx.writer_backup(self._cache._layout._group(group))

    def complete_backup(self, tx: TokenTransactionView | int) -> None:
        """Copy every layer's reserved slots of an open ``backup_by_writer`` transaction into its
        backup now: abort then restores all layers whatever the writers did (e.g. kernels
        recorded in a CUDA graph capture that never ran). Needs no layer written yet."""
        self._cache._tx.resolve(tx).complete_backup(self._cache._groups)

    def write_all_layers_with(self, tx: TokenTransactionView | int, writer: Callable[[], T]) -> T:
        """Write every layer of an open transaction with one call (a CUDA-graph replay).

        Needs a transaction with no layer written yet; ``writer()`` must store every layer's
        reserved slots (e.g. replay a graph captured over a step's layers).
        """
        cache = self._cache
        open_tx = cache._tx.resolve(tx)
        if open_tx.next_layer != 0:
            raise RuntimeError(
                f"token transaction {open_tx.transaction_id} already has {open_tx.next_layer} "
                "layer(s) written; write_all_layers_with needs a fresh transaction"
            )
        open_tx.attempted = cache._num_layers
        result = writer()
        open_tx.next_layer = cache._num_layers
        return result

    def append_with(self, request_ids: Sequence[RequestId], writer: LayerWriter[T]) -> T:
        """The legacy single-layer append with a caller-supplied writer (one token each).

        Reserves one slot per request (all or nothing), calls ``writer(k_layer, v_layer, slots)``
        and publishes the tokens; if the writer raises, the reservation is released and nothing
        changes. Returns what the writer returned. ``slots`` are fresh tensors (with block tables
        covering the new tokens) that the caller may keep.
        """
        cache = self._cache
        rids = cache._requests.check_ids(request_ids, unique=True, nonempty=True)
        if cache._num_layers != 1:
            raise RuntimeError(
                f"append works only on a single-layer cache (num_layers={cache._num_layers}); "
                "use begin_token / write_token_layer / commit_token"
            )
        records = cache._requests.active_records(rids, "append to")
        cache._tx.ensure_none_open("append")
        counts = [1] * len(records)
        plan = cache._plan(records, counts)
        cache._open_journals()
        try:
            cache._take_all(plan, one_each=True)
        except BaseException:
            cache._close_journals()
            raise
        group, part = cache._groups[0], plan.groups[0]
        try:
            slots = fresh_slots(group, plan, part)
            result = writer(*cache._layers[0], slots)
        except BaseException:
            cache._release(plan.reserved())
            cache._close_journals(bytes_restored=False)  # the writer may have stored some
            raise
        cache._publish(records, counts, plan.reserved(), [p.starts for p in plan.groups])
        cache._close_journals()
        cache._version += 1
        return result
