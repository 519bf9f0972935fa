"""``run_scheduler_workload``: lifetime vs cancel vs greedy admission on finite traces.

Each policy drives its own real ``PagedKVCache`` and ``DecodeEngine`` (one layer, one tiny KV
head, fp32, CPU, torch backends) through the same :class:`~flashdec.engine.ServingLoop` every
other workload uses; only the scheduler differs. Per step the loop plans, admits (attaching a
shared prefix, importing the rest of the context in one transaction), decodes one token for the
batch — a request at a block boundary needs a fresh block: if the pool cannot give every such
request one, the policy's ``select_victims`` may cancel requests (cancel baseline), and whoever
still finds no block is *stuck* this step — and finishes requests at ``max_new_tokens``.

A run ends when every request is terminal, or as a *deadlock* when ``deadlock_patience``
consecutive steps change nothing (no token, admission, rejection or cancel) while requests
remain; what is left is then cancelled, so the cache ends empty. K/V values are seeded random
numbers: the scheduling outcome depends only on the trace.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from flashdec._checks import check_positive_int
from flashdec.cache import PagedKVCache
from flashdec.engine import DecodeEngine
from flashdec.engine.loop import ServingLoop, StepExecutor, run_loop
from flashdec.scheduler import (
    POLICIES,
    PrefixId,
    RequestId,
    RequestSpec,
    SchedulerConfig,
    make_scheduler,
)
from flashdec.scheduler.spec import check_request_id
from flashdec.workloads.stats import LatencyStats, jain_index, ratio, safe_rate

NUM_KV_HEADS = 1  # K/V content is irrelevant to scheduling: keep the cache tiny
HEAD_DIM = 4
BIG_AGING_REQUEST = "r12"  # the big request of the "aging" trace


@dataclass(frozen=True)
class WorkloadTrace:
    """A finite workload: requests (submission order) with arrival steps, a pool and a config.

    ``prefixes`` are ``(prefix_id, num_blocks)`` registered (resident) before the first request.
    """

    name: str
    requests: tuple[RequestSpec, ...]
    arrival_steps: tuple[int, ...]
    num_blocks: int
    block_size: int
    config: SchedulerConfig
    prefixes: tuple[tuple[PrefixId, int], ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.requests, tuple) or not all(
            isinstance(r, RequestSpec) for r in self.requests
        ):
            raise TypeError("requests must be a tuple of RequestSpec")
        if not isinstance(self.arrival_steps, tuple):
            raise TypeError("arrival_steps must be a tuple of ints")
        if len(self.arrival_steps) != len(self.requests):
            raise ValueError(
                f"arrival_steps has {len(self.arrival_steps)} entries for "
                f"{len(self.requests)} requests"
            )
        for i, a in enumerate(self.arrival_steps):
            check_positive_int(f"arrival_steps[{i}]", a, minimum=0)
        check_positive_int("num_blocks", self.num_blocks, minimum=1)
        check_positive_int("block_size", self.block_size, minimum=1)
        if not isinstance(self.config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(self.config).__name__}")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError("requests must have distinct request ids")
        orders = [r.submission_order for r in self.requests]
        if orders != sorted(set(orders)):
            raise ValueError("requests must be listed in strictly increasing submission_order")
        if list(self.arrival_steps) != sorted(self.arrival_steps):
            raise ValueError("arrival_steps must not decrease along the submission order")
        if not isinstance(self.prefixes, tuple):
            raise TypeError("prefixes must be a tuple of (prefix_id, num_blocks)")
        for i, item in enumerate(self.prefixes):
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"prefixes[{i}] must be a (prefix_id, num_blocks) tuple")
            check_request_id(f"prefixes[{i}][0]", item[0])
            check_positive_int(f"prefixes[{i}][1]", item[1], minimum=1)
        if len({p for p, _ in self.prefixes}) != len(self.prefixes):
            raise ValueError("prefixes must have distinct ids")

    @property
    def prefix_blocks(self) -> int:
        return sum(n for _, n in self.prefixes)


@dataclass(frozen=True)
class PolicyRunResult:
    """One policy on one trace. Counts are requests; steps are scheduler steps."""

    policy: str
    num_requests: int
    finished: int
    cancelled: int
    rejected: int
    stuck: int  # still active when the run stopped
    never_admitted: int  # still waiting (or not yet arrived) when the run stopped
    completion_rate: float  # finished / num_requests
    deadlock: bool
    steps: int
    tokens_decoded: int  # decode tokens only (context import not counted)
    elapsed_s: float  # wall time of all steps
    tokens_per_s: float
    step_latency: LatencyStats  # complete step: snapshot + plan + admit/import + append + finish
    peak_active: int
    stall_events: int  # (request, step) pairs where a batch request got no block
    max_service_wait_steps: int  # longest an active runnable request went undecoded
    max_waiting_steps: int  # longest a request waited from arrival to admission (or the end)
    jain_service_rate: float  # Jain index of tokens / steps-in-system over non-rejected requests
    waiting_steps_by_request: tuple[tuple[RequestId, int], ...]
    active_trajectory: tuple[int, ...]  # active requests at the end of each step
    free_blocks_trajectory: tuple[int, ...]  # free blocks at the end of each step
    batch_trajectory: tuple[int, ...]  # requests that decoded a token in each step

    def waiting_steps_of(self, request_id: RequestId) -> int:
        return dict(self.waiting_steps_by_request)[request_id]

    def outcome(self) -> tuple:
        """Every field that does not depend on wall-clock time (for determinism checks)."""
        timing = {"elapsed_s", "tokens_per_s", "step_latency"}
        return tuple(v for k, v in asdict(self).items() if k not in timing)


@dataclass(frozen=True)
class SchedulerWorkloadResult:
    """All policies on one trace."""

    trace: str
    seed: int
    aging_threshold: int | None
    prefix_sharing: bool
    num_blocks: int
    block_size: int
    config: SchedulerConfig
    runs: tuple[PolicyRunResult, ...]

    def run(self, policy: str) -> PolicyRunResult:
        for r in self.runs:
            if r.policy == policy:
                return r
        raise ValueError(f"no run for policy {policy!r}; ran {[r.policy for r in self.runs]}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- built-in traces


def _specs(rows: Sequence[tuple[int, int, PrefixId | None]]) -> tuple[RequestSpec, ...]:
    return tuple(
        RequestSpec(f"r{i}", ctx, new, submission_order=i, prefix_id=pid)
        for i, (ctx, new, pid) in enumerate(rows)
    )


def _boundary_trace(seed: int) -> WorkloadTrace:
    # 12 requests whose context fills exactly one block and whose decode needs one more: every
    # one is admitted by greedy (its context fits), then all hit the block boundary together.
    bs = 8
    rows = [(bs, bs, None)] * 12
    return WorkloadTrace(
        name="boundary",
        requests=_specs(rows),
        arrival_steps=(0,) * 12,
        num_blocks=12,
        block_size=bs,
        config=SchedulerConfig(max_active_requests=12, max_batch_size=12),
        description="12 x (1 context block + 1 decode block) on a 12-block pool",
    )


def _aging_trace(seed: int) -> WorkloadTrace:
    # Two small requests (2 blocks over their life, 4 decode steps) arrive every step for 40
    # steps, so about 4 blocks free up per step; a big request (8 blocks) arrives at step 6. In
    # steady state the freed blocks never reach 8 while smalls keep fitting: without aging the
    # smalls overtake it until the stream ends; with aging it blocks them after 8 skips.
    bs = 4
    rows: list[tuple[int, int, PrefixId | None]] = []
    arrivals: list[int] = []
    for step in range(40):
        if step == 6:
            rows.append((24, 8, None))
            arrivals.append(step)
        rows += [(4, 4, None)] * 2
        arrivals += [step, step]
    return WorkloadTrace(
        name="aging",
        requests=_specs(rows),
        arrival_steps=tuple(arrivals),
        num_blocks=16,
        block_size=bs,
        config=SchedulerConfig(max_active_requests=8, max_batch_size=8, aging_threshold=8),
        description=f"big request {BIG_AGING_REQUEST} (8 blocks) arriving at step 6 in a stream "
        "of 2-block requests (2 per step for 40 steps), 16-block pool",
    )


def _prefix_trace(seed: int) -> WorkloadTrace:
    # 16 requests whose 16-token context is one shared 4-block prefix: private need 2 blocks each
    # with sharing (prefix counted once), 6 blocks each without.
    bs = 4
    rows = [(16, 8, "sys")] * 16
    return WorkloadTrace(
        name="prefix",
        requests=_specs(rows),
        arrival_steps=(0,) * 16,
        num_blocks=24,
        block_size=bs,
        config=SchedulerConfig(max_active_requests=16, max_batch_size=16),
        prefixes=(("sys", 4),),
        description="16 requests on one resident 4-block prefix, 24-block pool",
    )


def _mixed_trace(seed: int) -> WorkloadTrace:
    # Seeded random sizes and arrivals, including a few requests too big for the pool.
    rng = random.Random(seed)
    bs = 8
    rows: list[tuple[int, int, PrefixId | None]] = []
    arrivals = []
    step = 0
    for _ in range(40):
        step += rng.choice((0, 0, 1, 1, 2))
        ctx = rng.randrange(0, 48)
        new = rng.randrange(1, 32)
        if rng.random() < 0.1:
            ctx = 200  # can never fit: must be rejected, not wait forever
        rows.append((ctx, new, None))
        arrivals.append(step)
    return WorkloadTrace(
        name="mixed",
        requests=_specs(rows),
        arrival_steps=tuple(arrivals),
        num_blocks=24,
        block_size=bs,
        config=SchedulerConfig(max_active_requests=6, max_batch_size=4, reserve_blocks=1),
        description="40 seeded random requests (context 0-47, 1-31 new), 24-block pool",
    )


TRACE_BUILDERS = {
    "boundary": _boundary_trace,
    "aging": _aging_trace,
    "prefix": _prefix_trace,
    "mixed": _mixed_trace,
}
TRACE_NAMES = tuple(TRACE_BUILDERS)


def build_trace(name: str, seed: int = 0) -> WorkloadTrace:
    """A built-in trace by name (``TRACE_NAMES``); only ``"mixed"`` depends on ``seed``."""
    builder = TRACE_BUILDERS.get(name)
    if builder is None:
        raise ValueError(f"trace must be one of {TRACE_NAMES}, got {name!r}")
    check_positive_int("seed", seed, minimum=0)
    return builder(seed)


def without_prefix_sharing(trace: WorkloadTrace) -> WorkloadTrace:
    """The same requests with their context private: no prefix registered, none attached."""
    requests = tuple(replace(r, prefix_id=None) for r in trace.requests)
    return replace(trace, requests=requests, prefixes=())


# ---------------------------------------------------------------------------- the runner


class _TinyKVExecutor(StepExecutor):
    """K/V content is irrelevant to scheduling: one layer, one tiny head, seeded values."""

    def __init__(self, engine: DecodeEngine, seed: int) -> None:
        self.engine = engine
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32)

    def prefill(self, requests) -> None:
        total = sum(n for _, n in requests)
        tx = self.engine.begin_prefill([rid for rid, _ in requests], [n for _, n in requests])
        self.engine.prefill_layer(tx, 0, *self.randn(2, total, NUM_KV_HEADS, HEAD_DIM))
        self.engine.commit_step(tx)

    def decode(self, batch) -> tuple:
        n = len(batch)
        q, k, v = self.randn(3, n, NUM_KV_HEADS, HEAD_DIM)
        self.engine.step(list(batch), q, k, v)
        return ()


def _run_policy(
    trace: WorkloadTrace,
    policy: str,
    seed: int,
    config: SchedulerConfig,
    patience: int,
    max_steps: int,
    check_invariants: bool,
) -> PolicyRunResult:
    """One policy on one trace: a real cache and engine driven by the serving loop."""
    cache = PagedKVCache(
        1,
        NUM_KV_HEADS,
        HEAD_DIM,
        trace.block_size,
        trace.num_blocks,
        dtype=torch.float32,
        device="cpu",
        prefix_cache_capacity_blocks=trace.prefix_blocks,
    )
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    executor = _TinyKVExecutor(engine, seed)
    for pid, nblocks in trace.prefixes:
        shape = (1, nblocks, NUM_KV_HEADS, trace.block_size, HEAD_DIM)
        engine.register_prefix(pid, executor.randn(*shape), executor.randn(*shape))
    loop = ServingLoop(
        engine, make_scheduler(policy, config), executor, check_invariants=check_invariants
    )
    arrival = {r.request_id: a for r, a in zip(trace.requests, trace.arrival_steps, strict=True)}
    outcome = run_loop(
        loop,
        zip(trace.arrival_steps, trace.requests, strict=True),
        max_steps=max_steps,
        patience=patience,
    )
    steps = outcome.num_steps
    admitted_at, left_at, result_of = {}, {}, {}
    for record in outcome.steps:
        for rid in record.admitted:
            admitted_at[rid] = record.step
        for outcome_name, rids in (
            ("rejected", record.rejected),
            ("cancelled", record.cancelled),
            ("finished", record.finished),
        ):
            for rid in rids:
                result_of[rid] = outcome_name
                left_at[rid] = record.step
    counts = {
        o: sum(1 for v in result_of.values() if v == o)
        for o in ("finished", "cancelled", "rejected")
    }
    waits, rates = [], []
    decoded = Counter(rid for record in outcome.steps for rid in record.served)
    for request in trace.requests:
        rid = request.request_id
        arrived = arrival[rid]
        # waiting ends at admission, at rejection, or when the run stops
        end = admitted_at.get(rid, left_at.get(rid, steps))
        waits.append((rid, max(0, end - arrived)))
        if result_of.get(rid) != "rejected" and arrived < steps:
            in_system = left_at.get(rid, steps - 1) - arrived + 1
            rates.append(decoded.get(rid, 0) / in_system)
    latencies = [r.schedule_s + r.run_s for r in outcome.steps]
    elapsed = sum(latencies)
    tokens = sum(decoded.values())
    n = len(trace.requests)
    return PolicyRunResult(
        policy=policy,
        num_requests=n,
        finished=counts["finished"],
        cancelled=counts["cancelled"],
        rejected=counts["rejected"],
        stuck=len(outcome.unfinished_active),
        never_admitted=len(outcome.unfinished_waiting),
        completion_rate=ratio(counts["finished"], n),
        deadlock=outcome.deadlock,
        steps=len(outcome.steps),
        tokens_decoded=tokens,
        elapsed_s=elapsed,
        tokens_per_s=safe_rate(tokens, elapsed),
        step_latency=LatencyStats.from_seconds(latencies),
        peak_active=max((r.active for r in outcome.steps), default=0),
        stall_events=sum(len(r.stuck) for r in outcome.steps),
        max_service_wait_steps=max((r.max_service_wait for r in outcome.steps), default=0),
        max_waiting_steps=max((w for _, w in waits), default=0),
        jain_service_rate=jain_index(rates),
        waiting_steps_by_request=tuple(waits),
        active_trajectory=tuple(r.active for r in outcome.steps),
        free_blocks_trajectory=tuple(r.free_blocks for r in outcome.steps),
        batch_trajectory=tuple(len(r.served) for r in outcome.steps),
    )


_DEFAULT = object()


def run_scheduler_workload(
    trace: str | WorkloadTrace = "boundary",
    policies: Sequence[str] = ("lifetime", "cancel", "greedy"),
    seed: int = 0,
    *,
    aging_threshold: Any = _DEFAULT,
    prefix_sharing: bool = True,
    deadlock_patience: int = 4,
    max_steps: int = 10_000,
    check_invariants: bool = False,
) -> SchedulerWorkloadResult:
    """Run every policy on ``trace`` (a built-in name or a ``WorkloadTrace``).

    ``aging_threshold`` overrides the trace config's (``None`` = aging off);
    ``prefix_sharing=False`` runs the same requests with private contexts. ``seed`` seeds the K/V
    values (and the ``"mixed"`` trace). ``check_invariants`` validates the cache after each step.
    """
    check_positive_int("seed", seed, minimum=0)
    if isinstance(trace, str):
        trace = build_trace(trace, seed)
    elif not isinstance(trace, WorkloadTrace):
        raise TypeError(f"trace must be a trace name or WorkloadTrace, got {type(trace).__name__}")
    if isinstance(policies, str) or not isinstance(policies, Sequence) or not policies:
        raise TypeError(f"policies must be a non-empty sequence of names, got {policies!r}")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {p!r}")
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies must not repeat a name, got {policies!r}")
    if not isinstance(prefix_sharing, bool):
        raise TypeError(f"prefix_sharing must be a bool, got {type(prefix_sharing).__name__}")
    check_positive_int("deadlock_patience", deadlock_patience, minimum=1)
    check_positive_int("max_steps", max_steps, minimum=1)
    config = trace.config
    if aging_threshold is not _DEFAULT:
        config = replace(config, aging_threshold=aging_threshold)  # validated by the config
    if not prefix_sharing:
        trace = without_prefix_sharing(trace)
    runs = tuple(
        _run_policy(trace, policy, seed, config, deadlock_patience, max_steps, check_invariants)
        for policy in policies
    )
    return SchedulerWorkloadResult(
        trace=trace.name,
        seed=seed,
        aging_threshold=config.aging_threshold,
        prefix_sharing=prefix_sharing,
        num_blocks=trace.num_blocks,
        block_size=trace.block_size,
        config=config,
        runs=runs,
    )
