"""Block-aware scheduling: specs, K/V-free snapshots, the lifetime policy and its baselines.

``plan(snapshot)`` is pure; the cache (via ``snapshot_from_cache``) is the source of truth and the
caller (engine or workload) applies decisions and advances the fairness counters. A
``WaitingQueue`` holds the waiting requests and their counters persistently, so a snapshot of it
and a plan on it cost O(log n) in the queue's length, not O(n).
"""

from flashdec.scheduler.base import (
    BaseScheduler,
    empty_pool_capacity,
    rejection_reason,
    select_batch,
)
from flashdec.scheduler.baselines import CancelScheduler, GreedyScheduler, blocks_needed_now
from flashdec.scheduler.decision import SchedulerDecision
from flashdec.scheduler.fairness import FairnessCounters, advance_fairness_counters, counters_of
from flashdec.scheduler.policy import BlockAwareScheduler, lifetime_headroom
from flashdec.scheduler.snapshot import (
    ActiveRequest,
    PrefixInfo,
    SchedulingSnapshot,
    WaitingRequest,
    lifetime_private_blocks,
)
from flashdec.scheduler.spec import PrefixId, RequestId, RequestSpec, SchedulerConfig
from flashdec.scheduler.waiting_queue import WaitingQueue, WaitingView

POLICIES: dict[str, type[BaseScheduler]] = {
    cls.name: cls for cls in (BlockAwareScheduler, CancelScheduler, GreedyScheduler)
}


def make_scheduler(policy: str, config: SchedulerConfig) -> BaseScheduler:
    """The scheduler for a policy name: ``"lifetime"``, ``"cancel"`` or ``"greedy"``."""
    cls = POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return cls(config)


__all__ = [
    "POLICIES",
    "ActiveRequest",
    "BaseScheduler",
    "BlockAwareScheduler",
    "CancelScheduler",
    "FairnessCounters",
    "GreedyScheduler",
    "PrefixId",
    "PrefixInfo",
    "RequestId",
    "RequestSpec",
    "SchedulerConfig",
    "SchedulerDecision",
    "SchedulingSnapshot",
    "WaitingQueue",
    "WaitingRequest",
    "WaitingView",
    "advance_fairness_counters",
    "blocks_needed_now",
    "counters_of",
    "empty_pool_capacity",
    "lifetime_headroom",
    "lifetime_private_blocks",
    "make_scheduler",
    "rejection_reason",
    "select_batch",
]
