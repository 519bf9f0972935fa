"""``PagedKVCache``: the single source of truth for request lengths, block ownership, shared
prefixes and the open token transaction.

It composes a policy-free ``BlockAllocator``, a ``PrefixRegistry`` and a ``TransactionLog`` and
owns the K/V storage ``[num_layers, max_blocks, num_kv_heads, block_size, head_dim]``
(token-major). Every public method validates all of its arguments, then the cache's state, and
only then mutates; a rejected call changes nothing (no block taken, no length moved, no version
bump).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashdec._checks import FLOAT_DTYPES, check_positive_int, check_shape, check_tensor
from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.backends import (
    APPEND_BACKENDS,
    ROPE_BACKENDS,
    check_backend,
    load_launcher,
    torch_scatter,
)
from flashdec.cache.prefix_registry import PrefixRegistry
from flashdec.cache.state import PrefixId, PrefixState, RequestId, RequestRecord, RequestState
from flashdec.cache.transaction import (
    HISTORY_LIMIT,
    OpenTransaction,
    TokenTransactionView,
    TransactionLog,
    TransactionMetadata,
    TransactionState,
)
from flashdec.reference.rope import apply_rope, check_rotary_dim


def request_owner(request_id: RequestId) -> tuple[str, RequestId]:
    return ("request", request_id)


def _check_id(name: str, value: object) -> RequestId:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a str or an int, got {type(value).__name__}")
    return value


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise TypeError(f"base must be a float, got {type(base).__name__}")
    if not 1.0 < base < float("inf"):
        raise ValueError(f"base must be a finite float > 1, got {base!r}")
    return float(base)


class _Slots:
    """Where the next token of each listed request goes (planned, not yet taken)."""

    __slots__ = ("needs_block", "positions", "records")

    def __init__(self, records: list[RequestRecord], positions: list[int], needs: list[bool]):
        self.records = records
        self.positions = positions
        self.needs_block = needs


class PagedKVCache:
    """A paged K/V cache for ``num_layers`` layers sharing one block-id space.

    Args:
        num_layers, num_kv_heads, head_dim, block_size, max_blocks: storage geometry.
        dtype: fp16, bf16 or fp32.
        device: where the storage (and every metadata tensor handed out) lives.
        prefix_cache_capacity_blocks: budget for shared prefixes; 0 turns the feature off.
        max_blocks_per_seq: block-table width (None: ``max_blocks``).
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
        self._block_size = check_positive_int("block_size", block_size)
        self._max_blocks = check_positive_int("max_blocks", max_blocks)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        try:
            device = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"invalid device {device!r}: {err}") from err
        capacity = check_positive_int(
            "prefix_cache_capacity_blocks", prefix_cache_capacity_blocks, minimum=0
        )
        if max_blocks_per_seq is None:
            max_blocks_per_seq = self._max_blocks
        self._max_blocks_per_seq = check_positive_int("max_blocks_per_seq", max_blocks_per_seq)
        if not isinstance(restore_on_abort, bool):
            raise TypeError("restore_on_abort must be a bool")
        self._restore_on_abort = restore_on_abort
        self._dtype = dtype

        shape = (num_layers, max_blocks, num_kv_heads, block_size, head_dim)
        # zero-filled so never-written slots hold finite numbers
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._device = self.k_cache.device

        self._allocator = BlockAllocator(max_blocks)
        self._prefixes = PrefixRegistry(self._allocator, capacity, block_size)
        self._tx = TransactionLog(HISTORY_LIMIT)
        self._requests: dict[RequestId, RequestRecord] = {}  # insertion order, never shrinks
        self._version = 0
        self._launchers: dict[str, Any] = {}

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

    def _slot_rows_view(self, storage: torch.Tensor) -> torch.Tensor:
        """``[L, blocks * Hkv * block_size, D]`` view of a (contiguous) K or V storage tensor."""
        return storage.view(self._num_layers, -1, self._head_dim)

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[max_blocks, Hkv, block_size, D]`` of one layer's K and V."""
        layer = self._check_layer_index(layer_idx)
        return self.k_cache[layer], self.v_cache[layer]

    # ---- argument helpers ----------------------------------------------------------------
    def _check_layer_index(self, layer_idx: object) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx must be in [0, {self._num_layers}), got {layer_idx}")
        return layer_idx

    def _record(self, request_id: object) -> RequestRecord:
        rid = _check_id("request_id", request_id)
        record = self._requests.get(rid)
        if record is None:
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
        rids = [_check_id("request id", rid) for rid in request_ids]
        if nonempty and not rids:
            raise ValueError("request_ids must not be empty")
        if unique and len(set(rids)) != len(rids):
            twice = sorted({repr(r) for r, n in Counter(rids).items() if n > 1})
            raise ValueError(f"request_ids lists {', '.join(twice)} more than once")
        for rid in rids:
            if rid not in self._requests:
                raise ValueError(f"unknown request id {rid!r}")
        return rids

    def _active_records(self, rids: list[RequestId], action: str) -> list[RequestRecord]:
        records = [self._requests[rid] for rid in rids]
        for record in records:
            self._require_active(record, action)
        return records

    def _check_token_kv(self, name: str, value: object, batch: int) -> torch.Tensor:
        tensor = check_tensor(name, value, ndim=3, dtypes=(self._dtype,), device=self._device)
        check_shape(name, tensor, (batch, self._num_kv_heads, self._head_dim))
        return tensor

    def _check_q(self, value: object, batch: int) -> torch.Tensor:
        q = check_tensor("q", value, ndim=3, dtypes=(self._dtype,), device=self._device)
        if q.shape[0] != batch or q.shape[2] != self._head_dim:
            raise ValueError(
                f"q must have shape [{batch}, num_q_heads, {self._head_dim}], got {tuple(q.shape)}"
            )
        if q.shape[1] == 0 or q.shape[1] % self._num_kv_heads:
            raise ValueError(
                f"q's num_q_heads ({q.shape[1]}) must be a positive multiple of num_kv_heads "
                f"({self._num_kv_heads})"
            )
        return q

    def _launcher(self, backend: str) -> Any:
        launcher = self._launchers.get(backend)
        if launcher is None:
            launcher = self._launchers[backend] = load_launcher(backend)
        return launcher

    # ---- lifecycle -----------------------------------------------------------------------
    def add_request(self, request_id: RequestId) -> None:
        """Register a new, empty, active request (ids are never reused)."""
        rid = _check_id("request_id", request_id)
        if rid in self._requests:
            state = self._requests[rid].state.value
            raise ValueError(f"request id {rid!r} already exists ({state}); ids are not reused")
        self._tx.ensure_none_open("add a request")
        self._requests[rid] = RequestRecord(rid, self._max_blocks_per_seq)
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
        if not records:
            table = np.zeros((0, self._max_blocks_per_seq), dtype=np.int32)
        else:
            table = np.stack([rec.table for rec in records])
        return torch.from_numpy(table).to(self._device)

    def seq_lens_tensor(self, request_ids: Sequence[RequestId]) -> torch.Tensor:
        """int32 ``[len(request_ids)]`` committed lengths on the cache's device."""
        records = self._metadata_records(request_ids)
        lens = [rec.seq_len for rec in records]
        return torch.tensor(lens, dtype=torch.int32).to(self._device)

    # ---- slot planning shared by append and begin_token ------------------------------------
    def _plan_slots(self, records: list[RequestRecord]) -> _Slots:
        """Check that every listed request can take one more token; changes nothing."""
        positions, needs = [], []
        for rec in records:
            pos = rec.seq_len
            logical = pos // self._block_size
            if logical >= self._max_blocks_per_seq:
                raise RuntimeError(
                    f"request {rec.request_id!r} is full: {pos} tokens fill max_blocks_per_seq="
                    f"{self._max_blocks_per_seq} blocks of {self._block_size}"
                )
            positions.append(pos)
            needs.append(logical == rec.num_blocks)  # last block full (or no block yet)
        wanted = sum(needs)
        if wanted > self._allocator.num_free:
            raise RuntimeError(
                f"out of KV blocks: this token needs {wanted} new block(s) but only "
                f"{self._allocator.num_free} are free; nothing was changed"
            )
        return _Slots(records, positions, needs)

    def _take_slots(self, slots: _Slots) -> tuple[dict[RequestId, int], TransactionMetadata]:
        """Allocate the planned blocks and upload the slot metadata (one host->device copy)."""
        taken: dict[RequestId, int] = {}
        try:
            for rec, needs in zip(slots.records, slots.needs_block, strict=True):
                if needs:
                    (taken[rec.request_id],) = self._allocator.allocate(
                        1, request_owner(rec.request_id)
                    )
            block_ids = [
                taken[rec.request_id] if needs else int(rec.table[pos // self._block_size])
                for rec, pos, needs in zip(
                    slots.records, slots.positions, slots.needs_block, strict=True
                )
            ]
            meta = TransactionMetadata.upload(
                slots.positions,
                block_ids,
                [rec.table for rec in slots.records],
                self._block_size,
                self._num_kv_heads,
                self._device,
            )
        except BaseException:
            self._release_taken(taken)
            raise
        return taken, meta

    def _release_taken(self, taken: dict[RequestId, int]) -> None:
        for rid, block_id in taken.items():
            self._allocator.release([block_id], request_owner(rid))

    def _publish(self, records: list[RequestRecord], taken: dict[RequestId, int]) -> None:
        for rec in records:
            block_id = taken.get(rec.request_id)
            if block_id is not None:
                rec.push_block(block_id)
            rec.seq_len += 1

    # ---- legacy single-layer append --------------------------------------------------------
    def append(
        self,
        request_ids: Sequence[RequestId],
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        append_backend: str = "torch",
    ) -> None:
        """Write one token per request (``k, v [B, Hkv, D]``) at its seq_len; num_layers == 1."""
        check_backend("append_backend", append_backend, APPEND_BACKENDS)
        self._legacy_append(request_ids, None, k, v, None, 10000.0, append_backend)

    def _legacy_append(
        self,
        request_ids: object,
        q: object,
        k: object,
        v: object,
        rotary_dim: int | None,
        base: float,
        backend: str,
    ) -> tuple[torch.Tensor | None, TransactionMetadata]:
        """The one append path (plain or RoPE) behind ``append`` and ``rope_paged_kv_append``."""
        rids = self._check_ids(request_ids, unique=True, nonempty=True)
        k = self._check_token_kv("k", k, len(rids))
        v = self._check_token_kv("v", v, len(rids))
        rope = q is not None
        if rope:
            q = self._check_q(q, len(rids))
            rotary_dim = check_rotary_dim(rotary_dim, self._head_dim)
            base = _check_base(base)
        if self._num_layers != 1:
            raise RuntimeError(
                f"append works only on a single-layer cache (num_layers={self._num_layers}); "
                "use begin_token / write_token_layer / commit_token"
            )
        records = self._active_records(rids, "append to")
        self._tx.ensure_none_open("append")
        slots = self._plan_slots(records)
        if backend != "torch":
            self._launcher(backend)  # import failures surface before anything is taken
        taken, meta = self._take_slots(slots)
        try:
            q_rot = None
            if rope:
                q_rot = self._write_rope(0, meta, q, k, v, rotary_dim, base, backend)
            else:
                self._write_plain(0, meta, k, v, backend)
        except BaseException:
            self._release_taken(taken)
            raise
        self._publish(records, taken)
        self._version += 1
        return q_rot, meta

    def _write_plain(
        self, layer: int, meta: TransactionMetadata, k: torch.Tensor, v: torch.Tensor, backend: str
    ) -> None:
        """Scatter one layer's k, v into the reserved slots (no host sync on either backend)."""
        k_layer, v_layer = self.k_cache[layer], self.v_cache[layer]
        if backend == "torch":
            torch_scatter(k_layer, v_layer, k, v, meta.block_ids, meta.offsets)
        else:
            self._launcher(backend)(k_layer, v_layer, k, v, meta.block_ids, meta.offsets)

    def _write_rope(
        self,
        layer: int,
        meta: TransactionMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_dim: int,
        base: float,
        backend: str,
    ) -> torch.Tensor:
        """Rotate q and k at the reserved positions, store rotated k and v; returns rotated q."""
        if backend == "fused":
            k_layer, v_layer = self.k_cache[layer], self.v_cache[layer]
            launch = self._launcher("fused")
            return launch(
                q, k, v, k_layer, v_layer, meta.block_ids, meta.offsets, meta.positions,
                rotary_dim, base, None,
            )  # fmt: skip
        q_rot = apply_rope(q, meta.positions, rotary_dim, base)
        k_rot = apply_rope(k, meta.positions, rotary_dim, base)
        self._write_plain(layer, meta, k_rot, v, backend)
        return q_rot

    # ---- multi-layer token transactions ----------------------------------------------------
    def begin_token(self, request_ids: Sequence[RequestId]) -> TokenTransactionView:
        """Reserve one slot per request (taking a block where the last one is full)."""
        rids = self._check_ids(request_ids, unique=True, nonempty=True)
        records = self._active_records(rids, "begin a token for")
        self._tx.ensure_none_open("begin a token transaction")
        slots = self._plan_slots(records)
        taken, meta = self._take_slots(slots)
        try:
            tx = OpenTransaction(self._tx.next_id(), self._version + 1, tuple(rids), taken, meta)
            if self._restore_on_abort:  # [B, L, Hkv, D] old bytes of the reserved slots
                # one index_select per tensor over [L, blocks*Hkv*bs, D] rows: cheaper to
                # issue than a two-tensor advanced index
                tx.backup_k = self._slot_rows_view(self.k_cache).index_select(1, meta.slot_rows)
                tx.backup_v = self._slot_rows_view(self.v_cache).index_select(1, meta.slot_rows)
            view = tx.view(TransactionState.OPEN, tx.cache_version)
        except BaseException:
            self._release_taken(taken)
            raise
        self._tx.start(tx)
        self._version += 1
        return view

    def _check_next_layer(self, tx: OpenTransaction, layer_idx: object) -> int:
        layer = self._check_layer_index(layer_idx)
        if layer != tx.next_layer:
            done = f"layers 0..{tx.next_layer - 1} are written" if tx.next_layer else "none written"
            raise RuntimeError(
                f"token transaction {tx.transaction_id}: layer {layer} written out of order "
                f"({done}); expected layer {tx.next_layer}"
            )
        return layer

    def write_token_layer(
        self,
        tx: TokenTransactionView | int,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        append_backend: str = "torch",
    ) -> None:
        """Store ``k, v [B, Hkv, D]`` (bitwise, as given) in this layer's reserved slots."""
        backend = check_backend("append_backend", append_backend, APPEND_BACKENDS)
        open_tx = self._tx.resolve(tx)
        layer = self._check_next_layer(open_tx, layer_idx)
        batch = len(open_tx.request_ids)
        k = self._check_token_kv("k", k, batch)
        v = self._check_token_kv("v", v, batch)
        self._write_plain(layer, open_tx.metadata, k, v, backend)
        open_tx.next_layer += 1

    def write_token_layer_rope(
        self,
        tx: TokenTransactionView | int,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_dim: int | None = None,
        base: float = 10000.0,
        *,
        append_backend: str = "fused",
    ) -> torch.Tensor:
        """RoPE ``q`` and ``k`` at the reserved positions, store rotated k and v; returns q_rot."""
        backend = check_backend("append_backend", append_backend, ROPE_BACKENDS)
        open_tx = self._tx.resolve(tx)
        layer = self._check_next_layer(open_tx, layer_idx)
        batch = len(open_tx.request_ids)
        q = self._check_q(q, batch)
        k = self._check_token_kv("k", k, batch)
        v = self._check_token_kv("v", v, batch)
        rotary_dim = check_rotary_dim(rotary_dim, self._head_dim)
        base = _check_base(base)
        q_rot = self._write_rope(layer, open_tx.metadata, q, k, v, rotary_dim, base, backend)
        open_tx.next_layer += 1
        return q_rot

    def transaction_view(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """A fresh detached view of an *open* transaction."""
        open_tx = self._tx.resolve(tx)
        return open_tx.view(TransactionState.OPEN, open_tx.cache_version)

    def transaction_decode_inputs(
        self, tx: TokenTransactionView | int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_tables, seq_lens + 1)`` of an open transaction, for decoding over the new
        token. These are the cache's own device tensors (no copy): read them, never write.
        The write path does not use them, so they cannot redirect a write."""
        meta = self._tx.resolve(tx).metadata
        return meta.block_tables, meta.seq_lens_after

    def commit_token(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """Publish the token: seq_len += 1 for every request of the transaction, once."""
        open_tx = self._tx.resolve(tx)
        if open_tx.next_layer != self._num_layers:
            raise RuntimeError(
                f"cannot commit token transaction {open_tx.transaction_id}: "
                f"{open_tx.next_layer} of {self._num_layers} layers written"
            )
        version = self._version + 1
        view = open_tx.view(TransactionState.COMMITTED, version)  # built before publishing
        self._publish([self._requests[rid] for rid in open_tx.request_ids], open_tx.reserved)
        self._tx.close(TransactionState.COMMITTED, version)
        self._version = version
        return view

    def abort_token(self, tx: TokenTransactionView | int) -> TokenTransactionView:
        """Drop the token: release the blocks begin_token took; lengths stay as they were."""
        open_tx = self._tx.resolve(tx)
        version = self._version + 1
        view = open_tx.view(TransactionState.ABORTED, version)
        meta = open_tx.metadata
        if open_tx.backup_k is not None and open_tx.next_layer > 0:
            rows = meta.slot_rows.long()  # index_copy_ wants int64; abort is the rare path
            self._slot_rows_view(self.k_cache).index_copy_(1, rows, open_tx.backup_k)
            self._slot_rows_view(self.v_cache).index_copy_(1, rows, open_tx.backup_v)
        self._release_taken(open_tx.reserved)
        self._tx.close(TransactionState.ABORTED, version)
        self._version = version
        return view

    # ---- shared prefixes -----------------------------------------------------------------
    def register_prefix(
        self, prefix_id: PrefixId, k_blocks: torch.Tensor, v_blocks: torch.Tensor
    ) -> PrefixState:
        """Copy full blocks ``[num_layers, n, Hkv, block_size, D]`` into prefix-owned blocks."""
        pid = _check_id("prefix_id", prefix_id)
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
        pid = _check_id("prefix_id", prefix_id)
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
        record.num_blocks = record.num_prefix_blocks = n
        record.prefix_id = pid
        record.seq_len = n * self._block_size
        self._prefixes.attach(pid)
        self._version += 1

    def evict_prefix(self, prefix_id: PrefixId) -> None:
        """Free an inactive prefix's blocks (RuntimeError while requests use it)."""
        pid = _check_id("prefix_id", prefix_id)
        self._prefixes.block_ids(pid)  # ValueError when unknown
        self._tx.ensure_none_open("evict a prefix")
        self._prefixes.evict(pid)
        self._version += 1

    def prefix_state(self, prefix_id: PrefixId) -> PrefixState:
        return self._prefixes.state(_check_id("prefix_id", prefix_id))

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
            "num_reserved_blocks": 0 if open_tx is None else len(open_tx.reserved),
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
            private = rec.private_block_ids
            if rid in reserved:
                private.append(reserved[rid])
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
