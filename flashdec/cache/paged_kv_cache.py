"""``PagedKVCache``: the single source of truth for request lengths, block ownership, shared
prefixes and the open token transaction.

It composes a policy-free ``BlockAllocator``, a ``PrefixRegistry``, a ``TransactionLog`` and the
device mirror of the block tables (``DeviceTables``), and owns the K/V storage
``[num_layers, max_blocks, num_kv_heads, block_size, head_dim]`` (token-major). Every public method
validates all of its arguments, then the cache's state, and only then mutates; a rejected call
changes nothing (no block taken, no length moved, no version bump).

The cache writes K/V itself only with PyTorch (``write_token_layer``, ``append``). Faster writers
(the Triton kernels) are the engine's: they run through ``write_token_layer_with``, where the
cache keeps the bookkeeping (layer order, the reservation) and the caller supplies the launch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from flashdec._checks import (
    FLOAT_DTYPES,
    check_positive_int,
    check_request_id,
    check_shape,
    check_tensor,
)
from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.device_tables import DeviceTables
from flashdec.cache.prefix_registry import PrefixRegistry
from flashdec.cache.state import PrefixId, PrefixState, RequestId, RequestRecord, RequestState
from flashdec.cache.transaction import (
    HISTORY_LIMIT,
    OpenTransaction,
    SlotBuffers,
    TokenTransactionView,
    TransactionLog,
    TransactionSlots,
    TransactionState,
)

T = TypeVar("T")
# a writer stores one layer's K/V of a reservation: writer(k_layer, v_layer, slots)
LayerWriter = Callable[[torch.Tensor, torch.Tensor, TransactionSlots], T]


_NO_UPDATES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def request_owner(request_id: RequestId) -> tuple[str, RequestId]:
    return ("request", request_id)


def _device_of(device: object) -> torch.device:
    """A usable torch device, else TypeError (wrong type) / ValueError (not available)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"invalid device {device!r}: {err}") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r} is not available: this PyTorch has no usable CUDA "
                "device (use device='cpu')"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r} is not available: {torch.cuda.device_count()} CUDA "
                "device(s) present"
            )
    elif device.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    return device


def torch_scatter(
    k_layer: torch.Tensor, v_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots
) -> None:
    """``k_layer[block_ids[t], :, offsets[t]] = k[t]`` (same for v): one index_put each."""
    count = slots.num_tokens
    block_ids, offsets = slots.block_ids[:count], slots.offsets[:count]
    k_layer[block_ids, :, offsets] = k  # [T, Hkv, D]
    v_layer[block_ids, :, offsets] = v


class _Reservation:
    """What a transaction takes, planned on the host before anything changes."""

    __slots__ = ("block_ids", "counts", "positions", "records", "reserved", "table_rows", "updates")

    def __init__(self, records: list[RequestRecord], counts: list[int]) -> None:
        self.records = records
        self.counts = counts
        self.positions: np.ndarray | None = None  # [T] int64
        self.block_ids: np.ndarray | None = None  # [T] int64
        self.reserved: dict[RequestId, list[int]] = {}
        # device-table writes (row, logical block, block id) and, per request, the view's
        # (committed table row, committed blocks, reserved blocks)
        self.updates: list[tuple[int, int, int]] = []
        self.table_rows: list[tuple[np.ndarray, int, list[int]]] = []


