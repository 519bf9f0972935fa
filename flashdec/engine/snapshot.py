"""``snapshot_from_cache``: read a ``PagedKVCache`` into a ``SchedulingSnapshot``.

The cache is the single source of truth for lengths, blocks and prefixes; the caller supplies
what only it knows — each request's spec, which ids wait and which run, and the fairness counters.
Nothing is mutated; every argument is checked before anything is read.

A cache with several KV layer groups (or one sliding-window group) gives a snapshot with one
``GroupPool`` per group and each active request's blocks per group; a classic cache gives the
plain one-group snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from flashdec._checks import check_positive_int
from flashdec.cache import PagedKVCache, RequestState
from flashdec.scheduler.rows import lifetime_private_blocks_by_group
from flashdec.scheduler.snapshot import (
    ActiveRequest,
    GroupBlocks,
    GroupPool,
    PrefixInfo,
    SchedulingSnapshot,
    WaitingRequest,
    lifetime_private_blocks,
)
from flashdec.scheduler.spec import RequestId, RequestSpec, check_request_id


def _ids(name: str, value: Iterable[RequestId]) -> tuple[RequestId, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of request ids, got {type(value).__name__}")
    ids = tuple(value)
    for i, rid in enumerate(ids):
        check_request_id(f"{name}[{i}]", rid)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} must not repeat an id, got {ids!r}")
    return ids


def _counters(
    name: str, value: Mapping[RequestId, int] | None, allowed: tuple[RequestId, ...]
) -> dict[RequestId, int]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a mapping of request id -> int, got {type(value).__name__}"
        )
    known = set(allowed)
    for rid, count in value.items():
        if rid not in known:
            raise ValueError(f"{name} has a counter for {rid!r}, which is not in its id list")
        check_positive_int(f"{name}[{rid!r}]", count, minimum=0)
    return dict(value)


def _known_to(cache: PagedKVCache, request_id: RequestId) -> bool:
    """Whether the cache knows ``request_id`` (active or terminal, however long ago)."""
    try:
        cache.request_state(request_id)
    except ValueError:
        return False
    return True


def cache_group_shapes(cache: PagedKVCache) -> tuple[tuple[int, int | None], ...]:
    """Each group's ``(block_size, window)`` as a scheduler derives needs from them; empty for
    a cache of one full-attention group (the plain snapshot)."""
    specs = cache.kv_groups
    if len(specs) == 1 and specs[0].window is None:
        return ()
    return tuple((spec.block_size, spec.window) for spec in specs)


def grouped_pools(cache: PagedKVCache) -> tuple[GroupPool, ...]:
    """Every group's pool as it is now."""
    return tuple(
        GroupPool(
            spec.block_size,
            spec.num_blocks,
            cache.layout.group_free_blocks(g),
            cache.layout.group_max_blocks_per_seq(g),
            spec.window,
            cache.prefix_cache.shared_cached_block_refs(g),
        )
        for g, spec in enumerate(cache.kv_groups)
    )


def shared_hits(
    cache: PagedKVCache,
    specs: Mapping[RequestId, RequestSpec],
    block_hashes: Mapping[RequestId, list[bytes]] | None,
    waiting_ids: Iterable[RequestId],
) -> tuple[tuple[RequestId, tuple[int, ...]], ...]:
    """``SchedulingSnapshot.shared_hits``: each waiting request (with block hashes) whose cache
    hit would share blocks active requests hold, and how many per group, in submission order.
    O(waiting requests with hashes · their blocks) while any cached block is held; else none."""
    if (
        not block_hashes
        or not cache.prefix_cache.enabled
        or not cache.prefix_cache.shared_cached_blocks_held()
    ):
        return ()
    found = []
    for rid in waiting_ids:
        hashes = block_hashes.get(rid)
        if hashes is None:
            continue
        spec = specs[rid]
        held = cache.prefix_cache.held_hit_blocks(hashes, spec.initial_context_tokens)
        if any(held):
            found.append((spec.submission_order, rid, held))
    found.sort(key=lambda f: f[0])
    return tuple((rid, held) for _, rid, held in found)


