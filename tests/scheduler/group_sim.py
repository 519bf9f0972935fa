"""A model of a grouped cache's block pools, driven by a scheduler, for the property tests.

Each layer group has its own pool. A request holds, in each group, the blocks of the positions a
later decode can still read (all of them with full attention; ``[n + 1 - window, n)`` in a window
group), plus the block of the token being appended during a step — tracked here as explicit sets
of logical blocks, independently of the package's block formulas. Prompts are imported a token at
a time, so an import's peak is a decode's. Every block a request takes is checked against its
group's free count: a shortfall is a *stall* (a request stuck at a block boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdec.scheduler import (
    ActiveRequest,
    GroupBlocks,
    GroupPool,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
    WaitingQueue,
    lifetime_private_blocks_by_group,
    make_scheduler,
)


@dataclass
class GroupSimResult:
    stalls: int = 0  # blocks a scheduled request needed that its group did not have
    admitted_at: dict = field(default_factory=dict)
    finished_at: dict = field(default_factory=dict)
    rejected: set = field(default_factory=set)
    max_active: int = 0  # most requests resident at once
    max_held: list = field(default_factory=list)  # per group: most private blocks one request held
    steps: int = 0


class _Request:
    def __init__(self, spec: RequestSpec, prefix: PrefixInfo | None, num_groups: int) -> None:
        self.spec = spec
        self.prefix = prefix
        self.tokens = prefix.num_tokens if prefix else 0
        self.held: list[set[int]] = [set() for _ in range(num_groups)]  # private logical blocks


class GroupedPools:
    """Free blocks per group, and what each resident request holds there."""

    def __init__(self, shapes, totals, prefixes) -> None:
        self.shapes = tuple(shapes)
        self.totals = list(totals)
        self.free = [
            t - sum(p.num_blocks_by_group[g] for p in prefixes) for g, t in enumerate(totals)
        ]
        self.prefixes = {p.prefix_id: p for p in prefixes}
        self.requests: dict = {}
        self.stalls = 0

    def _start(self, r: _Request) -> int:
        return r.prefix.num_tokens if r.prefix else 0

    def _keep(self, r: _Request, g: int) -> set[int]:
        """Logical private blocks holding a position the next decode can read."""
        bs, window = self.shapes[g]
        n, start = r.tokens, self._start(r)
        low = start if window is None else max(start, n + 1 - window)
        return {p // bs for p in range(low, n)}

    def append(self, rid) -> bool:
        """Reserve, write and commit the next token in every group; False (and nothing taken)
        if some group has no block for it."""
        r = self.requests[rid]
        takes = []
        for g, (bs, _) in enumerate(self.shapes):
            block = r.tokens // bs
            takes.append(block not in r.held[g])
        if any(t and self.free[g] < 1 for g, t in enumerate(takes)):
            self.stalls += 1
            return False
        for g, (bs, _) in enumerate(self.shapes):
            if takes[g]:
                self.free[g] -= 1
                r.held[g].add(r.tokens // bs)
        r.tokens += 1
        for g in range(len(self.shapes)):  # commit: release what the window left behind
            keep = self._keep(r, g)
            self.free[g] += len(r.held[g] - keep)
            r.held[g] = keep
        return True

    def admit(self, spec: RequestSpec) -> None:
        prefix = self.prefixes.get(spec.prefix_id) if spec.prefix_id is not None else None
        self.requests[spec.request_id] = _Request(spec, prefix, len(self.shapes))

    def release(self, rid) -> None:
        r = self.requests.pop(rid)
        for g in range(len(self.shapes)):
            self.free[g] += len(r.held[g])

    def active_row(self, rid, service_wait: int) -> ActiveRequest:
        r = self.requests[rid]
        lifetimes = lifetime_private_blocks_by_group(r.spec, self.shapes, self.prefixes)
        groups = tuple(
            GroupBlocks(
                len(r.held[g]) + (r.prefix.num_blocks_by_group[g] if r.prefix else 0),
                len(r.held[g]),
                lifetimes[g],
            )
            for g in range(len(self.shapes))
        )
        first = groups[0]
        return ActiveRequest(
            rid,
            r.spec,
            r.tokens,
            first.committed_blocks,
            first.committed_private_blocks,
            first.lifetime_private_blocks,
            service_wait,
            groups,
        )


def simulate_groups(
    specs: list[RequestSpec],
    arrivals: list[int],
    *,
    shapes,
    total_blocks,
    config: SchedulerConfig,
    max_blocks_per_seq=None,
    prefixes: tuple[PrefixInfo, ...] = (),
    policy: str = "lifetime",
    max_steps: int = 3000,
) -> GroupSimResult:
    """Run ``specs`` (submitted at ``arrivals``) to completion on grouped pools."""
    pools = GroupedPools(shapes, total_blocks, prefixes)
    mbps = list(max_blocks_per_seq or total_blocks)
    scheduler = make_scheduler(policy, config)
    queue = WaitingQueue()
    service: dict = {}
    out = GroupSimResult(max_held=[0] * len(pools.shapes))
    pending = sorted(zip(arrivals, specs, strict=True), key=lambda a: (a[0], a[1].submission_order))
    step = 0
    while step < max_steps:
        while pending and pending[0][0] <= step:
            spec = pending.pop(0)[1]
            queue.submit(
                spec, block_size=pools.shapes[0][0], prefixes=prefixes, group_shapes=pools.shapes
            )
        if not pending and not len(queue) and not pools.requests:
            break
        groups = tuple(
            GroupPool(bs, total, free, m, window)
            for (bs, window), total, free, m in zip(
                pools.shapes, pools.totals, pools.free, mbps, strict=True
            )
        )
        snapshot = SchedulingSnapshot(
            step=step,
            cache_version=step,
            block_size=groups[0].block_size,
            total_blocks=groups[0].total_blocks,
            free_blocks=groups[0].free_blocks,
            max_blocks_per_seq=groups[0].max_blocks_per_seq,
            prefixes=prefixes,
            active=tuple(pools.active_row(rid, service.get(rid, 0)) for rid in pools.requests),
            waiting=queue.view(),
            groups=groups,
        )
        decision = scheduler.plan(snapshot)
        for rid in decision.reject:
            queue.remove(rid)
            out.rejected.add(rid)
        for rid in decision.admit:
            spec = queue.remove(rid)
            pools.admit(spec)
            out.admitted_at[rid] = step
            while pools.requests[rid].tokens < spec.initial_context_tokens:  # the prompt import
                if not pools.append(rid):
                    raise AssertionError(f"{policy} admitted {rid!r} without blocks for its prompt")
        out.max_active = max(out.max_active, len(pools.requests))
        served = set()
        victims: tuple = ()
        if policy != "lifetime":
            needing = [rid for rid in decision.batch if _takes_block(pools, rid)]
            victims = scheduler.select_victims(snapshot_after(snapshot, pools, service), needing)
            for rid in victims:
                pools.release(rid)
        for rid in decision.batch:
            if rid not in victims and pools.append(rid):
                served.add(rid)
        for r in pools.requests.values():
            for g in range(len(pools.shapes)):
                out.max_held[g] = max(out.max_held[g], len(r.held[g]))
        for rid in [
            rid
            for rid in served
            if pools.requests[rid].tokens == pools.requests[rid].spec.total_tokens
        ]:
            pools.release(rid)
            out.finished_at[rid] = step
        newest = max((queue_order(decision, rid) for rid in decision.admit), default=None)
        queue.advance(newest)
        for rid in list(service) + list(pools.requests):
            if rid not in pools.requests:
                service.pop(rid, None)
            else:
                service[rid] = 0 if rid in served else service.get(rid, 0) + 1
        step += 1
    out.stalls = pools.stalls
    out.steps = step
    return out


def queue_order(decision, rid) -> int:
    return decision.snapshot.waiting_view.get(rid).spec.submission_order


def _takes_block(pools: GroupedPools, rid) -> bool:
    r = pools.requests[rid]
    return any(r.tokens // bs not in r.held[g] for g, (bs, _) in enumerate(pools.shapes))


def snapshot_after(
    snapshot: SchedulingSnapshot, pools: GroupedPools, service
) -> SchedulingSnapshot:
    """The snapshot once admissions were imported (what a runner shows ``select_victims``)."""
    groups = tuple(
        GroupPool(p.block_size, p.total_blocks, free, p.max_blocks_per_seq, p.window)
        for p, free in zip(snapshot.groups, pools.free, strict=True)
    )
    return SchedulingSnapshot(
        step=snapshot.step,
        cache_version=snapshot.cache_version + 1,
        block_size=snapshot.block_size,
        total_blocks=snapshot.total_blocks,
        free_blocks=groups[0].free_blocks,
        max_blocks_per_seq=snapshot.max_blocks_per_seq,
        prefixes=snapshot.prefixes,
        active=tuple(pools.active_row(rid, service.get(rid, 0)) for rid in pools.requests),
        groups=groups,
    )
