"""Test oracle: the policies as straight scans over a tuple of waiting requests.

This is how the policies were written before the waiting queue became a persistent tree: every
waiting request is looked at, in submission order. The package's plans must decide exactly the
same; they only find the answers without scanning. With layer groups the same scans compare
per-group vectors (a request fits when it fits in every group).
"""

from __future__ import annotations

from flashdec.scheduler import (
    SchedulerConfig,
    SchedulerDecision,
    SchedulingSnapshot,
    WaitingRequest,
    blocks_needed_now,
    blocks_needed_now_by_group,
    lifetime_headroom,
    rejection_reason,
)


def _fits(needs, limits):
    return all(n <= x for n, x in zip(needs, limits, strict=True))


def _minus(limits, needs):
    return [x - n for x, n in zip(limits, needs, strict=True)]


def _group_headrooms(snapshot, reserve):
    """Per group: pool - reserve - prefixes - active lifetimes, and free - reserve - what active
    requests may still take; the smaller."""
    out = []
    for g, pool in enumerate(snapshot.groups):
        prefixes = sum(p.num_blocks_by_group[g] for p in snapshot.prefixes)
        rows = [r.blocks_by_group[g] for r in snapshot.active]
        lifetime = sum(b.lifetime_private_blocks for b in rows)
        taken = sum(b.committed_private_blocks for b in rows)
        by_pool = pool.total_blocks + pool.shared_block_refs - reserve - prefixes - lifetime
        by_free = pool.free_blocks - reserve - (lifetime - taken)
        out.append(min(by_pool, by_free))
    return out


def _lifetime_admit_groups(snapshot, candidates, config):
    headroom = _group_headrooms(snapshot, config.reserve_blocks)
    slots = config.max_active_requests - len(snapshot.active)
    shared = dict(snapshot.shared_hits)
    admit = []
    for request in candidates:
        if slots <= 0:
            break
        needs = request.lifetime_private_blocks_by_group
        if request.request_id in shared:  # blocks shared with active requests: not new
            needs = _minus(needs, shared[request.request_id])
        if _fits(needs, headroom):
            admit.append(request.request_id)
            headroom = _minus(headroom, needs)
            slots -= 1
        elif config.aging_threshold is not None and request.skip_count >= config.aging_threshold:
            break
    return admit


def _greedy_admit_groups(snapshot, candidates, config):
    available = [pool.free_blocks - config.reserve_blocks for pool in snapshot.groups]
    slots = config.max_active_requests - len(snapshot.active)
    admit = []
    for request in candidates:
        need = blocks_needed_now_by_group(request, snapshot)
        if slots <= 0 or not _fits(need, available):
            break
        admit.append(request.request_id)
        available = _minus(available, need)
        slots -= 1
    return admit


def _lifetime_admit(snapshot, candidates, config):
    if snapshot.groups:
        return _lifetime_admit_groups(snapshot, candidates, config)
    headroom = lifetime_headroom(snapshot, config.reserve_blocks)
    slots = config.max_active_requests - len(snapshot.active)
    shared = dict(snapshot.shared_hits)
    admit = []
    for request in candidates:
        if slots <= 0:
            break
        need = request.lifetime_private_blocks - shared.get(request.request_id, (0,))[0]
        if need <= headroom:
            admit.append(request.request_id)
            headroom -= need
            slots -= 1
        elif config.aging_threshold is not None and request.skip_count >= config.aging_threshold:
            break  # aged: nobody submitted after it may overtake it
    return admit


def _greedy_admit(snapshot, candidates, config):
    if snapshot.groups:
        return _greedy_admit_groups(snapshot, candidates, config)
    available = snapshot.free_blocks - config.reserve_blocks
    slots = config.max_active_requests - len(snapshot.active)
    admit = []
    for request in candidates:
        need = blocks_needed_now(request, snapshot)
        if slots <= 0 or need > available:
            break
        admit.append(request.request_id)
        available -= need
        slots -= 1
    return admit


ADMIT = {"lifetime": _lifetime_admit, "greedy": _greedy_admit, "cancel": _greedy_admit}


def reference_batch(snapshot, admit, config):
    order = {r.request_id: r.spec.submission_order for r in snapshot.waiting}
    candidates = [
        (r.service_wait_steps, r.spec.submission_order, r.request_id)
        for r in snapshot.active
        if r.runnable
    ]
    candidates += [(0, order[rid], rid) for rid in admit]
    candidates.sort(key=lambda c: (-c[0], c[1]))
    return tuple(rid for _, _, rid in candidates[: config.max_batch_size])


def reference_plan(
    policy: str, snapshot: SchedulingSnapshot, config: SchedulerConfig
) -> SchedulerDecision:
    """The decision of ``policy`` on ``snapshot``, by scanning ``snapshot.waiting``."""
    waiting: tuple[WaitingRequest, ...] = tuple(snapshot.waiting)
    reject = tuple(
        r.request_id for r in waiting if rejection_reason(r, snapshot, config) is not None
    )
    rejected = set(reject)
    candidates = [r for r in waiting if r.request_id not in rejected]
    admit = tuple(ADMIT[policy](snapshot, candidates, config))
    batch = reference_batch(snapshot, admit, config)
    return SchedulerDecision(
        admit=admit, reject=reject, batch=batch, snapshot=snapshot, config=config
    )