# The row builders take the per-request arguments last, so a caller building many rows can bind
# the rest once (functools.partial) and pass the committed length it has already read.
def one_group_active_row(
    cache: PagedKVCache,
    block_size: int,
    prefix_map: Mapping,
    spec: RequestSpec,
    committed_tokens: int,
    service_wait_steps: int,
) -> ActiveRequest:
    """An active request's row of a one-group cache, its blocks read from the cache."""
    rid = spec.request_id
    blocks = len(cache.request_block_ids(rid))
    shared = prefix_map[spec.prefix_id].num_blocks if spec.prefix_id is not None else 0
    return ActiveRequest(
        request_id=rid,
        spec=spec,
        committed_tokens=committed_tokens,
        committed_blocks=blocks,
        committed_private_blocks=blocks - shared,
        lifetime_private_blocks=lifetime_private_blocks(spec, block_size, prefix_map),
        service_wait_steps=service_wait_steps,
    )


def grouped_active_row(
    cache: PagedKVCache,
    shapes: tuple[tuple[int, int | None], ...],
    prefix_map: Mapping,
    spec: RequestSpec,
    committed_tokens: int,
    service_wait_steps: int,
) -> ActiveRequest:
    """An active request's row with its blocks in every group read from the cache."""
    rid = spec.request_id
    prefix = prefix_map[spec.prefix_id] if spec.prefix_id is not None else None
    lifetimes = lifetime_private_blocks_by_group(spec, shapes, prefix_map)
    groups = []
    for g, lifetime in enumerate(lifetimes):
        blocks = len(cache.request_block_ids(rid, group=g))
        shared = 0 if prefix is None else prefix.num_blocks_by_group[g]
        groups.append(GroupBlocks(blocks, blocks - shared, lifetime))
    first = groups[0]
    return ActiveRequest(
        request_id=rid,
        spec=spec,
        committed_tokens=committed_tokens,
        committed_blocks=first.committed_blocks,
        committed_private_blocks=first.committed_private_blocks,
        lifetime_private_blocks=first.lifetime_private_blocks,
        service_wait_steps=service_wait_steps,
        blocks_by_group=tuple(groups),
    )


def snapshot_from_cache(
    cache: PagedKVCache,
    *,
    step: int,
    specs: Mapping[RequestId, RequestSpec],
    waiting_ids: Iterable[RequestId],
    active_ids: Iterable[RequestId],
    waiting_wait_steps: Mapping[RequestId, int] | None = None,
    waiting_skip_counts: Mapping[RequestId, int] | None = None,
    active_service_wait_steps: Mapping[RequestId, int] | None = None,
    block_hashes: Mapping[RequestId, list[bytes]] | None = None,
) -> SchedulingSnapshot:
    """Snapshot of ``cache`` for a scheduler.

    ``block_hashes``: waiting requests' prompt block hashes (automatic prefix caching); those
    whose hit would share blocks active requests hold are listed in ``shared_hits``.

    ``specs`` maps every listed id to its spec. ``active_ids`` must be exactly the cache's active
    requests (each attached to its spec's prefix, if any); ``waiting_ids`` must be unknown to the
    cache. Counters default to 0 and may only name ids of their own list. Raises RuntimeError while
    a token transaction is open (a reserved block would make lengths and blocks disagree).
    """
    check_positive_int("step", step, minimum=0)
    if not isinstance(specs, Mapping):
        raise TypeError(
            f"specs must be a mapping of request id -> RequestSpec, got {type(specs).__name__}"
        )
    waiting = _ids("waiting_ids", waiting_ids)
    active = _ids("active_ids", active_ids)
    both = set(waiting) & set(active)
    if both:
        raise ValueError(f"ids both waiting and active: {sorted(both, key=repr)!r}")
    for rid in waiting + active:
        spec = specs.get(rid)
        if not isinstance(spec, RequestSpec):
            raise (ValueError if spec is None else TypeError)(
                f"specs[{rid!r}] must be a RequestSpec, got {type(spec).__name__}"
            )
        if spec.request_id != rid:
            raise ValueError(f"specs[{rid!r}].request_id is {spec.request_id!r}")
    wait_steps = _counters("waiting_wait_steps", waiting_wait_steps, waiting)
    skips = _counters("waiting_skip_counts", waiting_skip_counts, waiting)
    service = _counters("active_service_wait_steps", active_service_wait_steps, active)

    if cache.steps.open_transaction_id is not None:
        raise RuntimeError("cannot snapshot the cache while a token transaction is open")
    cache_active = set(cache.request_ids(RequestState.ACTIVE))
    if cache_active != set(active):
        missing = sorted(cache_active - set(active), key=repr)
        extra = sorted(set(active) - cache_active, key=repr)
        raise ValueError(
            "active_ids must be exactly the cache's active requests: "
            f"missing {missing!r}, not active in the cache {extra!r}"
        )
    seen = [rid for rid in waiting if _known_to(cache, rid)]
    if seen:
        raise ValueError(f"waiting ids are already known to the cache: {seen!r}")

    shapes = cache_group_shapes(cache)
    if shapes:
        return _group_snapshot(
            cache, step, specs, waiting, active, wait_steps, skips, service, shapes, block_hashes
        )
    block_size = cache.block_size
    prefixes = []
    for pid in cache.prefix_ids():
        state = cache.prefix_state(pid)
        prefixes.append(PrefixInfo(pid, state.num_blocks, state.num_tokens, state.refcount))
    prefix_map = {p.prefix_id: p for p in prefixes}

    active_rows = []
    for rid in active:
        spec = specs[rid]
        attached = cache.request_prefix(rid)
        if attached != spec.prefix_id:
            raise ValueError(
                f"active request {rid!r} has prefix {attached!r} attached in the cache but its "
                f"spec names {spec.prefix_id!r}"
            )
        active_rows.append(
            one_group_active_row(
                cache, block_size, prefix_map, spec, cache.seq_len(rid), service.get(rid, 0)
            )
        )
    waiting_rows = [
        WaitingRequest(
            request_id=rid,
            spec=specs[rid],
            lifetime_private_blocks=lifetime_private_blocks(specs[rid], block_size, prefix_map),
            wait_steps=wait_steps.get(rid, 0),
            skip_count=skips.get(rid, 0),
        )
        for rid in waiting
    ]
    waiting_rows.sort(key=lambda r: r.spec.submission_order)
    return cache_snapshot(
        cache,
        step,
        tuple(prefixes),
        tuple(active_rows),
        tuple(waiting_rows),
        grouped=False,
        hits=shared_hits(cache, specs, block_hashes, waiting),
    )


