"""Builders and hypothesis strategies for snapshots of caches with KV layer groups."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from flashdec._blocks import blocks_for_tokens
from flashdec.scheduler import (
    ActiveRequest,
    GroupBlocks,
    GroupPool,
    PrefixInfo,
    SchedulingSnapshot,
    WaitingRequest,
    lifetime_private_blocks_by_group,
)
from tests.scheduler.strategies import draw_requests, in_submission_order


def group_prefix(prefix_id, num_tokens, shapes, refcount=0):
    """A prefix of ``num_tokens`` (a multiple of every group's block size)."""
    blocks = tuple(num_tokens // bs for bs, _ in shapes)
    return PrefixInfo(prefix_id, blocks[0], num_tokens, refcount, num_blocks_by_group=blocks)


def group_active_row(spec, shapes, prefixes, committed_tokens, service_wait_steps=0):
    """An ActiveRequest whose blocks per group agree with ``spec`` and ``committed_tokens``."""
    pmap = {p.prefix_id: p for p in prefixes}
    prefix = pmap[spec.prefix_id] if spec.prefix_id is not None else None
    own = committed_tokens - (prefix.num_tokens if prefix else 0)
    lifetimes = lifetime_private_blocks_by_group(spec, shapes, pmap)
    groups = []
    for g, ((bs, window), lifetime) in enumerate(zip(shapes, lifetimes, strict=True)):
        held = blocks_for_tokens(own, bs, window)
        shared = prefix.num_blocks_by_group[g] if prefix else 0
        groups.append(GroupBlocks(held + shared, held, lifetime))
    first = groups[0]
    return ActiveRequest(
        request_id=spec.request_id,
        spec=spec,
        committed_tokens=committed_tokens,
        committed_blocks=first.committed_blocks,
        committed_private_blocks=first.committed_private_blocks,
        lifetime_private_blocks=first.lifetime_private_blocks,
        service_wait_steps=service_wait_steps,
        blocks_by_group=tuple(groups),
    )


def group_waiting_row(spec, shapes, prefixes, wait_steps=0, skip_count=0):
    needs = lifetime_private_blocks_by_group(spec, shapes, {p.prefix_id: p for p in prefixes})
    return WaitingRequest(spec.request_id, spec, needs[0], wait_steps, skip_count, needs)


def used_blocks(shapes, prefixes, active_rows):
    """Blocks held per group by the prefixes and the active rows."""
    return [
        sum(p.num_blocks_by_group[g] for p in prefixes)
        + sum(r.blocks_by_group[g].committed_private_blocks for r in active_rows)
        for g in range(len(shapes))
    ]


def make_group_snapshot(
    *,
    shapes,
    total_blocks,
    free_blocks=None,
    max_blocks_per_seq=None,
    prefixes=(),
    active=(),
    waiting=(),
    step=0,
    cache_version=0,
):
    """A snapshot with one ``GroupPool`` per ``(block_size, window)`` shape, from
    ``(spec, committed_tokens[, service_wait])`` active and ``(spec[, wait, skips])`` waiting
    tuples; free blocks default to what is left in each group."""
    shapes = tuple(shapes)
    prefixes = tuple(prefixes)
    act = tuple(group_active_row(a[0], shapes, prefixes, *a[1:]) for a in active)
    wait = in_submission_order(group_waiting_row(w[0], shapes, prefixes, *w[1:]) for w in waiting)
    used = used_blocks(shapes, prefixes, act)
    if free_blocks is None:
        free_blocks = [t - u for t, u in zip(total_blocks, used, strict=True)]
    if max_blocks_per_seq is None:
        max_blocks_per_seq = total_blocks
    pools = tuple(
        GroupPool(bs, total, free, mbps, window)
        for (bs, window), total, free, mbps in zip(
            shapes, total_blocks, free_blocks, max_blocks_per_seq, strict=True
        )
    )
    first = pools[0]
    return SchedulingSnapshot(
        step=step,
        cache_version=cache_version,
        block_size=first.block_size,
        total_blocks=first.total_blocks,
        free_blocks=first.free_blocks,
        max_blocks_per_seq=first.max_blocks_per_seq,
        prefixes=prefixes,
        active=act,
        waiting=wait,
        groups=pools,
    )


@st.composite
def group_shapes(draw, max_groups=3):
    """1-3 groups of ``(block_size, window)``; a lone group is windowed (else it is the plain
    one-group snapshot)."""
    n = draw(st.integers(1, max_groups))
    shapes = []
    for i in range(n):
        bs = draw(st.sampled_from([1, 2, 4, 8]))
        window = draw(st.one_of(st.none(), st.integers(1, 20)))
        if n == 1 and i == 0 and window is None:
            window = draw(st.integers(1, 20))
        shapes.append((bs, window))
    return tuple(shapes)


@st.composite
def group_snapshots(draw) -> SchedulingSnapshot:
    """Random consistent snapshots with layer groups (windowed and full), prefixes, active
    requests mid-decode and a waiting queue."""
    shapes = draw(group_shapes())
    unit = math.lcm(*(bs for bs, _ in shapes))
    prefixes = tuple(
        group_prefix(f"p{i}", k * unit, shapes)
        for i, k in enumerate(draw(st.lists(st.integers(1, 2), max_size=2)))
    )
    active, waiting = draw_requests(draw, prefixes, max_tokens=30)
    rows = [group_active_row(a[0], shapes, prefixes, *a[1:]) for a in active]
    used = used_blocks(shapes, prefixes, rows)
    frees = [draw(st.integers(0, 20)) for _ in shapes]
    totals = [max(1, u + f + draw(st.integers(0, 2))) for u, f in zip(used, frees, strict=True)]
    return make_group_snapshot(
        shapes=shapes,
        total_blocks=totals,
        free_blocks=frees,
        max_blocks_per_seq=[draw(st.integers(1, t)) for t in totals],
        prefixes=prefixes,
        active=active,
        waiting=waiting,
        step=draw(st.integers(0, 50)),
        cache_version=draw(st.integers(0, 1000)),
    )
