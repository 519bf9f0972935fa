"""What every scheduling policy shares: the rejection rule, batch selection and the plan skeleton.

A policy only decides *which waiting requests to admit*; everything else — which requests can
never run, which runnable requests are decoded when there are more than the batch holds — is the
same for all policies, so the comparison between them measures admission alone.

Planning never scans the waiting queue: it asks the snapshot's ``WaitingView`` for the requests
that can never run and for the next candidates, so a plan costs
O((admitted + rejected) · log n + active) whatever the queue's length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Set
from typing import Any, ClassVar

from flashdec._blocks import lifetime_blocks
from flashdec.scheduler.decision import SchedulerDecision
from flashdec.scheduler.snapshot import SchedulingSnapshot, WaitingRequest
from flashdec.scheduler.spec import RequestId, SchedulerConfig
from flashdec.scheduler.waiting_queue import WaitingView


def rejection_reason(
    request: WaitingRequest, snapshot: SchedulingSnapshot, config: SchedulerConfig
) -> str | None:
    """Why ``request`` can never run on this pool, or ``None`` if it can.

    A request is hopeless when its prefix is not resident or does not cover its context exactly,
    when its block table would outgrow ``max_blocks_per_seq``, or when its lifetime private blocks
    exceed an empty pool (the pool less the reserve and the resident prefixes, which stay) — with
    layer groups, in any group.
    """
    spec = request.spec
    if spec.prefix_id is not None:
        prefix = snapshot.prefix_map.get(spec.prefix_id)
        if prefix is None:
            return f"prefix {spec.prefix_id!r} is not resident"
        if prefix.num_tokens != spec.initial_context_tokens:
            return (
                f"prefix {spec.prefix_id!r} holds {prefix.num_tokens} tokens but the context is "
                f"{spec.initial_context_tokens} tokens (a prefix must cover it exactly)"
            )
    if snapshot.groups:
        return _group_rejection_reason(request, snapshot, config)
    table_blocks = spec.lifetime_blocks(snapshot.block_size)
    if table_blocks > snapshot.max_blocks_per_seq:
        return (
            f"needs a {table_blocks}-block table, more than max_blocks_per_seq "
            f"{snapshot.max_blocks_per_seq}"
        )
    capacity = empty_pool_capacity(snapshot, config)
    if request.lifetime_private_blocks > capacity:
        return (
            f"needs {request.lifetime_private_blocks} private blocks over its lifetime, more "
            f"than an empty pool offers ({capacity})"
        )
    return None


def _group_rejection_reason(
    request: WaitingRequest, snapshot: SchedulingSnapshot, config: SchedulerConfig
) -> str | None:
    total = request.spec.total_tokens
    capacities = empty_pool_capacities(snapshot, config)
    for g, pool in enumerate(snapshot.groups):
        # the logical table spans the whole request, windowed or not
        table_blocks = lifetime_blocks(total, pool.block_size, None)
        if table_blocks > pool.max_blocks_per_seq:
            return (
                f"needs a {table_blocks}-block table in group {g}, more than its "
                f"max_blocks_per_seq {pool.max_blocks_per_seq}"
            )
    for g, (need, capacity) in enumerate(
        zip(request.lifetime_private_blocks_by_group, capacities, strict=True)
    ):
        if need > capacity:
            return (
                f"needs {need} private blocks in group {g} over its lifetime, more than an "
                f"empty pool offers there ({capacity})"
            )
    return None


def empty_pool_capacity(snapshot: SchedulingSnapshot, config: SchedulerConfig) -> int:
    """Private blocks available once every active request is gone (group 0's, with layer
    groups: see ``empty_pool_capacities``)."""
    return snapshot.total_blocks - config.reserve_blocks - snapshot.resident_prefix_blocks


def empty_pool_capacities(snapshot: SchedulingSnapshot, config: SchedulerConfig) -> tuple[int, ...]:
    """``empty_pool_capacity`` of every layer group (the reserve is kept in each group's pool);
    one entry for a snapshot without groups."""
    return tuple(
        pool.total_blocks - config.reserve_blocks - prefix_blocks
        for pool, prefix_blocks in zip(
            snapshot.pools, snapshot.resident_prefix_blocks_by_group, strict=True
        )
    )


def max_tokens_per_seq(snapshot: SchedulingSnapshot) -> int:
    """The longest request every group's block table can hold."""
    return min(pool.max_tokens for pool in snapshot.pools)


def select_batch(
    snapshot: SchedulingSnapshot, admit: tuple[RequestId, ...], config: SchedulerConfig
) -> tuple[RequestId, ...]:
    """Runnable requests to decode this step, at most ``max_batch_size``.

    Runnable = active with a token left to decode, plus the requests admitted now (``admit``:
    waiting ids). Those waiting longest for service go first (a newly admitted request has
    waited 0 steps), ties by submission order — so a request left out of a full batch rises
    until it is served.
    """
    waiting = snapshot.waiting_view
    # (-service wait, submission order): submission orders are unique, so ids are never compared
    candidates = [
        (-r.service_wait_steps, r.spec.submission_order, r.request_id)
        for r in snapshot.active
        if r.committed_tokens < r.spec.total_tokens  # runnable
    ]
    for rid in admit:
        row = waiting.get(rid)
        if row is None:
            raise ValueError(f"admit names {rid!r}, which is not waiting")
        candidates.append((0, row.spec.submission_order, rid))
    candidates.sort()
    return tuple([c[2] for c in candidates[: config.max_batch_size]])


class BaseScheduler(ABC):
    """A policy: ``plan(snapshot)`` is pure — it reads the snapshot and returns a decision."""

    name: ClassVar[str]

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self._config = config

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._config!r})"

    def plan(self, snapshot: SchedulingSnapshot) -> SchedulerDecision:
        """Decide admissions, rejections and this step's batch. Mutates nothing."""
        if not isinstance(snapshot, SchedulingSnapshot):
            raise TypeError(f"snapshot must be a SchedulingSnapshot, got {type(snapshot).__name__}")
        config = self._config
        waiting = snapshot.waiting_view
        # exactly the requests rejection_reason names, found through the view's aggregates
        if snapshot.groups:
            rejected = waiting.unrunnable_groups(
                empty_pool_capacities(snapshot, config), max_tokens_per_seq(snapshot)
            )
        else:
            rejected = waiting.unrunnable(
                empty_pool_capacity(snapshot, config), snapshot.max_blocks_per_seq
            )
        reject = tuple(waiting[i].request_id for i in rejected)
        admitted = self._admit(snapshot, waiting, frozenset(rejected))
        admit = tuple(waiting[i].request_id for i in admitted)
        batch = select_batch(snapshot, admit, config)
        return SchedulerDecision(
            admit=admit, reject=reject, batch=batch, snapshot=snapshot, config=config
        )

    @abstractmethod
    def _admit(
        self, snapshot: SchedulingSnapshot, waiting: WaitingView, rejected: Set[int]
    ) -> list[int]:
        """Positions in ``waiting`` to admit, ascending. The candidates are the waiting requests
        whose positions are not in ``rejected``, in submission order."""

    def select_victims(
        self, snapshot: SchedulingSnapshot, needing_block: Collection[RequestId]
    ) -> tuple[RequestId, ...]:
        """Active ids to cancel so that every id in ``needing_block`` gets its next block.

        Called by a runner when the pool is short at a block boundary. The default is to cancel
        nothing: the short requests stay stuck until blocks free up.
        """
        return ()


def next_candidate(
    find: Callable[[int, Any], int | None], start: int, bound: Any, rejected: Set[int]
) -> int | None:
    """The first position ``find(start, bound)`` returns from ``start`` on that is not rejected
    (each rejected hit costs one more search)."""
    found = find(start, bound)
    while found is not None and found in rejected:
        found = find(found + 1, bound)
    return found
