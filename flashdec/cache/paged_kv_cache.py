"""``PagedKVCache``: the single source of truth for request lengths, block ownership, shared
prefixes and the open token transaction.

Layers are partitioned into KV layer groups (SPEC §8.2), each a :class:`LayerGroup` with its own
storage ``[layers_in_group, num_blocks, Hkv, block_size, D]`` (token-major), block allocator,
prefix registry and device block tables; the classic single-geometry constructor builds one
group. The groups share the request lifecycle, and one transaction spans every layer of every
group. A sliding-window group keeps only the blocks a future decode can still read
(``flashdec._blocks``): commit releases the ones wholly before the window, and a prompt import
takes blocks only for the tail the window keeps.

Every public method validates all of its arguments, then the cache's state, and only then
mutates; a rejected call changes nothing (no block taken, no length moved, no version bump).

The cache writes K/V itself only with PyTorch (``write_token_layer``, ``append``). Faster writers
(the Triton kernels) are the engine's: they run through ``write_token_layer_with``, where the
cache keeps the bookkeeping (layer order, the reservation) and the caller supplies the launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from flashdec._checks import (
    FLOAT_DTYPES,
    check_accept_counts,
    check_positive_int,
    check_request_id,
    check_shape,
    check_tensor,
    check_token_counts,
)
from flashdec.cache.audit import cache_metrics, check_invariants
from flashdec.cache.batch_memo import BatchMemo
from flashdec.cache.group_managers import make_manager
from flashdec.cache.kv_spec import KVGroupSpec, format_kv_spec
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.layout import (
    resolve_layout,
)
from flashdec.cache.requests import RequestTable, require_active
from flashdec.cache.reservation import Plan, every_token, request_owner
from flashdec.cache.slots import TransactionSlots, fixed_slots, fresh_slots
from flashdec.cache.state import (
    PrefixId,
    PrefixState,
    RequestId,
    RequestRecord,
    RequestState,
)
from flashdec.cache.transaction import (
    HISTORY_LIMIT,
    OpenTransaction,
    TokenTransactionView,
    TransactionLog,
    TransactionState,
)

T = TypeVar("T")
# a writer stores one layer's K/V of a reservation: writer(k_layer, v_layer, slots)
LayerWriter = Callable[[torch.Tensor, torch.Tensor, TransactionSlots], T]


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


class PagedKVCache:
    """A paged K/V cache whose layers form one or more KV layer groups.

    Args:
        num_layers, num_kv_heads, head_dim, block_size, max_blocks: storage geometry of a
            single-group cache (``head_dim`` even: RoPE rotates pairs of dims). Omit them when
            ``kv_spec`` is given (which may also come first, in place of ``num_layers``).
        dtype: fp16, bf16 or fp32 (single-group form; default fp16).
        device: ``"cpu"`` or a CUDA device that exists (ValueError otherwise).
        prefix_cache_capacity_blocks: budget for shared prefixes (``<= max_blocks``; per group
            with several); 0 turns the feature off. Shared prefixes need full-attention groups
            of one block size (a window group would release them: refused).
        max_blocks_per_seq: block-table width (None: ``max_blocks``; never more). With
            ``kv_spec`` only when every group has the same block size.
        kv_spec: the layer groups, as spec text or ``KVGroupSpec`` s (``parse_kv_spec``); dtypes
            may include ``torch.float8_e4m3fn`` (``kv_size`` must be 2: K and V).
        layer_groups: ``layer_groups[i]`` is the group of layer ``i`` (default: the groups in
            order, ``layer_count`` consecutive layers each); each group appears exactly
            ``layer_count`` times.
        max_seq_len: the most tokens one request may hold (instead of ``max_blocks_per_seq``);
            each group's table is ``ceil(max_seq_len / block_size)`` wide. Default: what the
            smallest full-attention pool can hold (``num_blocks * block_size``), or with only
            window groups the largest pool's.
        kv_scales: per group ``None`` or ``(k_scale, v_scale)`` (floats or float32
            ``[num_kv_heads]``) for FP8 groups: fixed per-head scales, not calibrated
            (stored = value / scale; default 1.0). Float groups take no scales.
        restore_on_abort: abort puts back the bytes a transaction overwrote, so an aborted token
            leaves the storage bit-identical (costs one gather of the reserved slots per token).
    """

    def __init__(
        self,
        num_layers: int | str | Sequence[KVGroupSpec] | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        block_size: int | None = None,
        max_blocks: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cuda",
        prefix_cache_capacity_blocks: int = 0,
        max_blocks_per_seq: int | None = None,
        *,
        kv_spec: str | Sequence[KVGroupSpec] | None = None,
        layer_groups: Sequence[int] | None = None,
        max_seq_len: int | None = None,
        kv_scales: Sequence[tuple[Any, Any] | None] | None = None,
        restore_on_abort: bool = True,
    ) -> None:
        layout = resolve_layout(
            (num_layers, num_kv_heads, head_dim, block_size, max_blocks, dtype),
            device,
            prefix_cache_capacity_blocks,
            max_blocks_per_seq,
            kv_spec,
            layer_groups,
            max_seq_len,
            kv_scales,
            restore_on_abort,
        )
        groups, order = layout.groups, layout.order
        self._restore_on_abort = restore_on_abort
        self._specs = groups

        self._groups = [
            LayerGroup(
                g,
                spec,
                tuple(i for i, x in enumerate(order) if x == g),
                layout.widths[g],
                layout.device,
                layout.prefix_capacity,
            )
            for g, spec in enumerate(groups)
        ]
        for group, pair in zip(self._groups, layout.scales, strict=True):
            if pair is not None:
                group.k_scale.copy_(pair[0])
                group.v_scale.copy_(pair[1])
        self._num_layers = len(order)
        self._layer_group = tuple(order)
        # per global layer: (k view, v view, group index) for the write path
        local = [0] * len(groups)
        self._layer_info: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for g in order:
            k_view, v_view = self._groups[g].layer_views[local[g]]
            self._layer_info.append((k_view, v_view, g))
            local[g] += 1
        self._layers = [(k, v) for k, v, _ in self._layer_info]
        first = self._groups[0]
        self._single = len(self._groups) == 1
        self._managers = [make_manager(group, self._single) for group in self._groups]
        # the repeated-batch path and shared prefixes, where every group's kind allows them
        self._memoizable = all(m.memoizable for m in self._managers)
        self._shares_prefixes = all(m.shares_prefixes for m in self._managers)
        self._device = first.kv.device
        self._allocator = first.allocator  # group 0's (the only one of a single-group cache)
        self._prefixes = first.prefixes
        self._tables = first.tables
        self._tx = TransactionLog(HISTORY_LIMIT)
        # the records of the active and the newest terminal requests (flashdec.cache.requests)
        self._requests = RequestTable()
        self._version = 0
        self._memo: BatchMemo | None = None  # the last stepped batch (full-attention caches)

    def __repr__(self) -> str:
        if not self._single:
            return (
                f"PagedKVCache(kv_spec={format_kv_spec(self._specs)!r}, device={self._device}, "
                f"free={self.num_free_blocks}, requests={len(self._requests.records)}, "
                f"version={self._version})"
            )
        g = self._groups[0]
        return (
            f"PagedKVCache(num_layers={self._num_layers}, num_kv_heads={g.num_kv_heads}, "
            f"head_dim={g.head_dim}, block_size={g.block_size}, "
            f"max_blocks={g.spec.num_blocks}, dtype={g.dtype}, device={self._device}, "
            f"free={self._allocator.num_free}, requests={len(self._requests.records)}, "
            f"prefixes={len(self._prefixes)}, version={self._version})"
        )

    # ---- geometry and simple queries -----------------------------------------------------
    def _uniform(self, name: str) -> Any:
        """A geometry attribute every group shares, else a RuntimeError pointing at groups."""
        values = {getattr(group, name) for group in self._groups}
        if len(values) != 1:
            raise RuntimeError(
                f"{name} differs between this cache's KV groups ({format_kv_spec(self._specs)}); "
                "read it per group from kv_groups"
            )
        return values.pop()

    @property
    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        """The layer groups, in group order."""
        return self._specs

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def _check_group(self, group: object) -> LayerGroup:
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"group must be an int, got {type(group).__name__}")
        if not 0 <= group < len(self._groups):
            raise ValueError(f"group must be in [0, {len(self._groups)}), got {group}")
        return self._groups[group]

    def layer_group(self, layer_idx: int) -> int:
        """The group of global layer ``layer_idx``."""
        return self._layer_group[self._check_layer_index(layer_idx)]

    def group_layers(self, group: int) -> tuple[int, ...]:
        """The global layer ids of ``group``, ascending."""
        return self._check_group(group).layers

    def group_kv(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage of ``group``: ``[layers_in_group, num_blocks, Hkv, bs, D]`` each."""
        g = self._check_group(group)
        return g.k, g.v

    def group_free_blocks(self, group: int) -> int:
        return self._check_group(group).allocator.num_free

    def group_max_blocks_per_seq(self, group: int) -> int:
        return self._check_group(group).width

    def group_kv_scales(self, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_scale, v_scale)`` float32 ``[Hkv]`` of an FP8 group (the cache's own tensors:
        read, never write), None for a float group. Fixed per-head scales, not calibrated."""
        g = self._check_group(group)
        return None if g.k_scale is None else (g.k_scale, g.v_scale)

    @property
    def k_cache(self) -> torch.Tensor:
        """K storage ``[num_layers, max_blocks, Hkv, bs, D]`` of a single-group cache."""
        return self._single_storage("k_cache").k

    @property
    def v_cache(self) -> torch.Tensor:
        return self._single_storage("v_cache").v

    def _single_storage(self, name: str) -> LayerGroup:
        if not self._single:
            raise RuntimeError(
                f"{name} exists only for a single-group cache; this one has "
                f"{len(self._groups)} KV groups: use group_kv(g) or layer_kv(layer)"
            )
        return self._groups[0]

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._uniform("num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self._uniform("head_dim")

    @property
    def block_size(self) -> int:
        return self._uniform("block_size")

    @property
    def max_blocks(self) -> int:
        """Blocks in the pool (summed over groups)."""
        return sum(g.spec.num_blocks for g in self._groups)

    @property
    def num_blocks(self) -> int:
        return self.max_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self._uniform("width")

    @property
    def prefix_cache_capacity_blocks(self) -> int:
        return self._prefixes.capacity_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self._uniform("dtype")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers (single-group caches; see
        ``KVGroupSpec.block_bytes`` per group)."""
        return self._single_storage("bytes_per_block").spec.block_bytes

    @property
    def num_request_slots(self) -> int:
        """Upper bound (exclusive) of ``TransactionSlots.request_slots`` values; it grows (by
        doubling) when more requests are active at once than ever before."""
        return self._tables.num_rows

    @property
    def version(self) -> int:
        """Bumps on every successful change of lengths, ownership, lifecycle or transactions."""
        return self._version

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (summed over groups)."""
        if self._single:
            return self._allocator.num_free
        return sum(g.allocator.num_free for g in self._groups)

    @property
    def open_transaction_id(self) -> int | None:
        tx = self._tx.open
        return None if tx is None else tx.transaction_id

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, Hkv, block_size, D]`` of one layer's K and V (in its group)."""
        return self._layers[self._check_layer_index(layer_idx)]

    # ---- argument helpers ----------------------------------------------------------------
    def _check_layer_index(self, layer_idx: object) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx must be in [0, {self._num_layers}), got {layer_idx}")
        return layer_idx

    def _check_token_kv(
        self, name: str, value: object, num_tokens: int, group: LayerGroup
    ) -> torch.Tensor:
        """K or V rows ``[num_tokens, Hkv, D]`` for ``group``: its dtype, or any float dtype
        for an FP8 group (quantized with its scales)."""
        dtypes = FLOAT_DTYPES if group.is_fp8 else (group.dtype,)
        tensor = check_tensor(name, value, ndim=3, dtypes=dtypes, device=self._device)
        check_shape(name, tensor, (num_tokens, group.num_kv_heads, group.head_dim))
        return tensor

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, request_id: RequestId) -> None:
        """Register a new, empty, active request (ids are never reused)."""
        rid = self._requests.check_new(request_id)
        self._tx.ensure_none_open("add a request")
        row = self._tables.acquire()
        for group in self._groups[1:]:  # every group's tables hand out rows in lockstep
            if group.tables.acquire() != row:
                raise RuntimeError("device-table rows of the KV groups went out of step")
        others = [group.width for group in self._groups[1:]]
        record = RequestRecord(rid, self._groups[0].width, row, others)
        self._requests.add(record)
        self._version += 1

    def finish_request(self, request_id: RequestId) -> None:
        """Release the request's private blocks and prefix reference; state -> finished."""
        self._terminate(request_id, RequestState.FINISHED)

    def cancel_request(self, request_id: RequestId) -> None:
        """Like ``finish_request`` but the state becomes cancelled."""
        self._terminate(request_id, RequestState.CANCELLED)

    def discard_request(self, request_id: RequestId) -> None:
        """Undo ``add_request``: release what an active request holds and forget its id, which
        may be added again. For an admission taken back (a serving step that failed before the
        request decoded anything), not for ending a request: that is finish or cancel."""
        record = self._requests.record(request_id)
        self._tx.ensure_none_open("discard a request")
        require_active(record, "discard")
        self._release_record(record)
        self._requests.forget(record)
        self._version += 1

    def _terminate(self, request_id: RequestId, state: RequestState) -> None:
        record = self._requests.record(request_id)
        verb = "finish" if state is RequestState.FINISHED else "cancel"
        self._tx.ensure_none_open(f"{verb} a request")
        require_active(record, verb)
        self._release_record(record)
        self._requests.retire(record, state)
        self._version += 1

    def _release_record(self, record: RequestRecord) -> None:
        """Give back an active request's private blocks, table row and prefix reference."""
        owner = request_owner(record.request_id)
        for group in self._groups:
            group.allocator.release(record.run(group.index).private_block_ids, owner)
            group.tables.release(record.row)
        if record.prefix_id is not None:
            for group in self._groups:
                group.prefixes.detach(record.prefix_id)

    def request_state(self, request_id: RequestId) -> RequestState:
        return self._requests.record(request_id).state

    def request_ids(self, state: RequestState | str | None = None) -> list[RequestId]:
        """Request ids in insertion order, optionally only those in ``state``: every active
        request and the newest ``TERMINAL_HISTORY_LIMIT`` terminal ones (an older terminal id
        keeps its state — ``request_state`` — but is no longer listed). O(what is listed)."""
        return self._requests.ids(state)

    def request_prefix(self, request_id: RequestId) -> PrefixId | None:
        return self._requests.record(request_id).prefix_id

    def seq_len(self, request_id: RequestId) -> int:
        """Committed tokens (a finished/cancelled request keeps its final length while it is
        among the newest ``TERMINAL_HISTORY_LIMIT`` terminal requests; ValueError after)."""
        return self._requests.record(request_id).seq_len

    def request_block_ids(self, request_id: RequestId, *, group: int = 0) -> list[int]:
        """Physical ids the request holds in ``group``, in logical order (prefix blocks first;
        a window group's start at its first held block); empty once terminal."""
        record = self._requests.record(request_id)
        return record.run(self._check_group(group).index).block_ids

    # ---- metadata tensors ----------------------------------------------------------------
    def _metadata_records(self, request_ids: object) -> list[RequestRecord]:
        rids = self._requests.check_ids(request_ids, unique=False, nonempty=False)
        return self._requests.active_records(rids, "read the block table of")

    def block_tables(self, request_ids: Sequence[RequestId], *, group: int = 0) -> torch.Tensor:
        """int32 ``[len(request_ids), width]`` of ``group`` on the cache's device, 0-padded
        (a window group's released entries read 0)."""
        g = self._check_group(group)
        records = self._metadata_records(request_ids)
        table = np.zeros((len(records), g.width), dtype=np.int32)
        index = g.index
        for row, rec in zip(table, records, strict=True):
            run = rec.run(index)
            row[run.first_block : run.num_blocks] = run.table[run.first_block : run.num_blocks]
        return torch.from_numpy(table).to(self._device)

    def seq_lens_tensor(self, request_ids: Sequence[RequestId]) -> torch.Tensor:
        """int32 ``[len(request_ids)]`` committed lengths on the cache's device."""
        records = self._metadata_records(request_ids)
        lens = [rec.seq_len for rec in records]
        return torch.tensor(lens, dtype=torch.int32).to(self._device)

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
            k, v = group.quantize(k, v)
        self.append_with(
            rids, lambda k_layer, v_layer, slots: torch_scatter(k_layer, v_layer, k, v, slots)
        )

    def append_with(self, request_ids: Sequence[RequestId], writer: LayerWriter[T]) -> T:
        """The legacy single-layer append with a caller-supplied writer (one token each).

        Reserves one slot per request (all or nothing), calls ``writer(k_layer, v_layer, slots)``
        and publishes the tokens; if the writer raises, the reservation is released and nothing
        changes. Returns what the writer returned. ``slots`` are fresh tensors (with block tables
        covering the new tokens) that the caller may keep.
        """
        rids = self._requests.check_ids(request_ids, unique=True, nonempty=True)
        if self._num_layers != 1:
            raise RuntimeError(
                f"append works only on a single-layer cache (num_layers={self._num_layers}); "
                "use begin_token / write_token_layer / commit_token"
            )
        records = self._requests.active_records(rids, "append to")
        self._tx.ensure_none_open("append")
        counts = [1] * len(records)
        plan = self._plan(records, counts)
        self._take_all(plan, one_each=True)
        group, part = self._groups[0], plan.groups[0]
        try:
            slots = fresh_slots(group, plan, part)
            result = writer(*self._layers[0], slots)
        except BaseException:
            self._release(plan.reserved())
            raise
        self._publish(records, counts, plan.reserved(), [p.starts for p in plan.groups])
        self._version += 1
        return result

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
        :meth:`transaction_backup` before storing (the fused append kernel does, in the same
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
            return self._open(rids, plan, slots, one_each=True, backup_by_writer=backup_by_writer)
        except BaseException:
            self._release(plan.reserved())
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
            layer = self._check_layer_index(layer_idx)
            done = f"layers 0..{tx.next_layer - 1} are written" if tx.next_layer else "none written"
            raise RuntimeError(
                f"token transaction {tx.transaction_id}: layer {layer} written out of order "
                f"({done}); expected layer {tx.next_layer}"
            )
        if layer_idx >= self._num_layers:
            self._check_layer_index(layer_idx)
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
            k, v = group.quantize(k, v)
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

    def write_all_layers_with(self, tx: TokenTransactionView | int, writer: Callable[[], T]) -> T:
        """Write every layer of an open transaction with one call (a CUDA-graph replay).

        Needs a transaction with no layer written yet; ``writer()`` must store every layer's
        reserved slots (e.g. replay a graph captured over a step's layers).
        """
        open_tx = self._tx.resolve(tx)
        if open_tx.next_layer != 0:
            raise RuntimeError(
                f"token transaction {open_tx.transaction_id} already has {open_tx.next_layer} "
                "layer(s) written; write_all_layers_with needs a fresh transaction"
            )
        open_tx.attempted = self._num_layers
        result = writer()
        open_tx.next_layer = self._num_layers
        return result

    def transaction_backup(
        self, tx: TokenTransactionView | int, *, group: int = 0
    ) -> torch.Tensor | None:
        """Where the writers of an open ``backup_by_writer`` transaction save the old bytes of
        ``group``'s slots: ``[2 * layers_in_group, T * Hkv, D]`` in the group's dtype; layer
        ``i`` of the group (its i-th layer) has K rows at ``[i]`` and V rows at
        ``[layers_in_group + i]``, slot row ``t * Hkv + h`` for token ``t``, KV head ``h``.
        Fixed addresses for a batch size (until a bigger batch replaces the slot buffers). None
        when the transaction's backup is not the writers' (or there is none)."""
        open_tx = self._tx.resolve(tx)
        return open_tx.writer_backup(self._check_group(group))

    def complete_backup(self, tx: TokenTransactionView | int) -> None:
        """Copy every layer's reserved slots of an open ``backup_by_writer`` transaction into its
        backup now: abort then restores all layers whatever the writers did (e.g. kernels
        recorded in a CUDA graph capture that never ran). Needs no layer written yet."""
        self._tx.resolve(tx).complete_backup(self._groups)

    def transaction_view(
        self, tx: TokenTransactionView | int, *, group: int = 0
    ) -> TokenTransactionView:
        """A fresh detached view of an *open* transaction, with ``group``'s blocks (block id -1
        for a token a window group does not store)."""
        open_tx = self._tx.resolve(tx)
        g = self._check_group(group)
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

    def layers_written(self, tx: TokenTransactionView | int) -> int:
        """How many layers of an open transaction are written (they go in order from 0)."""
        return self._tx.resolve(tx).next_layer

    def transaction_slots(
        self, tx: TokenTransactionView | int, *, group: int = 0
    ) -> TransactionSlots:
        """The open transaction's device metadata in ``group`` (the cache's own tensors: read,
        never write)."""
        open_tx = self._tx.resolve(tx)
        if group == 0 and type(group) is int:
            return open_tx.slots
        return open_tx.group_slots[self._check_group(group).index]

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
        self._version = version
        return view

    # ---- shared prefixes -----------------------------------------------------------------
    def _prefix_groups(self) -> list[LayerGroup]:
        if not self._shares_prefixes:
            raise RuntimeError(
                "shared prefixes need full-attention KV groups; this cache has "
                f"{format_kv_spec(self._specs)!r}"
            )
        return self._groups

    def _check_prefix_blocks(self, k_blocks: object, v_blocks: object) -> list[tuple]:
        """Per group ``(k, v)`` ``[layers_in_group, n, Hkv, block_size, D]``: a list with one
        tensor per group (a single-group cache also takes the tensors themselves)."""
        groups = self._groups
        if self._single and not (isinstance(k_blocks, (list, tuple)) and len(k_blocks) == 1):
            pairs = [(k_blocks, v_blocks)]
        else:
            for name, value in (("k_blocks", k_blocks), ("v_blocks", v_blocks)):
                if not isinstance(value, (list, tuple)) or len(value) != len(groups):
                    raise TypeError(
                        f"{name} must be a list of {len(groups)} tensors (one per KV group), "
                        f"got {type(value).__name__}"
                    )
            pairs = list(zip(k_blocks, v_blocks, strict=True))
        checked = []
        num_blocks = None
        for g, (k, v) in zip(groups, pairs, strict=True):
            at = "" if self._single else f"[{g.index}]"
            k = check_tensor(f"k_blocks{at}", k, ndim=5, dtypes=(g.dtype,), device=self._device)
            v = check_tensor(f"v_blocks{at}", v, ndim=5, dtypes=(g.dtype,), device=self._device)
            n = k.shape[1] if num_blocks is None else num_blocks
            expected = (len(g.layers), n, g.num_kv_heads, g.block_size, g.head_dim)
            check_shape(f"k_blocks{at}", k, expected)
            check_shape(f"v_blocks{at}", v, expected)
            num_blocks = n
            if n < 1:
                raise ValueError("a prefix needs at least one block (k_blocks.shape[1] >= 1)")
            if n > g.width:
                raise ValueError(f"a prefix of {n} blocks exceeds max_blocks_per_seq={g.width}")
            checked.append((k, v))
        return checked

    def register_prefix(self, prefix_id: PrefixId, k_blocks: Any, v_blocks: Any) -> PrefixState:
        """Copy full blocks ``[num_layers, n, Hkv, block_size, D]`` into prefix-owned blocks
        (a grouped cache: lists with one ``[layers_in_group, n, ...]`` tensor per group)."""
        pid = check_request_id("prefix_id", prefix_id)
        groups = self._prefix_groups()
        blocks = self._check_prefix_blocks(k_blocks, v_blocks)
        num_blocks = blocks[0][0].shape[1]
        self._tx.ensure_none_open("register a prefix")
        # the registries see the same calls, so their LRU orders agree: evicting the longest
        # run any group needs fits every group
        victims = max((g.prefixes.plan_register(pid, num_blocks) for g in groups), key=len)
        for group, (k, v) in zip(groups, blocks, strict=True):
            block_ids, _ = group.prefixes.register(pid, num_blocks, victims)
            index = torch.tensor(block_ids, dtype=torch.long, device=self._device)
            group.k[:, index] = k
            group.v[:, index] = v
        self._version += 1
        return self._prefixes.state(pid)

    def attach_prefix(self, request_id: RequestId, prefix_id: PrefixId) -> None:
        """Start an empty active request with a resident prefix (its blocks shared)."""
        record = self._requests.record(request_id)
        pid = check_request_id("prefix_id", prefix_id)
        groups = self._prefix_groups()
        self._prefixes.block_ids(pid)  # ValueError when unknown
        self._tx.ensure_none_open("attach a prefix")
        require_active(record, "attach a prefix to")
        if record.seq_len or record.num_blocks or record.prefix_id is not None:
            raise RuntimeError(
                f"attach_prefix needs an empty request; {record.request_id!r} already holds "
                f"{record.seq_len} tokens"
            )
        for group in groups:
            block_ids = group.prefixes.block_ids(pid)
            run = record.run(group.index)
            n = len(block_ids)
            run.table[:n] = block_ids
            group.pending_updates += [(record.row, i, b) for i, b in enumerate(block_ids)]
            run.num_blocks = run.num_prefix_blocks = n
            group.prefixes.attach(pid)
        record.prefix_id = pid
        record.seq_len = record.num_blocks * groups[0].block_size
        self._version += 1

    def evict_prefix(self, prefix_id: PrefixId) -> None:
        """Free an inactive prefix's blocks (RuntimeError while requests use it)."""
        pid = check_request_id("prefix_id", prefix_id)
        self._prefixes.block_ids(pid)  # ValueError when unknown
        self._tx.ensure_none_open("evict a prefix")
        self._prefixes.check_evictable(pid)
        for group in self._groups:
            group.prefixes.evict(pid)
        self._version += 1

    def prefix_state(self, prefix_id: PrefixId, *, group: int = 0) -> PrefixState:
        """The prefix as ``group`` holds it (the groups agree on all but the block ids)."""
        g = self._check_group(group)
        return g.prefixes.state(check_request_id("prefix_id", prefix_id))

    def prefix_ids(self) -> list[PrefixId]:
        """Resident prefixes in registration order."""
        return self._prefixes.ids()

    # ---- observability (flashdec.cache.audit) ---------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counters (block counts summed over groups) and ``"groups"``: one dict per group."""
        return cache_metrics(self._groups, self._requests, self._tx, self._version)

    def validate_invariants(self) -> None:
        """RuntimeError on any inconsistency between requests, prefixes, blocks and the open
        transaction, in every group. O(blocks + active requests * table width): a terminal
        request holds nothing, so a block the allocator still gives one is reported as owned
        by neither an active request nor a prefix."""
        check_invariants(self._groups, self._requests, self._tx, self._num_layers)
