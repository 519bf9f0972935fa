"""Automatic prefix caching of a :class:`~flashdec.cache.PagedKVCache` (SPEC §8.7): the hash
chain of a request's full blocks, the longest cached run every group can serve, attaching a
request to it, and indexing a request's own full blocks so later requests can hit them. A mixin
``PagedKVCache.prefix_cache``, one concept: it owns the hash chain's root and the hit counters
and works on the cache's groups (each group's :class:`~flashdec.cache.block_cache.BlockCache`)
and request table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flashdec._blocks import held_range
from flashdec.cache.block_hash import BlockHash, hash_blocks
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.requests import require_active
from flashdec.cache.reservation import request_owner
from flashdec.cache.state import RequestId, RequestRecord

if TYPE_CHECKING:
    from flashdec.cache.core import CacheCore


class PrefixCache:
    """Automatic prefix caching of one :class:`~flashdec.cache.PagedKVCache`."""

    def __init__(self, cache: CacheCore, enabled: bool, hash_root: BlockHash) -> None:
        self._cache = cache
        self._groups = cache._groups
        self._enabled = enabled
        self._hash_root = hash_root
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._host_hit_tokens = 0  # of the hits: group 0's blocks copied up from the host tier
        # per active request: its lookup (queried, hit, host hit tokens)
        self._lookups: dict[RequestId, tuple[int, int, int]] = {}

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _forget(self, request_id: RequestId, *, undo: bool) -> None:
        """The request ended (``undo``: it was discarded, so its lookup never counted)."""
        queried, hit, host_hit = self._lookups.pop(request_id, (0, 0, 0))
        if undo:
            self._queried_tokens -= queried
            self._hit_tokens -= hit
            self._host_hit_tokens -= host_hit

    def _rekey(self, hash_root: BlockHash) -> None:
        """The chain's new root (the cache's scales changed while nothing was cached)."""
        self._hash_root = hash_root

    def _require_prefix_caching(self) -> None:
        if not self._enabled:
            raise RuntimeError("automatic prefix caching is off (enable_prefix_caching=False)")

    def block_hashes(
        self, token_ids: Any, *, start_block: int = 0, parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """The chained hashes of the full blocks of ``token_ids`` (from ``start_block`` on,
        after ``parent``, the hash of the block before; the chain's root for block 0)."""
        self._require_prefix_caching()
        if parent is None and start_block:
            raise ValueError("start_block > 0 needs the parent block's hash")
        bs = self._groups[0].block_size
        root = self._hash_root if parent is None else parent
        return hash_blocks(token_ids, bs, root, start_block)

    def _hit_blocks(
        self, hashes: Sequence[BlockHash], num_tokens: int, *, host: bool = True
    ) -> int:
        """Blocks of the longest cached run matching ``hashes`` from the start that every
        group can serve, leaving at least one of ``num_tokens`` to compute: a full-attention
        group needs all of them, a window group only those its window keeps at the end. A
        block counts as cached in the GPU pool or (``host``) in the group's host tier."""
        bs = self._groups[0].block_size
        h = min(len(hashes), (num_tokens - 1) // bs)
        windows = []
        for group in self._groups:
            if group.window is None:
                h = min(h, _leading(group, hashes[:h], host))
            else:
                windows.append(group)
        while h > 0:
            if all(
                all(_cached(g, x, host) for x in hashes[held_range(h * bs, bs, g.window)[0] : h])
                for g in windows
            ):
                break
            h -= 1
        return h

    def _check_hashes(self, hashes: object, num_tokens: object) -> list[BlockHash]:
        if not isinstance(hashes, (list, tuple)) or not all(isinstance(x, bytes) for x in hashes):
            raise TypeError(
                "hashes must be a list of bytes (PagedKVCache.prefix_cache.block_hashes)"
            )
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if num_tokens < 1 or len(hashes) > num_tokens // self._groups[0].block_size:
            raise ValueError(
                f"num_tokens={num_tokens} must be >= 1 and cover every hashed block ({len(hashes)})"
            )
        return list(hashes)

    def held_hit_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        """Per group: of the blocks ``attach_cached_prefix`` would attach now, those an active
        request already holds (a new request shares them: they take nothing from the pool).
        Reads only; all zeros while no cached block is held."""
        self._require_prefix_caching()
        hashes = self._check_hashes(hashes, num_tokens)
        if not self.shared_cached_blocks_held():
            return (0,) * len(self._groups)
        h = self._hit_blocks(hashes, num_tokens)
        bs = self._groups[0].block_size
        return tuple(
            sum(
                1
                for x in hashes[held_range(h * bs, bs, g.window)[0] : h]
                if g.block_cache.is_held(x)
            )
            for g in self._groups
        )

    def attach_cached_prefix(
        self, request_id: RequestId, hashes: Sequence[BlockHash], num_tokens: int
    ) -> int:
        """Start an empty active request of ``num_tokens`` prompt tokens whose full blocks hash
        to ``hashes`` with the longest cached run matching them (shared, reference-counted,
        immutable); returns the hit's tokens (possibly 0). The request keeps the hashes: its
        own full blocks join the cache (``cache_request_blocks``, and when it finishes)."""
        cache = self._cache
        record = cache._requests.record(request_id)
        self._require_prefix_caching()
        hashes = self._check_hashes(hashes, num_tokens)
        cache._tx.ensure_none_open("attach a cached prefix")
        require_active(record, "attach a cached prefix to")
        if record.seq_len or record.num_blocks or record.prefix_id is not None:
            raise RuntimeError(
                f"attach_cached_prefix needs an empty request; {record.request_id!r} already "
                f"holds {record.seq_len} tokens"
            )
        if record.block_hashes is not None:
            raise RuntimeError(f"request {record.request_id!r} already has its block hashes")
        h = self._hit_blocks(hashes, num_tokens)
        taken = self._take_run(record, hashes, h)
        if taken is None:  # a copy up failed: recompute what only the host tier held
            h = self._hit_blocks(hashes, num_tokens, host=False)
            taken = self._take_run(record, hashes, h)
        runs, loaded = taken
        bs = self._groups[0].block_size
        for group, first, block_ids in runs:
            run = record.run(group.index)
            run.table[first:h] = block_ids
            group.pending_updates += [(record.row, first + i, b) for i, b in enumerate(block_ids)]
            run.first_block, run.num_blocks, run.num_prefix_blocks = first, h, h
        record.block_hashes = hashes
        record.seq_len = h * bs
        hit = (num_tokens, h * bs, loaded * bs)
        self._queried_tokens += num_tokens
        self._hit_tokens += h * bs
        self._host_hit_tokens += loaded * bs
        self._lookups[record.request_id] = hit  # until it ends (discard: undo)
        cache._version += 1
        return h * bs

    def _take_run(
        self, record: RequestRecord, hashes: Sequence[BlockHash], h: int
    ) -> tuple[list[tuple[LayerGroup, int, list[int]]], int] | None:
        """Per group ``(group, first, block ids)`` of the hit run of ``h`` blocks, held for
        ``record``, and how many of group 0's came from the host tier. A block cached in the
        GPU pool gets one more reference; one only the host tier holds gets a new block, copied
        up and cached under its hash, held. None (nothing taken) when a copy up failed; any
        other error also gives back what was taken before it propagates."""
        bs = self._groups[0].block_size
        owner = request_owner(record.request_id)
        plans = []
        for group in self._groups:
            first = held_range(h * bs, bs, group.window)[0]
            plans.append((group, first, [group.block_cache.block(x) for x in hashes[first:h]]))
        for group, _, on_gpu in plans:  # first: an allocation below must not evict them
            group.block_cache.acquire([b for b in on_gpu if b is not None])
        loaded: dict[int, tuple[list[int], list[int]]] = {}  # group -> (positions, new ids)
        try:
            for group, first, on_gpu in plans:
                missing = [i for i, b in enumerate(on_gpu) if b is None]
                if not missing:
                    continue
                host, wanted = group.block_cache.host, [hashes[first + i] for i in missing]
                host.touch(wanted)  # the allocation's own evictions must not drop them
                new = _allocate(group, len(missing), owner)
                loaded[group.index] = (missing, new)
                if not host.load(wanted, new):
                    raise _CopyUpFailed
        except BaseException as exc:
            for group, _, on_gpu in plans:
                if group.index in loaded:
                    group.allocator.release(loaded[group.index][1], owner)
                group.block_cache.release([b for b in on_gpu if b is not None])
            if isinstance(exc, _CopyUpFailed):
                return None
            raise
        runs = []
        for group, first, on_gpu in plans:
            block_ids = list(on_gpu)
            missing, new = loaded.get(group.index, ([], []))
            for i, block_id in zip(missing, new, strict=True):
                group.block_cache.adopt(block_id, hashes[first + i], owner, held=True)
                block_ids[i] = block_id
            runs.append((group, first, block_ids))
        return runs, len(loaded.get(0, ([], []))[0])

    def preempt_request(self, request_id: RequestId) -> None:
        """Swap an active request out: as at ``finish_request`` its committed full blocks whose
        hashes it knows stay cached (evictable: with a host tier they go down there when the
        pool needs them) and the rest is freed, but its id is forgotten, as
        ``discard_request`` forgets it, so that it may be added again and resume from those
        cached blocks. Its lookup stays counted."""
        cache = self._cache
        record = cache._requests.record(request_id)
        cache._tx.ensure_none_open("preempt a request")
        require_active(record, "preempt")
        cache._release_record(record, keep_cached=True)
        self._forget(record.request_id, undo=False)
        cache._requests.forget(record)
        cache._version += 1

    def _adopt(self, group: LayerGroup, record: RequestRecord, held: bool) -> list[int]:
        """Index ``record``'s committed full private blocks in ``group`` whose hashes it knows
        (``held``: they join its shared run, stopping at the first hash cached elsewhere;
        otherwise evictable, duplicates skipped). Returns the private blocks left."""
        run = record.run(group.index)
        hashes = record.block_hashes
        owner = request_owner(record.request_id)
        start = max(run.num_prefix_blocks, run.first_block)
        end = min(record.seq_len // group.block_size, len(hashes), run.num_blocks)
        left = []
        for i in range(start, end):
            block_id = int(run.table[i])
            if group.block_cache.adopt(block_id, hashes[i], owner, held):
                if held:
                    run.num_prefix_blocks = i + 1
            elif held:
                break
            else:
                left.append(block_id)
        if not held:
            left += run.table[max(start, end) : run.num_blocks].tolist()
        return left

    def cache_request_blocks(
        self, request_id: RequestId, hashes: Sequence[BlockHash] | None = None
    ) -> int:
        """Index the active request's committed full blocks (their hashes: those it was
        attached with, or ``hashes``, the chain of its whole content so far, extending them):
        they become shared, immutable blocks other requests can hit. Returns its shared
        blocks in group 0."""
        cache = self._cache
        record = cache._requests.record(request_id)
        self._require_prefix_caching()
        cache._tx.ensure_none_open("cache a request's blocks")
        require_active(record, "cache the blocks of")
        known = record.block_hashes
        if known is None:
            raise RuntimeError(
                f"request {record.request_id!r} has no block hashes (attach_cached_prefix)"
            )
        if hashes is not None:
            hashes = self._check_hashes(hashes, max(1, len(hashes) * self._groups[0].block_size))
            if hashes[: len(known)] != known[: len(hashes)]:
                raise ValueError("hashes must extend the request's known block hashes")
            if len(hashes) > len(known):
                record.block_hashes = hashes
        for group in self._groups:
            self._adopt(group, record, held=True)
        cache._version += 1
        return record.num_prefix_blocks

    def shared_cached_block_refs(self, group: int = 0) -> int:
        """References to automatically cached blocks beyond the first: how many more blocks
        the active requests' block counts add up to than the pool holds for them (the
        scheduler's snapshot counts each request's blocks as its own)."""
        return self._cache._layout._group(group).block_cache.num_extra_refs

    def shared_cached_blocks_held(self) -> bool:
        """Whether an active request holds any automatically cached block (any group)."""
        return any(g.block_cache.num_referenced for g in self._groups)

    @property
    def host_tier_enabled(self) -> bool:
        return any(g.block_cache.host is not None for g in self._groups)

    def stats(self) -> dict[str, Any]:
        """Automatic prefix caching's counters: ``queried_tokens`` (prompt tokens looked up),
        ``hit_tokens`` (``gpu_hit_tokens`` found in the GPU pool + ``host_hit_tokens`` copied
        up from the host tier), ``hit_rate``, ``cached_blocks`` (indexed in the GPU pool now,
        every group), ``evictable_blocks`` (cached, no request holds them: counted as free),
        ``evicted_blocks`` (reclaimed by allocations so far), and ``host``: the host tier's
        counters summed over groups (``HostBlockPool.stats``), or None without one."""
        caches = [g.block_cache for g in self._groups]
        queried = self._queried_tokens
        pools = [c.host.stats() for c in caches if c.host is not None]
        host = {key: sum(p[key] for p in pools) for key in pools[0]} if pools else None
        return {
            "enabled": self._enabled,
            "queried_tokens": queried,
            "hit_tokens": self._hit_tokens,
            "gpu_hit_tokens": self._hit_tokens - self._host_hit_tokens,
            "host_hit_tokens": self._host_hit_tokens,
            "hit_rate": self._hit_tokens / queried if queried else 0.0,
            "cached_blocks": sum(len(c) for c in caches),
            "evictable_blocks": sum(g.allocator.num_evictable for g in self._groups),
            "evicted_blocks": sum(c.num_evicted for c in caches),
            "host": host,
        }


class _CopyUpFailed(Exception):
    """A host tier's copy up raised (counted there): the hit is recomputed instead."""


def _allocate(group: LayerGroup, n: int, owner: Any) -> list[int]:
    """``n`` blocks of ``group`` for ``owner``. An allocation whose copy down of the blocks it
    evicts raises (an interrupt) takes nothing, and loses nothing: nothing was written into
    those blocks yet, so they are cached again, as the journal of a token transaction does."""
    block_cache = group.block_cache
    block_cache.open_journal()
    try:
        taken = group.allocator.allocate(n, owner)
    except BaseException:
        block_cache.close_journal(bytes_restored=True)
        raise
    block_cache.close_journal(bytes_restored=False)  # kept: the caller writes into them
    return taken


def _cached(group: LayerGroup, block_hash: BlockHash, host: bool) -> bool:
    """Whether ``group`` can serve ``block_hash``: from its GPU pool or (``host``) host tier."""
    if group.block_cache.has(block_hash):
        return True
    pool = group.block_cache.host
    return host and pool is not None and block_hash in pool


def _leading(group: LayerGroup, hashes: Sequence[BlockHash], host: bool) -> int:
    """How many of ``hashes``, from the first, ``group`` can serve."""
    n = 0
    for block_hash in hashes:
        if not _cached(group, block_hash, host):
            break
        n += 1
    return n
