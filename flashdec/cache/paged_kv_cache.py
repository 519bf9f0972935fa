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

The facade owns the request lifecycle, shared prefixes and the parts below, and keeps every
public name; the work is in its parts, one concept per module:

- ``layout`` (constructor checks), ``layer_group`` (a group's storage and pool),
  ``group_managers`` (reserve / publish / release per group kind: full attention, sliding
  window), ``requests`` (the request table), ``transaction`` (the open transaction, its undo and
  tombstones), ``reservation`` (what a step takes), ``slots`` / ``device_tables`` /
  ``batch_memo`` (a step's device metadata and the repeated-batch plan), ``audit`` (metrics,
  invariants);
- two mixins hold the rest of the facade's methods: ``queries.LayoutQueries`` (whole-cache
  geometry) and ``token_steps.TokenSteps`` (append and the token transaction); three views, one
  attribute each, hold what only the engine needs: ``layout`` (``group_layout.GroupLayout``:
  per-group and per-layer reads), ``steps`` (``step_access.StepAccess``: a step's device
  metadata, backups, whole-step writes) and ``prefix_cache`` (``prefix_caching.PrefixCache``:
  SPEC §8.7's hashes, cached runs, stats); the views see the facade through ``core.CacheCore``
  (a Protocol: no view imports the facade back).

Public members beyond SPEC §4's, and why they stay here: the constructor's arguments read back
(``num_layers``, ``num_kv_heads``, ``head_dim``, ``block_size``, ``max_blocks``, ``dtype``,
``device``, ``prefix_cache_capacity_blocks``, ``max_blocks_per_seq``, ``kv_groups``);
``begin_tokens`` (the n-token transaction of SPEC §8.6, beside ``begin_token``);
``write_token_layer_with`` (the engine's per-layer write: once per layer per step, so no view in
between); ``discard_request`` (lifecycle: an admission taken back); ``request_ids``,
``request_prefix``, ``prefix_ids``, ``num_free_blocks``, ``version`` (what the engine's
scheduling snapshot reads of requests, prefixes and the pool); ``layout``, ``steps``,
``prefix_cache`` (the views); ``set_kv_scales`` (the one writer of FP8 scales: calibration
replaces them while the cache is empty; ``layout`` reads them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashdec._checks import check_request_id, check_shape, check_tensor
from flashdec.cache.audit import cache_metrics, check_invariants
from flashdec.cache.batch_memo import BatchMemo
from flashdec.cache.block_hash import extra_key_hash
from flashdec.cache.group_layout import GroupLayout
from flashdec.cache.group_managers import make_manager
from flashdec.cache.host_tier import HostBlockPool, host_capacities
from flashdec.cache.kv_spec import KVGroupSpec, format_kv_spec
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.layout import check_scales, resolve_layout
from flashdec.cache.prefix_caching import PrefixCache
from flashdec.cache.queries import LayoutQueries
from flashdec.cache.requests import RequestTable, require_active
from flashdec.cache.reservation import request_owner
from flashdec.cache.state import PrefixId, PrefixState, RequestId, RequestRecord, RequestState
from flashdec.cache.step_access import StepAccess
from flashdec.cache.token_steps import TokenSteps, torch_scatter
from flashdec.cache.transaction import HISTORY_LIMIT, TransactionLog

__all__ = ["PagedKVCache", "torch_scatter"]  # torch_scatter: the engine's PyTorch writer


class PagedKVCache(LayoutQueries, TokenSteps):
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
        kv_scales: per group ``None`` or ``(k_scale, v_scale)`` for FP8 groups, each a float,
            a float32 ``[num_kv_heads]`` tensor (per head) or ``[layers_in_group,
            num_kv_heads]`` (per layer and head): stored = value / scale (default 1.0).
            Float groups take no scales. ``set_kv_scales`` replaces them while the cache holds
            nothing (calibration).
        restore_on_abort: abort puts back the bytes a transaction overwrote, so an aborted token
            leaves the storage bit-identical (costs one gather of the reserved slots per token).
        enable_prefix_caching: automatic prefix caching (SPEC §8.7): requests that give their
            blocks' hashes (``attach_cached_prefix``) share the cached full blocks their
            content starts with; finished requests' full blocks stay cached until an
            allocation needs them (least recently used first). Needs one block size.
        prefix_caching_key: whatever else changes the K/V of a token sequence (the model's
            identity); part of the hash chain's root with the cache's own layout and scales.
        host_kv_cache_bytes: the host tier of automatic prefix caching (needs
            ``enable_prefix_caching``): pinned CPU memory that keeps the cached blocks the GPU
            pool evicts, split between the groups in proportion to their pools' bytes, so a
            later hit copies them up instead of recomputing them (``host_tier``). 0: off.
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
        enable_prefix_caching: bool = False,
        prefix_caching_key: object = None,
        host_kv_cache_bytes: int = 0,
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
        self._write_scales(layout.scales)
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
        self._layout = GroupLayout(self._groups, self._layer_group, self._layers, self._tables)
        self._steps = StepAccess(self)
        self._tx = TransactionLog(HISTORY_LIMIT)
        # the records of the active and the newest terminal requests (flashdec.cache.requests)
        self._requests = RequestTable()
        self._version = 0
        self._memo: BatchMemo | None = None  # the last stepped batch (full-attention caches)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}"
            )
        if enable_prefix_caching and len({g.block_size for g in groups}) != 1:
            raise ValueError("prefix caching needs every KV group to have the same block size")
        for group, capacity in zip(
            self._groups,
            host_capacities(self._groups, host_kv_cache_bytes, enable_prefix_caching),
            strict=True,
        ):
            if capacity:
                group.block_cache.host = HostBlockPool(group.kv, capacity)
        self._prefix_caching_key = prefix_caching_key
        self._prefix_cache = PrefixCache(
            self, enable_prefix_caching, self._hash_root(layout.scales)
        )

    def _hash_root(self, scales: list) -> bytes:
        """The prefix cache's chain root: the model's identity, the layout and the scales."""
        return extra_key_hash(
            self._prefix_caching_key,
            format_kv_spec(self._specs),
            [None if p is None else (_scale_key(p[0]), _scale_key(p[1])) for p in scales],
        )

    def _write_scales(self, scales: list) -> None:
        """Copy checked ``[layers_in_group, Hkv]`` scales into the FP8 groups' fixed tensors."""
        for group, pair in zip(self._groups, scales, strict=True):
            if pair is not None:
                group.k_scales.copy_(pair[0])
                group.v_scales.copy_(pair[1])

    def set_kv_scales(self, kv_scales: Sequence[tuple[Any, Any] | None]) -> None:
        """Replace the FP8 groups' scales (as ``kv_scales=`` of the constructor: per group
        None — unchanged — or a pair), in place: kernels and CUDA graphs keep reading the same
        addresses. Only while the cache stores nothing that the old scales encoded: no active
        request, no open transaction, no shared prefix, no cached block (GPU or host tier);
        RuntimeError otherwise, ValueError/TypeError for bad scales, and nothing changes. The
        prefix cache's hash root takes the new scales."""
        scales = check_scales(self._specs, kv_scales)
        for g, (group, pair) in enumerate(zip(self._groups, scales, strict=True)):
            if pair is None and group.k_scales is None:
                continue
            if pair is None:
                scales[g] = (group.k_scales.cpu(), group.v_scales.cpu())
        busy = [
            what
            for what, held in (
                ("active requests", bool(self._requests.active)),
                ("an open transaction", self._tx.open is not None),
                ("shared prefixes", bool(self._prefixes.ids())),
                ("cached blocks", any(len(g.block_cache) for g in self._groups)),
                (
                    "host-tier blocks",
                    any(g.block_cache.host and len(g.block_cache.host) for g in self._groups),
                ),
            )
            if held
        ]
        if busy:
            raise RuntimeError(
                "set_kv_scales needs a cache that stores nothing the old scales encoded; it "
                f"holds {', '.join(busy)}"
            )
        self._write_scales(scales)
        self._prefix_cache._rekey(self._hash_root(scales))

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
        self._prefix_cache._forget(record.request_id, undo=True)  # as if never admitted
        self._requests.forget(record)
        self._version += 1

    def _terminate(self, request_id: RequestId, state: RequestState) -> None:
        record = self._requests.record(request_id)
        verb = "finish" if state is RequestState.FINISHED else "cancel"
        self._tx.ensure_none_open(f"{verb} a request")
        require_active(record, verb)
        self._release_record(record, keep_cached=state is RequestState.FINISHED)
        self._prefix_cache._forget(record.request_id, undo=False)
        self._requests.retire(record, state)
        self._version += 1

    def _release_record(self, record: RequestRecord, keep_cached: bool = False) -> None:
        """Give back an active request's private blocks, table row and prefix reference (or
        its references to cached blocks). ``keep_cached``: a finished request's committed full
        blocks whose hashes it knows stay cached (evictable) instead of being freed."""
        owner = request_owner(record.request_id)
        hashes = record.block_hashes
        for group in self._groups:
            run = record.run(group.index)
            private = run.private_block_ids
            if hashes is not None:
                group.block_cache.release(
                    run.table[run.first_block : run.num_prefix_blocks].tolist()
                )
                if keep_cached:
                    private = self._prefix_cache._adopt(group, record, held=False)
            group.allocator.release(private, owner)
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
        return record.run(self._layout._group(group).index).block_ids

    # ---- metadata tensors ----------------------------------------------------------------
    def _metadata_records(self, request_ids: object) -> list[RequestRecord]:
        rids = self._requests.check_ids(request_ids, unique=False, nonempty=False)
        return self._requests.active_records(rids, "read the block table of")

    def block_tables(self, request_ids: Sequence[RequestId], *, group: int = 0) -> torch.Tensor:
        """int32 ``[len(request_ids), width]`` of ``group`` on the cache's device, 0-padded
        (a window group's released entries read 0)."""
        g = self._layout._group(group)
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
        g = self._layout._group(group)
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


def _scale_key(scale: Any) -> Any:
    return scale.tolist() if isinstance(scale, torch.Tensor) else scale