def _group_snapshot(
    cache, step, specs, waiting, active, wait_steps, skips, service, shapes, block_hashes
):
    """``snapshot_from_cache`` of a cache with KV layer groups (shared prefixes need a single
    full-attention group, so there are none)."""
    rows = []
    for rid in active:
        if cache.request_prefix(rid) != specs[rid].prefix_id:
            raise ValueError(
                f"active request {rid!r} has prefix {cache.request_prefix(rid)!r} attached in the "
                f"cache but its spec names {specs[rid].prefix_id!r}"
            )
        rows.append(
            grouped_active_row(
                cache, shapes, {}, specs[rid], cache.seq_len(rid), service.get(rid, 0)
            )
        )
    waiting_rows = []
    for rid in waiting:
        needs = lifetime_private_blocks_by_group(specs[rid], shapes, {})
        waiting_rows.append(
            WaitingRequest(
                rid, specs[rid], needs[0], wait_steps.get(rid, 0), skips.get(rid, 0), needs
            )
        )
    waiting_rows.sort(key=lambda r: r.spec.submission_order)
    hits = shared_hits(cache, specs, block_hashes, waiting)
    return cache_snapshot(
        cache, step, (), tuple(rows), tuple(waiting_rows), grouped=True, hits=hits
    )


def cache_snapshot(
    cache: PagedKVCache, step: int, prefixes, active, waiting, *, grouped: bool, hits=()
) -> SchedulingSnapshot:
    """A snapshot of the cache's pools as they are now. ``grouped`` (a cache with KV layer
    groups, or one window group): every group's pool in ``groups`` and group 0's in the scalar
    fields (the one-group form of the same facts); else the plain one-group snapshot."""
    groups = grouped_pools(cache) if grouped else ()
    pool = groups[0] if grouped else None
    return SchedulingSnapshot(
        step=step,
        cache_version=cache.version,
        block_size=pool.block_size if pool else cache.block_size,
        total_blocks=pool.total_blocks if pool else cache.max_blocks,
        free_blocks=pool.free_blocks if pool else cache.num_free_blocks,
        max_blocks_per_seq=pool.max_blocks_per_seq if pool else cache.max_blocks_per_seq,
        prefixes=prefixes,
        active=active,
        waiting=waiting,
        groups=groups,
        # each active request counts the cached blocks it shares as its own (its remaining
        # need stays exact): the references beyond the first make the counts add up
        shared_block_refs=pool.shared_block_refs
        if pool
        else cache.prefix_cache.shared_cached_block_refs(),
        shared_hits=hits,
    )
