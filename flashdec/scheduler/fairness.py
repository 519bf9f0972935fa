"""Fairness counters: how long each request has waited, and how often it was overtaken.

They are caller state (a policy only reads them from the snapshot); ``advance_fairness_counters``
is the one place that says how a step moves them, so the engine and every workload agree. It
rebuilds every counter (O(n)); ``WaitingQueue.advance`` applies the same rule to the waiting
requests' counters in O(log n), and the tests hold the two equal.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashdec.scheduler.decision import SchedulerDecision
from flashdec.scheduler.snapshot import SchedulingSnapshot
from flashdec.scheduler.spec import RequestId

CounterItems = tuple[tuple[RequestId, int], ...]


@dataclass(frozen=True)
class FairnessCounters:
    """Counters for the next snapshot, as ``(request_id, value)`` pairs (waiting ids in
    submission order, then active ids).

    ``waiting_wait_steps``: steps each waiting request has waited. ``waiting_skip_counts``: times a
    later submission was admitted while it waited. ``active_service_wait_steps``: consecutive steps
    each active request was not decoded.
    """

    waiting_wait_steps: CounterItems = ()
    waiting_skip_counts: CounterItems = ()
    active_service_wait_steps: CounterItems = ()

    def as_kwargs(self) -> dict[str, dict[RequestId, int]]:
        """The keyword arguments ``snapshot_from_cache`` / ``scheduling_snapshot`` take."""
        return {
            "waiting_wait_steps": dict(self.waiting_wait_steps),
            "waiting_skip_counts": dict(self.waiting_skip_counts),
            "active_service_wait_steps": dict(self.active_service_wait_steps),
        }


def counters_of(snapshot: SchedulingSnapshot) -> FairnessCounters:
    """The counters a snapshot was built with."""
    return FairnessCounters(
        waiting_wait_steps=tuple((r.request_id, r.wait_steps) for r in snapshot.waiting),
        waiting_skip_counts=tuple((r.request_id, r.skip_count) for r in snapshot.waiting),
        active_service_wait_steps=tuple(
            (r.request_id, r.service_wait_steps) for r in snapshot.active
        ),
    )


def advance_fairness_counters(
    snapshot: SchedulingSnapshot,
    decision: SchedulerDecision,
    *,
    served_ids: Iterable[RequestId] | None = None,
    departed_ids: Iterable[RequestId] = (),
) -> FairnessCounters:
    """Counters after the step ``decision`` planned from ``snapshot`` has run.

    ``served_ids``: ids that really decoded a token (default: the whole batch; a runner passes
    fewer when some were stuck or cancelled). ``departed_ids``: active or admitted ids that left
    during the step (finished or cancelled); rejected ids leave on their own. Rules: a request still
    waiting waits one more step, and counts a skip if anyone submitted after it was admitted; a
    served request's service wait resets to 0, any other active one's grows by one. Pure.
    """
    if not isinstance(snapshot, SchedulingSnapshot):
        raise TypeError(f"snapshot must be a SchedulingSnapshot, got {type(snapshot).__name__}")
    if not isinstance(decision, SchedulerDecision):
        raise TypeError(f"decision must be a SchedulerDecision, got {type(decision).__name__}")
    if decision.snapshot != snapshot:
        raise ValueError("decision was planned from a different snapshot")
    batch = set(decision.batch)
    served = batch if served_ids is None else set(served_ids)
    if not served <= batch:
        raise ValueError(
            f"served_ids must be batch ids, got extra {sorted(served - batch, key=repr)!r}"
        )
    admitted = set(decision.admit)
    departed = set(departed_ids)
    resident = set(snapshot.active_ids) | admitted
    if not departed <= resident:
        raise ValueError(
            "departed_ids must be active or admitted ids, got "
            f"{sorted(departed - resident, key=repr)!r}"
        )
    gone = admitted | set(decision.reject)
    newest_admitted = max(
        (r.spec.submission_order for r in snapshot.waiting if r.request_id in admitted),
        default=-1,
    )
    wait: list[tuple[RequestId, int]] = []
    skips: list[tuple[RequestId, int]] = []
    for r in snapshot.waiting:
        if r.request_id in gone:
            continue
        overtaken = newest_admitted > r.spec.submission_order
        wait.append((r.request_id, r.wait_steps + 1))
        skips.append((r.request_id, r.skip_count + int(overtaken)))
    service: list[tuple[RequestId, int]] = []
    for r in snapshot.active:
        if r.request_id not in departed:
            value = 0 if r.request_id in served else r.service_wait_steps + 1
            service.append((r.request_id, value))
    for r in snapshot.waiting:
        if r.request_id in admitted and r.request_id not in departed:
            service.append((r.request_id, 0 if r.request_id in served else 1))
    return FairnessCounters(tuple(wait), tuple(skips), tuple(service))
