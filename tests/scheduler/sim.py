"""Property tests' traces through the real serving loop, with a tiny CPU cache.

The same :class:`~flashdec.engine.ServingLoop` every workload uses drives a one-layer, one-head,
fp32 cache with the torch backends (K/V values do not matter to scheduling). This records what
the property tests check — boundary stalls, admissions, finishes, rejections, skip counts and
when a request aged — and asserts nothing itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdec.cache import PagedKVCache
from flashdec.engine import DecodeEngine
from flashdec.engine.loop import ServingLoop, StepExecutor, run_loop
from flashdec.scheduler import PrefixInfo, RequestSpec, SchedulerConfig, make_scheduler

HEAD_DIM = 2


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


class _ZeroKV(StepExecutor):
    """K/V content is irrelevant here: zeros, one layer, one head."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def prefill(self, requests) -> None:
        total = sum(n for _, n in requests)
        tx = self.engine.begin_prefill([rid for rid, _ in requests], [n for _, n in requests])
        kv = torch.zeros(total, 1, HEAD_DIM)
        self.engine.prefill_layer(tx, 0, kv, kv)
        self.engine.commit_step(tx)

    def decode(self, batch) -> tuple:
        qkv = torch.zeros(len(batch), 1, HEAD_DIM)
        self.engine.step(list(batch), qkv, qkv, qkv)
        return ()


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
    max_step_tokens: int | None = None,
) -> SimResult:
    prefix_blocks = sum(p.num_blocks for p in prefixes)
    cache = PagedKVCache(
        1,
        1,
        HEAD_DIM,
        block_size,
        num_blocks,
        dtype=torch.float32,
        device="cpu",
        prefix_cache_capacity_blocks=prefix_blocks,
    )
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    for p in prefixes:
        blocks = torch.zeros(1, p.num_blocks, 1, block_size, HEAD_DIM)
        engine.register_prefix(p.prefix_id, blocks, blocks)
    out = SimResult()

    def observe(snap, decision) -> None:
        if keep_history:
            out.snapshots.append(snap)
            out.decisions.append(decision)
        threshold = config.aging_threshold
        for w in snap.waiting:
            out.max_skip = max(out.max_skip, w.skip_count)
            if (
                threshold is not None
                and w.skip_count >= threshold
                and w.request_id not in (out.aged_at)
            ):
                out.aged_at[w.request_id] = snap.step
                ahead = [
                    x for x in snap.waiting if x.spec.submission_order < w.spec.submission_order
                ]
                out.aged_context[w.request_id] = len(snap.active) + len(ahead)

    loop = ServingLoop(
        engine,
        make_scheduler(policy, config),
        _ZeroKV(engine),
        on_plan=observe,
        max_step_tokens=max_step_tokens,  # a budget: prompts arrive in chunks over steps
    )
    run = run_loop(loop, zip(arrivals, specs, strict=True), max_steps=max_steps)
    for record in run.steps:
        out.stalls += len(record.stuck)
        for rid in record.admitted:
            out.admitted_at[rid] = record.step
        for rid in record.finished:
            out.finished_at[rid] = record.step
        out.rejected.update(record.rejected)
    out.steps = run.num_steps
    return out