class PagedKVCache:
    """A paged K/V cache for ``num_layers`` layers sharing one block-id space.

    Args:
        num_layers, num_kv_heads, head_dim, block_size, max_blocks: storage geometry
            (``head_dim`` even: RoPE rotates pairs of dims).
        dtype: fp16, bf16 or fp32.
        device: ``"cpu"`` or a CUDA device that exists (ValueError otherwise).
        prefix_cache_capacity_blocks: budget for shared prefixes (``<= max_blocks``); 0 turns
            the feature off.
        max_blocks_per_seq: block-table width (None: ``max_blocks``; never more).
        restore_on_abort: abort puts back the bytes a transaction overwrote, so an aborted token
            leaves the storage bit-identical (costs one gather of the reserved slots per token).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_blocks: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cuda",
        prefix_cache_capacity_blocks: int = 0,
        max_blocks_per_seq: int | None = None,
        *,
        restore_on_abort: bool = True,
    ) -> None:
        self._num_layers = check_positive_int("num_layers", num_layers)
        self._num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self._head_dim = check_positive_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs of dims), got {head_dim}")
        self._block_size = check_positive_int("block_size", block_size)
        self._max_blocks = check_positive_int("max_blocks", max_blocks)
        if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        capacity = check_positive_int(
            "prefix_cache_capacity_blocks", prefix_cache_capacity_blocks, minimum=0
        )
        if capacity > max_blocks:
            raise ValueError(
                f"prefix_cache_capacity_blocks ({capacity}) must not exceed max_blocks "
                f"({max_blocks})"
            )
        if max_blocks_per_seq is None:
            max_blocks_per_seq = self._max_blocks
        self._max_blocks_per_seq = check_positive_int("max_blocks_per_seq", max_blocks_per_seq)
        if max_blocks_per_seq > max_blocks:
            raise ValueError(
                f"max_blocks_per_seq ({max_blocks_per_seq}) must not exceed max_blocks "
                f"({max_blocks}): a request can never hold more blocks than the pool"
            )
        if not isinstance(restore_on_abort, bool):
            raise TypeError("restore_on_abort must be a bool")
        device = _device_of(device)
        self._restore_on_abort = restore_on_abort
        self._dtype = dtype

        shape = (num_layers, max_blocks, num_kv_heads, block_size, head_dim)
        # one allocation for K and V (zero-filled so never-written slots hold finite numbers):
        # the abort backup of a token's slots is then one gather over both
        self._kv = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.k_cache, self.v_cache = self._kv[0], self._kv[1]
        self._device = self.k_cache.device
        self._layers = [(self.k_cache[i], self.v_cache[i]) for i in range(num_layers)]

        self._allocator = BlockAllocator(max_blocks)
        self._prefixes = PrefixRegistry(self._allocator, capacity, block_size)
        self._tx = TransactionLog(HISTORY_LIMIT)
        self._requests: dict[RequestId, RequestRecord] = {}  # insertion order, never shrinks
        self._version = 0
        self._tables = DeviceTables(self._max_blocks_per_seq, self._device)
        self._slot_buffers: SlotBuffers | None = None  # made for the first one-token batch
        self._pending_updates: list[tuple[int, int, int]] = []  # device-table writes to flush

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self._num_layers}, num_kv_heads={self._num_kv_heads}, "
            f"head_dim={self._head_dim}, block_size={self._block_size}, "
            f"max_blocks={self._max_blocks}, dtype={self._dtype}, device={self._device}, "
            f"free={self._allocator.num_free}, requests={len(self._requests)}, "
            f"prefixes={len(self._prefixes)}, version={self._version})"
        )

    # ---- geometry and simple queries -----------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_blocks(self) -> int:
        return self._max_blocks

    @property
    def num_blocks(self) -> int:
        return self._max_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self._max_blocks_per_seq

    @property
    def prefix_cache_capacity_blocks(self) -> int:
        return self._prefixes.capacity_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers."""
        elems = 2 * self._num_layers * self._num_kv_heads * self._block_size * self._head_dim
        return elems * self.k_cache.element_size()

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
        return self._allocator.num_free

    @property
    def open_transaction_id(self) -> int | None:
        tx = self._tx.open
        return None if tx is None else tx.transaction_id

    def _slot_rows_view(self) -> torch.Tensor:
        """``[2 * L, blocks * Hkv * block_size, D]``: K then V storage as rows of head_dim."""
        return self._kv.view(2 * self._num_layers, -1, self._head_dim)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[max_blocks, Hkv, block_size, D]`` of one layer's K and V."""
        return self._layers[self._check_layer_index(layer_idx)]

    # ---- argument helpers ----------------------------------------------------------------
    def _check_layer_index(self, layer_idx: object) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx must be in [0, {self._num_layers}), got {layer_idx}")
        return layer_idx

    def _record(self, request_id: object) -> RequestRecord:
        record = self._requests.get(request_id) if type(request_id) in (str, int) else None
        if record is None:
            rid = check_request_id("request_id", request_id)
            raise ValueError(f"unknown request id {rid!r}")
        return record

    @staticmethod
    def _require_active(record: RequestRecord, action: str) -> None:
        if record.state is not RequestState.ACTIVE:
            raise RuntimeError(
                f"cannot {action} request {record.request_id!r}: it is {record.state.value}, "
                "expected active"
            )

    def _check_ids(self, request_ids: object, *, unique: bool, nonempty: bool) -> list[RequestId]:
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise TypeError(
                f"request_ids must be a list or tuple of ids, got {type(request_ids).__name__}"
            )
        rids = list(request_ids)
        known = self._requests
        for rid in rids:
            if type(rid) not in (str, int) or rid not in known:  # fast path first
                check_request_id("request id", rid)
                if rid not in known:
                    raise ValueError(f"unknown request id {rid!r}")
        if nonempty and not rids:
            raise ValueError("request_ids must not be empty")
        if unique and len(set(rids)) != len(rids):
            twice = sorted({repr(r) for r, n in Counter(rids).items() if n > 1})
            raise ValueError(f"request_ids lists {', '.join(twice)} more than once")
        return rids

    def _active_records(self, rids: list[RequestId], action: str) -> list[RequestRecord]:
        records = [self._requests[rid] for rid in rids]
        active = RequestState.ACTIVE
        for record in records:
            if record.state is not active:
                self._require_active(record, action)
        return records

    def _check_token_kv(self, name: str, value: object, num_tokens: int) -> torch.Tensor:
        tensor = check_tensor(name, value, ndim=3, dtypes=(self._dtype,), device=self._device)
        check_shape(name, tensor, (num_tokens, self._num_kv_heads, self._head_dim))
        return tensor

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, request_id: RequestId) -> None:
        """Register a new, empty, active request (ids are never reused)."""
        rid = check_request_id("request_id", request_id)
        if rid in self._requests:
            state = self._requests[rid].state.value
            raise ValueError(f"request id {rid!r} already exists ({state}); ids are not reused")
        self._tx.ensure_none_open("add a request")
        self._requests[rid] = RequestRecord(rid, self._max_blocks_per_seq, self._tables.acquire())
        self._version += 1

    def finish_request(self, request_id: RequestId) -> None:
        """Release the request's private blocks and prefix reference; state -> finished."""
        self._terminate(request_id, RequestState.FINISHED)

    def cancel_request(self, request_id: RequestId) -> None:
        """Like ``finish_request`` but the state becomes cancelled."""
        self._terminate(request_id, RequestState.CANCELLED)

    def _terminate(self, request_id: RequestId, state: RequestState) -> None:
        record = self._record(request_id)
        verb = "finish" if state is RequestState.FINISHED else "cancel"
        self._tx.ensure_none_open(f"{verb} a request")
        self._require_active(record, verb)
        self._allocator.release(record.private_block_ids, request_owner(record.request_id))
        if record.prefix_id is not None:
            self._prefixes.detach(record.prefix_id)
        record.clear()
        record.state = state
        self._tables.release(record.row)
        record.row = -1
        self._version += 1

    def request_state(self, request_id: RequestId) -> RequestState:
        return self._record(request_id).state

    def request_ids(self, state: RequestState | str | None = None) -> list[RequestId]:
        """Known request ids in insertion order, optionally only those in ``state``."""
        if state is None:
            return list(self._requests)
        if not isinstance(state, str):
            raise TypeError(
                f"state must be a RequestState, str or None, got {type(state).__name__}"
            )
        try:
            wanted = RequestState(state)
        except ValueError as err:
            values = [s.value for s in RequestState]
            raise ValueError(f"state must be one of {values}, got {state!r}") from err
        return [rid for rid, rec in self._requests.items() if rec.state is wanted]

    def request_prefix(self, request_id: RequestId) -> PrefixId | None:
        return self._record(request_id).prefix_id

    def seq_len(self, request_id: RequestId) -> int:
        """Committed tokens (a finished/cancelled request keeps its final length)."""
        return self._record(request_id).seq_len

    def request_block_ids(self, request_id: RequestId) -> list[int]:
        """Physical ids in logical order (prefix blocks first); empty once terminal."""
        return self._record(request_id).block_ids

    # ---- metadata tensors ----------------------------------------------------------------
    def _metadata_records(self, request_ids: object) -> list[RequestRecord]:
        rids = self._check_ids(request_ids, unique=False, nonempty=False)
        return self._active_records(rids, "read the block table of")

    def block_tables(self, request_ids: Sequence[RequestId]) -> torch.Tensor:
        """int32 ``[len(request_ids), max_blocks_per_seq]`` on the cache's device, 0-padded."""
        records = self._metadata_records(request_ids)
        table = np.zeros((len(records), self._max_blocks_per_seq), dtype=np.int32)
        for row, rec in zip(table, records, strict=True):
            row[: rec.num_blocks] = rec.table[: rec.num_blocks]
        return torch.from_numpy(table).to(self._device)

    def seq_lens_tensor(self, request_ids: Sequence[RequestId]) -> torch.Tensor:
        """int32 ``[len(request_ids)]`` committed lengths on the cache's device."""
        records = self._metadata_records(request_ids)
        lens = [rec.seq_len for rec in records]
        return torch.tensor(lens, dtype=torch.int32).to(self._device)

    # ---- reservations shared by append and the transactions --------------------------------
    def _plan(self, records: list[RequestRecord], counts: list[int]) -> _Reservation:
        """Check that every listed request can take its tokens; changes nothing."""
        bs, width = self._block_size, self._max_blocks_per_seq
        wanted = 0
        for rec, n in zip(records, counts, strict=True):
            end_blocks = -(-(rec.seq_len + n) // bs)
            if end_blocks > width:
                raise RuntimeError(
                    f"request {rec.request_id!r} is full: {rec.seq_len} + {n} tokens need "
                    f"{end_blocks} blocks of {bs}, more than max_blocks_per_seq={width}"
                )
            wanted += end_blocks - rec.num_blocks
        if wanted > self._allocator.num_free:
            raise RuntimeError(
                f"out of KV blocks: this token needs {wanted} new block(s) but only "
                f"{self._allocator.num_free} are free; nothing was changed"
            )
        return _Reservation(records, counts)

    def _take(self, plan: _Reservation) -> None:
        """Allocate the planned blocks and fill in the reservation (all or nothing)."""
        bs = self._block_size
        positions: list[int] = []
        block_ids: list[int] = []
        try:
            for rec, n in zip(plan.records, plan.counts, strict=True):
                start = rec.seq_len
                committed = rec.num_blocks
                new = -(-(start + n) // bs) - committed
                taken = self._allocator.allocate(new, request_owner(rec.request_id)) if new else []
                if taken:
                    plan.reserved[rec.request_id] = taken
                    plan.updates += [(rec.row, committed + i, b) for i, b in enumerate(taken)]
                plan.table_rows.append((rec.table, committed, taken))
                table = rec.table
                for pos in range(start, start + n):
                    logical = pos // bs
                    positions.append(pos)
                    block_ids.append(
                        int(table[logical]) if logical < committed else taken[logical - committed]
                    )
        except BaseException:
            self._release(plan.reserved)
            raise
        plan.positions = np.asarray(positions, dtype=np.int64)
        plan.block_ids = np.asarray(block_ids, dtype=np.int64)

    def _take_one_each(self, plan: _Reservation) -> None:
        """``_take`` for one token per request (the decode step's hot path)."""
        bs = self._block_size
        num = len(plan.records)
        positions = np.empty(num, dtype=np.int64)
        block_ids = np.empty(num, dtype=np.int64)
        allocate = self._allocator.allocate
        try:
            for i, rec in enumerate(plan.records):
                pos = rec.seq_len
                logical = pos // bs
                positions[i] = pos
                if logical < rec.num_blocks:
                    block_ids[i] = rec.table[logical]
                    plan.table_rows.append((rec.table, rec.num_blocks, ()))
                else:
                    (block,) = allocate(1, request_owner(rec.request_id))
                    plan.reserved[rec.request_id] = [block]
                    plan.updates.append((rec.row, logical, block))
                    block_ids[i] = block
                    plan.table_rows.append((rec.table, rec.num_blocks, (block,)))
        except BaseException:
            self._release(plan.reserved)
            raise
        plan.positions = positions
        plan.block_ids = block_ids

    def _release(self, reserved: dict[RequestId, list[int]]) -> None:
        for rid, block_ids in reserved.items():
            self._allocator.release(block_ids, request_owner(rid))

    def _publish(self, records: list[RequestRecord], counts: list[int], reserved) -> None:
        for rec, n in zip(records, counts, strict=True):
            for block_id in reserved.get(rec.request_id, ()):
                rec.push_block(block_id)
            rec.seq_len += n

    def _flush_updates(self, plan: _Reservation) -> list[tuple[int, int, int]]:
        updates = self._pending_updates + plan.updates if self._pending_updates else plan.updates
        self._pending_updates = []
        return updates

    def _flat_updates(self, updates: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Device-table writes ``(row, logical block, block id)`` as flat indices and values."""
        if not updates:
            return _NO_UPDATES
        arr = np.asarray(updates, dtype=np.int64)
        return arr[:, 0] * self._max_blocks_per_seq + arr[:, 1], arr[:, 2]

    def _fresh_slots(self, plan: _Reservation, with_tables: bool) -> TransactionSlots:
        """Device metadata in new tensors (prompt imports, legacy append)."""
        positions, block_ids = plan.positions, plan.block_ids
        bs, hkv = self._block_size, self._num_kv_heads
        offsets = positions % bs
        starts = np.asarray([rec.seq_len for rec in plan.records], dtype=np.int64)
        after = starts + np.asarray(plan.counts, dtype=np.int64)
        heads = np.arange(hkv, dtype=np.int64)
        slot_rows = (block_ids.astype(np.int64)[:, None] * hkv + heads) * bs + offsets[:, None]
        flat, values = self._flat_updates(self._flush_updates(plan))
        rows = np.asarray([rec.row for rec in plan.records], dtype=np.int64)
        t, b, u = positions.shape[0], starts.shape[0], flat.shape[0]
        host = np.concatenate(
            [positions, block_ids, offsets, starts, after, rows, flat, values,
             slot_rows.reshape(-1)], dtype=np.int64,
        )  # fmt: skip
        dev = torch.from_numpy(host).to(self._device)
        cuts = np.cumsum([t, t, t, b, b, b, u, u])
        parts = torch.tensor_split(dev, cuts.tolist())
        if u:
            self._tables.write(parts[6], parts[7])
        tables = None
        if with_tables:
            tables = torch.empty(b, self._max_blocks_per_seq, dtype=torch.int64, device=dev.device)
            self._tables.gather(parts[5], out=tables)
        return TransactionSlots(
            batch=b,
            num_rows=b,
            num_tokens=t,
            generation=-1,
            positions=parts[0],
            block_ids=parts[1],
            offsets=parts[2],
            seq_lens=parts[3],
            seq_lens_after=parts[4],
            slot_rows=parts[8],
            block_tables=tables,
            request_slots=parts[5],
        )

    def _fixed_slots(self, plan: _Reservation, num_rows: int) -> TransactionSlots:
        """Device metadata of a one-token transaction in the fixed-address buffers."""
        buffers = self._slot_buffers
        if buffers is None or num_rows > buffers.capacity:
            capacity = 1 << max(3, (num_rows - 1).bit_length())
            generation = 0 if buffers is None else buffers.generation + 1
            buffers = self._slot_buffers = SlotBuffers(
                capacity, self._num_kv_heads, self._max_blocks_per_seq, self._device, generation
            )
        flat, values = self._flat_updates(self._flush_updates(plan))
        if flat.shape[0] > buffers.capacity:  # a long prefix attached since the last step
            self._tables.write(*(torch.from_numpy(a).to(self._device) for a in (flat, values)))
            flat, values = _NO_UPDATES
        num = len(plan.records)
        rows = np.fromiter((rec.row for rec in plan.records), dtype=np.int64, count=num)
        buffers.upload(plan.positions, plan.block_ids, rows, (flat, values), self._block_size,
                       num_rows)  # fmt: skip
        count = flat.shape[0]
        if count:
            self._tables.write(
                buffers.region(buffers.UPDATE_INDEX, count),
                buffers.region(buffers.UPDATE_VALUE, count),
            )
        slots = buffers.slots(num, num_rows)
        self._tables.gather(buffers.region(buffers.TABLE_ROWS, num_rows), out=slots.block_tables)
        return slots

    # ---- legacy single-layer append --------------------------------------------------------
    def append(self, request_ids: Sequence[RequestId], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token per request (``k, v [B, Hkv, D]``) at its seq_len; num_layers == 1."""
        rids = self._check_ids(request_ids, unique=True, nonempty=True)
        k = self._check_token_kv("k", k, len(rids))
        v = self._check_token_kv("v", v, len(rids))
        self.append_with(rids, lambda k_layer, v_layer, slots: torch_scatter(
            k_layer, v_layer, k, v, slots))  # fmt: skip

    def append_with(self, request_ids: Sequence[RequestId], writer: LayerWriter[T]) -> T:
        """The legacy single-layer append with a caller-supplied writer (one token each).

        Reserves one slot per request (all or nothing), calls ``writer(k_layer, v_layer, slots)``
        and publishes the tokens; if the writer raises, the reservation is released and nothing
        changes. Returns what the writer returned. ``slots`` are fresh tensors (with block tables
        covering the new tokens) that the caller may keep.
        """
        rids = self._check_ids(request_ids, unique=True, nonempty=True)
        if self._num_layers != 1:
            raise RuntimeError(
                f"append works only on a single-layer cache (num_layers={self._num_layers}); "
                "use begin_token / write_token_layer / commit_token"
            )
        records = self._active_records(rids, "append to")
        self._tx.ensure_none_open("append")
        counts = [1] * len(records)
        plan = self._plan(records, counts)
        self._take_one_each(plan)
        try:
            slots = self._fresh_slots(plan, with_tables=True)
            result = writer(*self._layers[0], slots)
        except BaseException:
            self._release(plan.reserved)
            raise
        self._publish(records, counts, plan.reserved)
        self._version += 1
        return result

    # ---- multi-layer token transactions ----------------------------------------------------
    def begin_token(
        self, request_ids: Sequence[RequestId], *, pad_to: int | None = None
    ) -> TokenTransactionView:
        """Reserve one slot per request (taking a block where the last one is full).

        The transaction's device metadata sits in fixed-address buffers, so the layers of a step
        captured in a CUDA graph can be replayed for a later step of the same batch. ``pad_to``
        (>= the batch) adds padding rows that writers skip and decode sees as empty: a graph
        captured for ``pad_to`` rows serves this smaller batch.
        """
        rids = self._check_ids(request_ids, unique=True, nonempty=True)
        num_rows = len(rids)
        if pad_to is not None:
            num_rows = check_positive_int("pad_to", pad_to)
            if num_rows < len(rids):
                raise ValueError(f"pad_to ({pad_to}) must be >= the batch size ({len(rids)})")
        records = self._active_records(rids, "begin a token for")
        self._tx.ensure_none_open("begin a token transaction")
        plan = self._plan(records, [1] * len(records))
        self._take_one_each(plan)
        try:
            slots = self._fixed_slots(plan, num_rows)
            return self._open(rids, plan, slots)
        except BaseException:
            self._release(plan.reserved)
            raise

    def begin_tokens(
        self, request_ids: Sequence[RequestId], num_tokens: Sequence[int]
    ) -> TokenTransactionView:
        """Reserve ``num_tokens[i]`` consecutive slots for request ``i`` (a prompt import).

        Same transaction rules as :meth:`begin_token`; each layer's write then takes
        ``k, v [sum(num_tokens), Hkv, D]``, request by request in order.
        """
        rids = self._check_ids(request_ids, unique=True, nonempty=True)
        if isinstance(num_tokens, (str, bytes)) or not isinstance(num_tokens, Sequence):
            raise TypeError(f"num_tokens must be a list or tuple, got {type(num_tokens).__name__}")
        if len(num_tokens) != len(rids):
            raise ValueError(
                f"num_tokens has {len(num_tokens)} entries for {len(rids)} request ids"
            )
        counts = [check_positive_int(f"num_tokens[{i}]", n) for i, n in enumerate(num_tokens)]
        records = self._active_records(rids, "begin tokens for")
        self._tx.ensure_none_open("begin a token transaction")
        plan = self._plan(records, counts)
        self._take(plan)
        try:
            slots = self._fresh_slots(plan, with_tables=False)
            return self._open(rids, plan, slots)
        except BaseException:
            self._release(plan.reserved)
            raise

    def _open(
        self, rids: list[RequestId], plan: _Reservation, slots: TransactionSlots
    ) -> TokenTransactionView:
        starts = np.fromiter((rec.seq_len for rec in plan.records), np.int32, len(plan.records))
        positions = plan.positions.astype(np.int32)  # views show SPEC's int32 metadata
        host = {
            "positions": positions,
            "block_ids": plan.block_ids.astype(np.int32),
            "offsets": positions % self._block_size,
            "seq_lens": starts,
            "seq_lens_after": starts + np.asarray(plan.counts, dtype=np.int32),
        }
        tx = OpenTransaction(
            self._tx.next_id(), self._version + 1, tuple(rids), plan.counts, plan.reserved,
            slots, host, plan.table_rows,
        )  # fmt: skip
        if self._restore_on_abort:  # [2L, T * Hkv, D] old K and V bytes of the reserved slots
            tx.backup = self._slot_rows_view().index_select(1, slots.slot_rows)
        view = tx.view(TransactionState.OPEN, tx.cache_version, self._max_blocks_per_seq,
                       self._device)  # fmt: skip
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
        """Store ``k, v [num_tokens, Hkv, D]`` (bitwise, as given) in the layer's reserved slots."""
        open_tx = self._tx.resolve(tx)
        self._check_next_layer(open_tx, layer_idx)
        count = open_tx.slots.num_tokens
        k = self._check_token_kv("k", k, count)
        v = self._check_token_kv("v", v, count)
        self.write_token_layer_with(open_tx.transaction_id, layer_idx,
                                    lambda k_layer, v_layer, slots: torch_scatter(
                                        k_layer, v_layer, k, v, slots))  # fmt: skip

    def write_token_layer_with(
        self, tx: TokenTransactionView | int, layer_idx: int, writer: LayerWriter[T]
    ) -> T:
        """Write the next layer of an open transaction with ``writer(k_layer, v_layer, slots)``.

        The cache checks the transaction and the layer order and counts the layer as written
        only when the writer returns; the writer must store exactly the reserved slots
        (``slots.block_ids`` / ``slots.offsets``, skipping padding rows with block id -1). If it
        raises, the transaction stays open with this layer unwritten (abort it: the backup
        restores any bytes it overwrote). Returns what the writer returned.
        """
        open_tx = self._tx.resolve(tx)
        layer = self._check_next_layer(open_tx, layer_idx)
        k_layer, v_layer = self._layers[layer]
        result = writer(k_layer, v_layer, open_tx.slots)
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
        result = writer()
        open_tx.next_layer = self._num_layers
        return result

    def transaction_view(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """A fresh detached view of an *open* transaction."""
        open_tx = self._tx.resolve(tx)
        return open_tx.view(
            TransactionState.OPEN, open_tx.cache_version, self._max_blocks_per_seq, self._device
        )

    def layers_written(self, tx: TokenTransactionView | int) -> int:
        """How many layers of an open transaction are written (they go in order from 0)."""
        return self._tx.resolve(tx).next_layer

    def transaction_slots(self, tx: TokenTransactionView | int) -> TransactionSlots:
        """The open transaction's device metadata (the cache's own tensors: read, never write)."""
        return self._tx.resolve(tx).slots

    def transaction_decode_inputs(
        self, tx: TokenTransactionView | int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables, seq_lens + 1)`` of an open one-token transaction, for decoding over
        the new token. These are the cache's own device tensors (no copy): read them, never
        write. The write path does not use them, so they cannot redirect a write."""
        slots = self._tx.resolve(tx).slots
        if slots.block_tables is None:
            raise RuntimeError(
                "decode inputs exist only for one-token transactions (begin_token), not for a "
                "prompt import (begin_tokens)"
            )
        batch = slots.batch
        return slots.block_tables[:batch], slots.seq_lens_after[:batch]

    def commit_token(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """Publish the tokens: each request's seq_len grows by its reserved count, once."""
        open_tx = self._tx.resolve(tx)
        if open_tx.next_layer != self._num_layers:
            raise RuntimeError(
                f"cannot commit token transaction {open_tx.transaction_id}: "
                f"{open_tx.next_layer} of {self._num_layers} layers written"
            )
        version = self._version + 1
        view = open_tx.view(TransactionState.COMMITTED, version, self._max_blocks_per_seq,
                            self._device)  # fmt: skip
        records = [self._requests[rid] for rid in open_tx.request_ids]
        self._publish(records, open_tx.counts, open_tx.reserved)
        self._tx.close(TransactionState.COMMITTED, version)
        self._version = version
        return view

    def abort_token(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """Drop the tokens: release the blocks begin took; lengths stay as they were."""
        open_tx = self._tx.resolve(tx)
        version = self._version + 1
        view = open_tx.view(TransactionState.ABORTED, version, self._max_blocks_per_seq,
                            self._device)  # fmt: skip
        if open_tx.backup is not None and open_tx.next_layer > 0:
            self._slot_rows_view().index_copy_(1, open_tx.slots.slot_rows, open_tx.backup)
        self._release(open_tx.reserved)
        self._tx.close(TransactionState.ABORTED, version)
        self._version = version
        return view

    # ---- shared prefixes -----------------------------------------------------------------
    def register_prefix(
        self, prefix_id: PrefixId, k_blocks: torch.Tensor, v_blocks: torch.Tensor
    ) -> PrefixState:
        """Copy full blocks ``[num_layers, n, Hkv, block_size, D]`` into prefix-owned blocks."""
        pid = check_request_id("prefix_id", prefix_id)
        k_blocks = check_tensor(
            "k_blocks", k_blocks, ndim=5, dtypes=(self._dtype,), device=self._device
        )
        v_blocks = check_tensor(
            "v_blocks", v_blocks, ndim=5, dtypes=(self._dtype,), device=self._device
        )
        num_blocks = k_blocks.shape[1]
        expected = (
            self._num_layers,
            num_blocks,
            self._num_kv_heads,
            self._block_size,
            self._head_dim,
        )
        check_shape("k_blocks", k_blocks, expected)
        check_shape("v_blocks", v_blocks, expected)
        if num_blocks < 1:
            raise ValueError("a prefix needs at least one block (k_blocks.shape[1] >= 1)")
        if num_blocks > self._max_blocks_per_seq:
            raise ValueError(
                f"a prefix of {num_blocks} blocks exceeds max_blocks_per_seq="
                f"{self._max_blocks_per_seq}"
            )
        self._tx.ensure_none_open("register a prefix")
        block_ids, _ = self._prefixes.register(pid, num_blocks)
        index = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        self.k_cache[:, index] = k_blocks
        self.v_cache[:, index] = v_blocks
        self._version += 1
        return self._prefixes.state(pid)

    def attach_prefix(self, request_id: RequestId, prefix_id: PrefixId) -> None:
        """Start an empty active request with a resident prefix (its blocks shared)."""
        record = self._record(request_id)
        pid = check_request_id("prefix_id", prefix_id)
        block_ids = self._prefixes.block_ids(pid)  # ValueError when unknown
        self._tx.ensure_none_open("attach a prefix")
        self._require_active(record, "attach a prefix to")
        if record.seq_len or record.num_blocks or record.prefix_id is not None:
            raise RuntimeError(
                f"attach_prefix needs an empty request; {record.request_id!r} already holds "
                f"{record.seq_len} tokens"
            )
        n = len(block_ids)
        record.table[:n] = block_ids
        self._pending_updates += [(record.row, i, b) for i, b in enumerate(block_ids)]
        record.num_blocks = record.num_prefix_blocks = n
        record.prefix_id = pid
        record.seq_len = n * self._block_size
        self._prefixes.attach(pid)
        self._version += 1

    def evict_prefix(self, prefix_id: PrefixId) -> None:
        """Free an inactive prefix's blocks (RuntimeError while requests use it)."""
        pid = check_request_id("prefix_id", prefix_id)
        self._prefixes.block_ids(pid)  # ValueError when unknown
        self._tx.ensure_none_open("evict a prefix")
        self._prefixes.evict(pid)
        self._version += 1

    def prefix_state(self, prefix_id: PrefixId) -> PrefixState:
        return self._prefixes.state(check_request_id("prefix_id", prefix_id))

    def prefix_ids(self) -> list[PrefixId]:
        """Resident prefixes in registration order."""
        return self._prefixes.ids()

    # ---- observability -------------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        states = Counter(rec.state for rec in self._requests.values())
        num_prefix_blocks = self._prefixes.num_blocks
        num_used = self._allocator.num_used
        open_tx = self._tx.open
        return {
            "version": self._version,
            "num_blocks": self._max_blocks,
            "num_free_blocks": self._allocator.num_free,
            "num_used_blocks": num_used,
            "num_private_blocks": num_used - num_prefix_blocks,
            "num_prefix_blocks": num_prefix_blocks,
            "num_reserved_blocks": 0
            if open_tx is None
            else sum(len(b) for b in open_tx.reserved.values()),
            "prefix_cache_capacity_blocks": self._prefixes.capacity_blocks,
            "num_requests": len(self._requests),
            "num_active_requests": states[RequestState.ACTIVE],
            "num_finished_requests": states[RequestState.FINISHED],
            "num_cancelled_requests": states[RequestState.CANCELLED],
            "num_prefixes": len(self._prefixes),
            "prefix_refcount_total": self._prefixes.refcount_total(),
            "num_prefix_evictions": self._prefixes.num_evictions,
            "retained_transaction_state_count": 0 if open_tx is None else 1,
            "terminal_transaction_history_count": len(self._tx.history),
            "terminal_transaction_history_limit": self._tx.history_limit,
            "num_committed_transactions": self._tx.num_committed,
            "num_aborted_transactions": self._tx.num_aborted,
        }

    def validate_invariants(self) -> None:
        """RuntimeError on any inconsistency between requests, prefixes, blocks and the open
        transaction. O(max_blocks + requests * max_blocks_per_seq)."""
        self._allocator.check_integrity()
        owned = self._allocator.owned_blocks()
        open_tx = self._tx.open
        reserved = open_tx.reserved if open_tx is not None else {}
        attached: Counter[PrefixId] = Counter()
        num_private = 0
        bs = self._block_size
        for rid, rec in self._requests.items():
            held = owned.pop(request_owner(rid), [])
            if rec.state is not RequestState.ACTIVE:
                if held or rec.num_blocks or rec.prefix_id is not None or rid in reserved:
                    raise RuntimeError(f"{rec.state.value} request {rid!r} still holds blocks")
                continue
            if rec.num_blocks != -(-rec.seq_len // bs) or rec.num_blocks > rec.table.shape[0]:
                raise RuntimeError(
                    f"request {rid!r}: seq_len {rec.seq_len} needs {-(-rec.seq_len // bs)} "
                    f"blocks, holds {rec.num_blocks}"
                )
            if rec.table[rec.num_blocks :].any():
                raise RuntimeError(f"request {rid!r}: block table padding is not 0")
            if rec.prefix_id is None:
                if rec.num_prefix_blocks:
                    raise RuntimeError(f"request {rid!r} has prefix blocks but no prefix")
            else:
                if rec.prefix_id not in self._prefixes:
                    raise RuntimeError(f"request {rid!r} uses unknown prefix {rec.prefix_id!r}")
                ids = self._prefixes.block_ids(rec.prefix_id)
                if tuple(rec.table[: rec.num_prefix_blocks].tolist()) != ids:
                    raise RuntimeError(f"request {rid!r}: table does not start with its prefix")
                attached[rec.prefix_id] += 1
            private = rec.private_block_ids + list(reserved.get(rid, ()))
            if sorted(private) != held:
                raise RuntimeError(
                    f"request {rid!r}: private blocks {sorted(private)} != allocator's {held}"
                )
            num_private += len(held)
        for owner, ids in owned.items():
            if not (
                isinstance(owner, tuple) and owner[0] == "prefix" and owner[1] in self._prefixes
            ):
                raise RuntimeError(f"blocks {ids} owned by {owner!r}, not a request nor a prefix")
            if sorted(self._prefixes.block_ids(owner[1])) != ids:
                raise RuntimeError(f"prefix {owner[1]!r} blocks disagree with the allocator")
        self._prefixes.check_integrity(attached)
        rows = [rec.row for rec in self._requests.values() if rec.state is RequestState.ACTIVE]
        if len(set(rows)) != len(rows) or any(r < 0 for r in rows):
            raise RuntimeError(f"active requests do not own distinct device-table rows: {rows}")
        if num_private + self._prefixes.num_blocks + self._allocator.num_free != self._max_blocks:
            raise RuntimeError("free + private + prefix blocks != max_blocks")
        if open_tx is not None:
            if not 0 <= open_tx.next_layer <= self._num_layers:
                raise RuntimeError(f"open transaction at impossible layer {open_tx.next_layer}")
            for rid in open_tx.request_ids:
                rec = self._requests.get(rid)
                if rec is None or rec.state is not RequestState.ACTIVE:
                    raise RuntimeError(f"open transaction lists non-active request {rid!r}")
            if not set(reserved) <= set(open_tx.request_ids):
                raise RuntimeError("open transaction reserved a block for a foreign request")
        if len(self._tx.history) > self._tx.history_limit:
            raise RuntimeError("terminal transaction history exceeds its limit")
