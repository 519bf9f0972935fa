"""Block-aware scheduling: specs, K/V-free snapshots, the lifetime policy and its baselines.

``plan(snapshot)`` is pure; the cache (via ``snapshot_from_cache``) is the source of truth and the
caller (engine or workload) applies decisions and advances the fairness counters. A
``WaitingQueue`` holds the waiting requests and their counters persistently, so a snapshot of it
and a plan on it cost O(log n) in the queue's length, not O(n). With KV layer groups a snapshot
lists each group's pool (``GroupPool``) and every policy counts blocks group by group.
"""

from flashdec.scheduler.base import (
    BaseScheduler,
    empty_pool_capacities,
    empty_pool_capacity,
    max_tokens_per_seq,
    rejection_reason,
    select_batch,
)
from flashdec.scheduler.baselines import (
    CancelScheduler,
    GreedyScheduler,
    blocks_needed_now,
    blocks_needed_now_by_group,
)
from flashdec.scheduler.decision import SchedulerDecision
from flashdec.scheduler.fairness import FairnessCounters, advance_fairness_counters, counters_of
from flashdec.scheduler.groups import GroupPool, needs_new_block
from flashdec.scheduler.policy import BlockAwareScheduler, lifetime_headroom, lifetime_headrooms
from flashdec.scheduler.preemption import swap_victims
from flashdec.scheduler.rows import lifetime_private_blocks_by_group
from flashdec.scheduler.snapshot import (
    ActiveRequest,
    GroupBlocks,
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
    "GroupBlocks",
    "GroupPool",
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
    "blocks_needed_now_by_group",
    "counters_of",
    "empty_pool_capacities",
    "empty_pool_capacity",
    "lifetime_headroom",
    "lifetime_headrooms",
    "lifetime_private_blocks",
    "lifetime_private_blocks_by_group",
    "make_scheduler",
    "max_tokens_per_seq",
    "needs_new_block",
    "rejection_reason",
    "select_batch",
    "swap_victims",
]
