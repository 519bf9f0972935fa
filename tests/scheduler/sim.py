"""A pure block-count simulation of a scheduler driving a pool (no tensors, no cache).

It mirrors the workload loop with plain integers so properties can run thousands of steps: admit
(import the context's private blocks), decode one token per batch request (a new block at every
block boundary), finish at ``max_new_tokens``. It asserts nothing itself; it records what a test
checks: boundary stalls, decisions, waits and skip counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdec.scheduler import (
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    advance_fairness_counters,
    make_scheduler,
)
from flashdec.scheduler.fairness import FairnessCounters
from flashdec.scheduler.spec import ceil_div
from tests.scheduler.strategies import make_snapshot


@dataclass
class SimResult:
    stalls: int = 0  # batch requests that found no free block
    admitted_at: dict = field(default_factory=dict)
    finished_at: dict = field(default_factory=dict)
    rejected: set = field(default_factory=set)
    aged_at: dict = field(default_factory=dict)  # first step a request's skip_count hit T
    aged_context: dict = field(default_factory=dict)  # requests ahead of it (incl. active) then
    max_skip: int = 0
    decisions: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)
    steps: int = 0


def simulate(
    specs: list[RequestSpec],
    arrivals: list[int],
    *,
    block_size: int,
    num_blocks: int,
    config: SchedulerConfig,
    prefixes: tuple[PrefixInfo, ...] = (),
    policy: str = "lifetime",
    max_steps: int = 2000,
    keep_history: bool = False,
) -> SimResult:
    scheduler = make_scheduler(policy, config)
    by_id = {s.request_id: s for s in specs}
    arrival = {s.request_id: a for s, a in zip(specs, arrivals, strict=True)}
    pmap = {p.prefix_id: p for p in prefixes}
    free = num_blocks - sum(p.num_blocks for p in prefixes)
    pending = sorted(specs, key=lambda s: s.submission_order)
    waiting: list = []
    active: dict = {}  # rid -> committed tokens
    decoded: dict = {}
    counters = FairnessCounters()
    out = SimResult()
    for step in range(max_steps):
        while pending and arrival[pending[0].request_id] <= step:
            waiting.append(pending.pop(0).request_id)
        if not pending and not waiting and not active:
            break
        kw = counters.as_kwargs()
        snap = make_snapshot(
            block_size=block_size,
            total_blocks=num_blocks,
            free_blocks=free,
            prefixes=prefixes,
            active=[
                (by_id[r], t, kw["active_service_wait_steps"].get(r, 0)) for r, t in active.items()
            ],
            waiting=[
                (
                    by_id[r],
                    kw["waiting_wait_steps"].get(r, 0),
                    kw["waiting_skip_counts"].get(r, 0),
                )
                for r in waiting
            ],
            step=step,
        )
        decision = scheduler.plan(snap)
        if keep_history:
            out.snapshots.append(snap)
            out.decisions.append(decision)
        for w in snap.waiting:
            out.max_skip = max(out.max_skip, w.skip_count)
            t = config.aging_threshold
            if t is not None and w.skip_count >= t and w.request_id not in out.aged_at:
                out.aged_at[w.request_id] = step
                ahead = [
                    x for x in snap.waiting if x.spec.submission_order < w.spec.submission_order
                ]
                out.aged_context[w.request_id] = len(snap.active) + len(ahead)
        for rid in decision.reject:
            waiting.remove(rid)
            out.rejected.add(rid)
        for rid in decision.admit:
            spec = by_id[rid]
            waiting.remove(rid)
            prefix = pmap.get(spec.prefix_id)
            shared = prefix.num_blocks if prefix is not None else 0
            free -= ceil_div(spec.initial_context_tokens, block_size) - shared
            active[rid] = spec.initial_context_tokens
            decoded[rid] = 0
            out.admitted_at[rid] = step
        served = []
        for rid in decision.batch:
            if active[rid] % block_size == 0:
                if free <= 0:
                    out.stalls += 1
                    continue
                free -= 1
            active[rid] += 1
            decoded[rid] += 1
            served.append(rid)
        departed = []
        for rid in served:
            spec = by_id[rid]
            if decoded[rid] == spec.max_new_tokens:
                prefix = pmap.get(spec.prefix_id)
                shared = prefix.num_blocks if prefix is not None else 0
                free += ceil_div(active.pop(rid), block_size) - shared
                out.finished_at[rid] = step
                departed.append(rid)
        counters = advance_fairness_counters(
            snap, decision, served_ids=served, departed_ids=departed
        )
        out.steps = step + 1
    return out
