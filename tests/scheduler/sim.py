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
    hit_admissions: int = 0  # admitted with blocks shared with active requests (caching on)
    prefix_cache_stats: dict = field(default_factory=dict)


class _ZeroKV(StepExecutor):
    """K/V content is irrelevant here: zeros, one layer, one head."""

    def __init__(self, engine: DecodeEngine, cache_prompts: bool = False) -> None:
        self.engine = engine
        self.cache_prompts = cache_prompts  # index imported prompt blocks, as flashdec.LLM does

    def prefill(self, requests) -> None:
        total = sum(n for _, n in requests)
        tx = self.engine.begin_prefill([rid for rid, _ in requests], [n for _, n in requests])
        kv = torch.zeros(total, 1, HEAD_DIM)
        self.engine.prefill_layer(tx, 0, kv, kv)
        self.engine.commit_step(tx)
        if self.cache_prompts:
            for rid, _ in requests:
                self.engine.cache.prefix_cache.cache_request_blocks(rid)

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
    prompts: dict | None = None,
) -> SimResult:
    """``prompts`` (request id -> prompt token ids): automatic prefix caching on, each request
    looked up by its prompt's block hashes; the cache's invariants are checked at every plan."""
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
        enable_prefix_caching=prompts is not None,
    )
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    if prompts is not None:
        for rid, ids in prompts.items():  # read at admission; forgotten when it ends
            engine.submissions.block_hashes[rid] = cache.prefix_cache.block_hashes(ids)
    for p in prefixes:
        blocks = torch.zeros(1, p.num_blocks, 1, block_size, HEAD_DIM)
        engine.register_prefix(p.prefix_id, blocks, blocks)
    out = SimResult()

    def observe(snap, decision) -> None:
        if prompts is not None:
            cache.validate_invariants()
            out.hit_admissions += sum(1 for rid, _ in snap.shared_hits if rid in decision.admit)
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
        _ZeroKV(engine, cache_prompts=prompts is not None),
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
    if prompts is not None:
        cache.validate_invariants()
        out.prefix_cache_stats = cache.prefix_cache.stats()
    return out
