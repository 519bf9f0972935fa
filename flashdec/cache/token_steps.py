"""Token steps of a :class:`~flashdec.cache.PagedKVCache`: the legacy one-layer ``append`` and
the multi-layer token transaction (``begin_token`` / ``begin_tokens``, the layer writes,
``commit_token`` / ``abort_token``). A mixin of the facade, one concept: what a step reserves,
writes and publishes.

Per step the facade calls each group's manager once (``flashdec.cache.group_managers``: reserve
and publish by kind), builds each group's device metadata once (``flashdec.cache.slots``) and
leaves the undo to the open transaction (``flashdec.cache.transaction``). A repeated one-token
batch is planned from its :class:`~flashdec.cache.batch_memo.BatchMemo` instead.

The cache writes K/V itself only with PyTorch (``write_token_layer``, ``append``). Faster writers
(the Triton kernels) are the engine's: they run through ``write_token_layer_with``, where the
cache keeps the bookkeeping (layer order, the reservation) and the caller supplies the launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from flashdec._checks import (
    FLOAT_DTYPES,
    check_accept_counts,
    check_positive_int,
    check_shape,
    check_tensor,
    check_token_counts,
)
from flashdec.cache.batch_memo import BatchMemo
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.reservation import Plan, every_token
from flashdec.cache.slots import TransactionSlots, fixed_slots, fresh_slots
from flashdec.cache.state import RequestId, RequestRecord
from flashdec.cache.step_access import LayerWriter
from flashdec.cache.transaction import OpenTransaction, TokenTransactionView, TransactionState

T = TypeVar("T")


def torch_scatter(
    k_layer: torch.Tensor, v_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots
) -> None:
    """``k_layer[block_ids[t], :, offsets[t]] = k[t]`` (same for v): one index_put each.

    ``k, v`` hold one row per token of the transaction; when the group stores only some of them
    (``slots.token_rows``: a window group's prompt import) only those rows are written.
    """
    count = slots.num_tokens
    rows = slots.token_rows
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    block_ids, offsets = slots.block_ids[:count], slots.offsets[:count]
    k_layer[block_ids, :, offsets] = k  # [T, Hkv, D]
    v_layer[block_ids, :, offsets] = v


class TokenSteps:
    """Append and token transactions (see :class:`~flashdec.cache.PagedKVCache`)."""

    def _check_token_kv(
        self, name: str, value: object, num_tokens: int, group: LayerGroup
    ) -> torch.Tensor:
        """K or V rows ``[num_tokens, Hkv, D]`` for ``group``: its dtype, or any float dtype
        for an FP8 group (quantized with its scales)."""
        dtypes = FLOAT_DTYPES if group.is_fp8 else (group.dtype,)
        tensor = check_tensor(name, value, ndim=3, dtypes=dtypes, device=self._device)
        check_shape(name, tensor, (num_tokens, group.num_kv_heads, group.head_dim))
        return tensor

    # ---- reservations shared by append and the transactions --------------------------------
    def _plan(self, records: list[RequestRecord], counts: list[int]) -> Plan:
        """Check that every listed request can take its tokens in every group; changes
        nothing."""
        for manager in self._managers:
            manager.check_room(records, counts)
        return Plan(records, counts, len(self._groups))

    def _take_all(self, plan: Plan, one_each: bool) -> None:
        """Allocate every group's planned blocks (all or nothing)."""
        try:
            if one_each:
                plan.positions = np.array([rec.seq_len for rec in plan.records], dtype=np.int64)
            else:
                plan.positions = np.concatenate(
                    [
                        np.arange(rec.seq_len, rec.seq_len + n, dtype=np.int64)
                        for rec, n in zip(plan.records, plan.counts, strict=True)
                    ]
                )
            for manager, part in zip(self._managers, plan.groups, strict=True):
                if one_each:
                    manager.reserve_one_each(plan, part)
                else:
                    manager.reserve(plan, part)
        except BaseException:
            self._release(plan.reserved())
            raise

    def _open_journals(self) -> None:
        """What this transaction's allocations evict is remembered (BlockCache.close_journal)."""
        for group in self._groups:
            group.block_cache.open_journal()

    def _close_journals(self, bytes_restored: bool = True) -> None:
        for group in self._groups:
            group.block_cache.close_journal(bytes_restored)

    def _release(self, reserved: list[dict[RequestId, list[int]]]) -> None:
        for manager, per_request in zip(self._managers, reserved, strict=False):
            manager.release(per_request)

    def _publish(self, records: list[RequestRecord], counts: list[int], reserved, starts) -> None:
        """Make the reservation permanent (each group's manager: blocks join the tables, a
        window group releases what fell before its window), then the lengths grow."""
        for manager, group_reserved, group_starts in zip(
            self._managers, reserved, starts, strict=True
        ):
            manager.publish(records, counts, group_reserved, group_starts)
        for rec, n in zip(records, counts, strict=True):
            rec.seq_len += n

    # ---- legacy single-layer append --------------------------------------------------------
    def append(self, request_ids: Sequence[RequestId], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token per request (``k, v [B, Hkv, D]``) at its seq_len; num_layers == 1."""
        rids = self._requests.check_ids(request_ids, unique=True, nonempty=True)
        group = self._groups[0]
        k = self._check_token_kv("k", k, len(rids), group)
        v = self._check_token_kv("v", v, len(rids), group)
        if group.is_fp8:
            k, v = group.quantize(group.layers[0], k, v)
        self._steps.append_with(
            rids, lambda k_layer, v_layer, slots: torch_scatter(k_layer, v_layer, k, v, slots)
        )

    # ---- multi-layer token transactions ----------------------------------------------------
    def begin_token(
        self,
        request_ids: Sequence[RequestId],
        *,
        pad_to: int | None = None,
        backup_by_writer: bool = False,
    ) -> TokenTransactionView:
        """Reserve one slot per request in every group (taking a block where needed).

        The transaction's device metadata sits in fixed-address buffers, so the layers of a step
        captured in a CUDA graph can be replayed for a later step of the same batch. ``pad_to``
        (>= the batch) adds padding rows that writers skip and decode sees as empty: a graph
        captured for ``pad_to`` rows serves this smaller batch.

        ``backup_by_writer`` (with ``restore_on_abort``): instead of copying the reserved slots
        of every layer now, each layer's writer saves the old bytes of its slots into
        ``steps.transaction_backup`` before storing (the fused append kernel does, in the same
        launch). Abort then restores the layers whose writer was called.
        """
        if not isinstance(backup_by_writer, bool):
            raise TypeError(
                f"backup_by_writer must be a bool, got {type(backup_by_writer).__name__}"
            )
        memo = self._memo
        plan = None
        if (
            memo is not None
            and type(request_ids) in (list, tuple)
            and memo.matches(request_ids, self._version)
        ):  # the batch of the last step, nothing else changed since: validated then
            rids = memo.rids
        else:
            rids = self._requests.check_ids(request_ids, unique=True, nonempty=True)
            memo = None
        num_rows = len(rids)
        if pad_to is not None:
            num_rows = check_positive_int("pad_to", pad_to)
            if num_rows < len(rids):
                raise ValueError(f"pad_to ({pad_to}) must be >= the batch size ({len(rids)})")
        records = (
            memo.records
            if memo is not None
            else self._requests.active_records(rids, "begin a token for")
        )
        self._tx.ensure_none_open("begin a token transaction")
        self._open_journals()
        try:
            if memo is not None:
                plan = memo.plan(self._managers)
            if plan is None:  # the general path (also to raise a full request's exact error)
                plan = self._plan(records, [1] * len(records))
                self._take_all(plan, one_each=True)
            try:
                slots = [
                    fixed_slots(group, plan, part, num_rows, self._tx.next_id())
                    for group, part in zip(self._groups, plan.groups, strict=True)
                ]
                return self._open(
                    rids, plan, slots, one_each=True, backup_by_writer=backup_by_writer
                )
            except BaseException:
                self._release(plan.reserved())
                raise
        except BaseException:
            self._close_journals()  # nothing was written yet
            raise

    def begin_tokens(
        self, request_ids: Sequence[RequestId], num_tokens: Sequence[int]
    ) -> TokenTransactionView:
        """Reserve ``num_tokens[i]`` consecutive slots for request ``i`` (a prompt import).

        Same transaction rules as :meth:`begin_token`; each layer's write then takes
        ``k, v [sum(num_tokens), Hkv, D]``, request by request in order. A window group stores
        only the tokens its window keeps: its slots' ``token_rows`` (None when every token is
        stored) lists the rows of ``k, v`` that go there, one per slot row.
        """
        rids = self._requests.check_ids(request_ids, unique=True, nonempty=True)
        counts = check_token_counts("num_tokens", num_tokens, len(rids))
        records = self._requests.active_records(rids, "begin tokens for")
        self._tx.ensure_none_open("begin a token transaction")
        plan = self._plan(records, counts)
        self._open_journals()
        try:
            self._take_all(plan, one_each=False)
            try:
                slots = [
                    fresh_slots(group, plan, part)
                    for group, part in zip(self._groups, plan.groups, strict=True)
                ]
                return self._open(rids, plan, slots)
            except BaseException:
                self._release(plan.reserved())
                raise
        except BaseException:
            self._close_journals()  # nothing was written yet
            raise

    def _open(
        self,
        rids: list[RequestId],
        plan: Plan,
        slots: list[TransactionSlots],
        one_each: bool = False,
        backup_by_writer: bool = False,
    ) -> TokenTransactionView:
        records = plan.records
        # views show SPEC's int32 metadata (the repeated-batch plan's positions already are)
        positions = plan.positions.astype(np.int32, copy=False)
        if one_each:  # a token at each request's length
            starts, after = positions, positions + 1
        else:
            starts = np.fromiter((rec.seq_len for rec in records), np.int32, len(records))
            after = starts + np.asarray(plan.counts, dtype=np.int32)
        first = plan.groups[0]
        block_ids = every_token(first, positions.shape[0])
        host = {
            "positions": positions,
            "block_ids": block_ids,
            "offsets": positions % self._groups[0].block_size,
            "seq_lens": starts,
            "seq_lens_after": after,
        }
        tx = OpenTransaction(
            self._tx.next_id(),
            self._version + 1,
            tuple(rids),
            plan.counts,
            [part.reserved for part in plan.groups],
            [part.starts for part in plan.groups],
            slots,
            host,
            first.table_rows,
        )
        tx.parts = plan.groups
        tx.memo = plan.memo if one_each else None
        tx.one_each = one_each
        if self._restore_on_abort:
            tx.save_backups(self._groups, backup_by_writer, fixed=one_each)
        view = tx.view(TransactionState.OPEN, tx.cache_version, self._groups[0].width, self._device)
        self._tx.start(tx)
        self._version += 1
        return view

    def _check_next_layer(self, tx: OpenTransaction, layer_idx: object) -> int:
        if type(layer_idx) is not int or layer_idx != tx.next_layer:
            layer = self._layout._layer(layer_idx)
            done = f"layers 0..{tx.next_layer - 1} are written" if tx.next_layer else "none written"
            raise RuntimeError(
                f"token transaction {tx.transaction_id}: layer {layer} written out of order "
                f"({done}); expected layer {tx.next_layer}"
            )
        if layer_idx >= self._num_layers:
            self._layout._layer(layer_idx)
        return layer_idx

    def write_token_layer(
        self, tx: TokenTransactionView | int, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k, v [num_tokens, Hkv, D]`` (bitwise, as given; an FP8 group quantizes
        float rows with its scales) in the layer's reserved slots."""
        open_tx = self._tx.resolve(tx)
        self._check_next_layer(open_tx, layer_idx)
        group = self._groups[self._layer_group[layer_idx]]
        count = open_tx.num_tokens
        k = self._check_token_kv("k", k, count, group)
        v = self._check_token_kv("v", v, count, group)
        if group.is_fp8 and k.dtype != group.dtype:
            k, v = group.quantize(layer_idx, k, v)
        self.write_token_layer_with(
            open_tx.transaction_id,
            layer_idx,
            lambda k_layer, v_layer, slots: torch_scatter(k_layer, v_layer, k, v, slots),
        )

    def write_token_layer_with(
        self, tx: TokenTransactionView | int, layer_idx: int, writer: LayerWriter[T]
    ) -> T:
        """Write the next layer of an open transaction with ``writer(k_layer, v_layer, slots)``.

        ``k_layer, v_layer`` are the layer's views in its group's storage and ``slots`` that
        group's reservation. The cache checks the transaction and the layer order and counts the
        layer as written only when the writer returns; the writer must store exactly the
        reserved slots (``slots.block_ids`` / ``slots.offsets``, skipping padding rows with
        block id -1; rows ``slots.token_rows`` of the input when that is set). If it raises, the
        transaction stays open with this layer unwritten (abort it: the backup restores any
        bytes it overwrote). Returns what the writer returned.
        """
        open_tx = self._tx.resolve(tx)
        layer = self._check_next_layer(open_tx, layer_idx)
        k_layer, v_layer, group = self._layer_info[layer]
        open_tx.attempted = layer + 1  # its bytes may change from here: abort restores it
        result = writer(k_layer, v_layer, open_tx.group_slots[group])
        open_tx.next_layer = layer + 1
        return result

    def transaction_view(
        self, tx: TokenTransactionView | int, *, group: int = 0
    ) -> TokenTransactionView:
        """A fresh detached view of an *open* transaction, with ``group``'s blocks (block id -1
        for a token a window group does not store)."""
        open_tx = self._tx.resolve(tx)
        g = self._layout._group(group)
        override = None
        if g.index:
            part = open_tx.parts[g.index]
            positions = open_tx.host["positions"]
            override = (
                every_token(part, positions.shape[0]),
                positions % g.block_size,
                part.table_rows,
            )
        return open_tx.view(
            TransactionState.OPEN, open_tx.cache_version, g.width, self._device, override
        )

    def commit_token(
        self, tx: TokenTransactionView | int, accept: Sequence[int] | None = None
    ) -> TokenTransactionView:
        """Publish the tokens: each request's seq_len grows by its reserved count, once; window
        groups release the blocks now wholly before their window.

        ``accept[i]`` (``0..count[i]``; None keeps every token) keeps only the first tokens of
        request ``i``: the slots of the others get their old bytes back (as an abort puts them
        back; with ``restore_on_abort=False`` they are left as written, past the request's
        length) and reserved blocks left without a committed token return to the pool. A bad
        ``accept`` raises and leaves the transaction open, unchanged.
        """
        open_tx = self._tx.resolve(tx)
        if open_tx.next_layer != self._num_layers:
            raise RuntimeError(
                f"cannot commit token transaction {open_tx.transaction_id}: "
                f"{open_tx.next_layer} of {self._num_layers} layers written"
            )
        if accept is not None:
            counts = check_accept_counts(accept, open_tx.counts)
            if counts != open_tx.counts:
                return self._commit_part(open_tx, counts)
        version = self._version + 1
        view = open_tx.view(
            TransactionState.COMMITTED, version, self._groups[0].width, self._device
        )
        memo = open_tx.memo
        records = (
            memo.records
            if memo is not None
            else [self._requests.records[rid] for rid in open_tx.request_ids]
        )
        self._publish(records, open_tx.counts, open_tx.reserved, open_tx.starts)
        self._tx.close(TransactionState.COMMITTED, version)
        self._close_journals()
        # the next step of the same batch starts from arrays, if nothing else changed since
        # this transaction began (one transaction at a time: nothing can, but be exact)
        if not open_tx.one_each or not self._memoizable or self._version != open_tx.cache_version:
            self._memo = None
        elif memo is not None:
            memo.advance([part.new for part in open_tx.parts], version, open_tx.transaction_id)
        else:
            self._memo = BatchMemo(records, len(self._groups), version, open_tx.transaction_id)
        self._version = version
        return view

    def _commit_part(self, open_tx: OpenTransaction, accept: list[int]) -> TokenTransactionView:
        """``commit_token`` keeping only ``accept[i]`` tokens of request ``i``."""
        for manager, part in zip(self._managers, open_tx.parts, strict=True):
            manager.check_partial_commit(open_tx.transaction_id, part)
        records = [self._requests.records[rid] for rid in open_tx.request_ids]
        kept = np.concatenate(
            [np.arange(n) < a for n, a in zip(open_tx.counts, accept, strict=True)]
        )  # [T] per token of the transaction: committed
        open_tx.restore_rejected(self._groups, kept)
        # reserved blocks past the last accepted token go back; the rest are published
        sizes = [group.block_size for group in self._groups]
        reserved, gone = open_tx.split_reserved(records, accept, sizes)
        version = self._version + 1
        view = open_tx.view(
            TransactionState.COMMITTED, version, self._groups[0].width, self._device
        )
        for manager, release in zip(self._managers, gone, strict=True):
            manager.release(dict(release))
        self._publish(records, accept, reserved, open_tx.starts)
        self._tx.close(TransactionState.COMMITTED, version)
        self._close_journals(open_tx.backups is not None)  # released blocks: bytes put back
        self._memo = None  # lengths moved unevenly: the next step is planned afresh
        self._version = version
        return view

    def abort_token(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """Drop the tokens: release the blocks begin took; lengths stay as they were."""
        open_tx = self._tx.resolve(tx)
        version = self._version + 1
        view = open_tx.view(TransactionState.ABORTED, version, self._groups[0].width, self._device)
        open_tx.restore_all(self._groups)
        self._release(open_tx.reserved)
        self._tx.close(TransactionState.ABORTED, version)
        self._close_journals(open_tx.backups is not None)
        self._version = version
        return view
