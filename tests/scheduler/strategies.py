"""Hypothesis strategies and builders for scheduler tests: consistent random snapshots."""

from __future__ import annotations

from hypothesis import strategies as st

from flashdec.scheduler import (
    ActiveRequest,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
    WaitingRequest,
    lifetime_private_blocks,
)
from flashdec.scheduler.spec import ceil_div


def active_row(spec, block_size, prefixes, committed_tokens, service_wait_steps=0):
    """An ActiveRequest whose derived fields agree with ``spec`` and ``committed_tokens``."""
    pmap = {p.prefix_id: p for p in prefixes}
    prefix_blocks = pmap[spec.prefix_id].num_blocks if spec.prefix_id is not None else 0
    blocks = ceil_div(committed_tokens, block_size)
    return ActiveRequest(
        request_id=spec.request_id,
        spec=spec,
        committed_tokens=committed_tokens,
        committed_blocks=blocks,
        committed_private_blocks=blocks - prefix_blocks,
        lifetime_private_blocks=lifetime_private_blocks(spec, block_size, pmap),
        service_wait_steps=service_wait_steps,
    )


def waiting_row(spec, block_size, prefixes, wait_steps=0, skip_count=0):
    pmap = {p.prefix_id: p for p in prefixes}
    return WaitingRequest(
        request_id=spec.request_id,
        spec=spec,
        lifetime_private_blocks=lifetime_private_blocks(spec, block_size, pmap),
        wait_steps=wait_steps,
        skip_count=skip_count,
    )


def in_submission_order(waiting_rows):
    """Waiting rows as a snapshot lists them: in submission order."""
    return tuple(sorted(waiting_rows, key=lambda r: r.spec.submission_order))


def make_snapshot(
    *,
    block_size=4,
    total_blocks=16,
    free_blocks=None,
    max_blocks_per_seq=None,
    prefixes=(),
    active=(),
    waiting=(),
    step=0,
    cache_version=0,
):
    """A snapshot from ``(spec, committed_tokens[, service_wait])`` active tuples and
    ``(spec[, wait_steps, skip_count])`` waiting tuples; free blocks default to what is left."""
    prefixes = tuple(prefixes)
    act = tuple(active_row(a[0], block_size, prefixes, *a[1:]) for a in active)
    wait = in_submission_order(waiting_row(w[0], block_size, prefixes, *w[1:]) for w in waiting)
    used = sum(p.num_blocks for p in prefixes) + sum(r.committed_private_blocks for r in act)
    return SchedulingSnapshot(
        step=step,
        cache_version=cache_version,
        block_size=block_size,
        total_blocks=total_blocks,
        free_blocks=total_blocks - used if free_blocks is None else free_blocks,
        max_blocks_per_seq=total_blocks if max_blocks_per_seq is None else max_blocks_per_seq,
        prefixes=prefixes,
        active=act,
        waiting=wait,
    )


configs = st.builds(
    SchedulerConfig,
    max_active_requests=st.integers(1, 8),
    max_batch_size=st.integers(1, 8),
    reserve_blocks=st.integers(0, 3),
    aging_threshold=st.one_of(st.none(), st.integers(0, 4)),
)


def draw_requests(draw, prefixes, max_tokens):
    """Up to 10 requests in a random submission order, each either active mid-decode
    (``(spec, committed_tokens, service_wait)``) or waiting (``(spec, wait_steps, skip_count)``),
    with up to ``max_tokens`` context and new tokens; some use one of ``prefixes``. Returns
    ``(active, waiting)`` as ``make_snapshot`` and ``make_group_snapshot`` take them (``draw``
    is a composite strategy's)."""
    n = draw(st.integers(0, 10))
    orders = draw(st.permutations(range(n)))
    active, waiting = [], []
    for i in range(n):
        new = draw(st.integers(1, max_tokens))
        is_active = draw(st.booleans())
        pid = None
        if prefixes and draw(st.booleans()):
            prefix = draw(st.sampled_from(prefixes))
            pid = prefix.prefix_id
            # an active request's prefix covers its context; a waiting one may mismatch
            ctx = prefix.num_tokens if is_active else draw(st.sampled_from([prefix.num_tokens, 3]))
        else:
            ctx = draw(st.integers(0, max_tokens))
        spec = RequestSpec(f"r{i}", ctx, new, submission_order=orders[i], prefix_id=pid)
        if is_active:
            low = ctx if pid is not None else 0
            committed = draw(st.integers(low, spec.total_tokens))
            active.append((spec, committed, draw(st.integers(0, 5))))
        else:
            waiting.append((spec, draw(st.integers(0, 9)), draw(st.integers(0, 6))))
    return active, waiting


@st.composite
def snapshots(draw) -> SchedulingSnapshot:
    """Random consistent snapshots: prefixes, active requests mid-decode, a waiting queue."""
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    prefixes = tuple(
        PrefixInfo(f"p{i}", nb, nb * bs, 0)
        for i, nb in enumerate(draw(st.lists(st.integers(1, 3), max_size=2)))
    )
    active, waiting = draw_requests(draw, prefixes, max_tokens=24)
    probe = make_snapshot(block_size=bs, total_blocks=10_000, prefixes=prefixes, active=active)
    used = 10_000 - probe.free_blocks
    free = draw(st.integers(0, 24))
    hidden = draw(st.integers(0, 2))  # blocks held by something the snapshot does not list
    total = max(1, used + free + hidden)
    return make_snapshot(
        block_size=bs,
        total_blocks=total,
        free_blocks=free,
        max_blocks_per_seq=draw(st.integers(1, total)),
        prefixes=prefixes,
        active=active,
        waiting=waiting,
        step=draw(st.integers(0, 50)),
        cache_version=draw(st.integers(0, 1000)),
    )
