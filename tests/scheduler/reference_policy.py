"""Test oracle: the policies as straight scans over a tuple of waiting requests.

This is how the policies were written before the waiting queue became a persistent tree: every
waiting request is looked at, in submission order. The package's plans must decide exactly the
same; they only find the answers without scanning.
"""

from __future__ import annotations

from flashdec.scheduler import (
    SchedulerConfig,
    SchedulerDecision,
    SchedulingSnapshot,
    WaitingRequest,
    blocks_needed_now,
    lifetime_headroom,
    rejection_reason,
)


def _lifetime_admit(snapshot, candidates, config):
    headroom = lifetime_headroom(snapshot, config.reserve_blocks)
    slots = config.max_active_requests - len(snapshot.active)
    admit = []
    for request in candidates:
        if slots <= 0:
            break
        if request.lifetime_private_blocks <= headroom:
            admit.append(request.request_id)
            headroom -= request.lifetime_private_blocks
            slots -= 1
        elif config.aging_threshold is not None and request.skip_count >= config.aging_threshold:
            break  # aged: nobody submitted after it may overtake it
    return admit


def _greedy_admit(snapshot, candidates, config):
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
