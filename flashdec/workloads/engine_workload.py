"""Engine workloads: requests arrive, the lifetime scheduler admits them, the engine decodes.

Both run through the :class:`~flashdec.engine.ServingLoop` with an executor that feeds random
Q/K/V. ``run_synthetic_workload`` drives a single-layer engine with ``engine.step``;
``run_integrated_workload`` adds what a real deployment mixes in: multi-layer token
transactions, shared-prefix hits and misses, and injected failures whose rollback is verified
before the step is retried. With ``kv_spec`` either runs on a cache of KV layer groups (each
layer's Q/K/V in its group's geometry) and reports every group's blocks. Both end with full
cleanup — also when ``max_steps`` stops them early, which cancels and reports the unfinished
requests — and are deterministic under their seed (timings aside).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from flashdec.cache import PagedKVCache
from flashdec.engine import DecodeEngine
from flashdec.engine.loop import LoopStep, ServingLoop, StepExecutor, run_loop
from flashdec.scheduler import BlockAwareScheduler, RequestSpec, SchedulerConfig
from flashdec.workloads.config import IntegratedWorkloadConfig, SyntheticWorkloadConfig
from flashdec.workloads.stats import LatencyStats, jain_index, ratio, safe_rate


@dataclass(frozen=True)
class StepRecord:
    """One step of a workload's trajectory."""

    step: int
    waiting: int
    active: int
    batch: int
    free_blocks: int
    used_blocks: int
    latency_ms: float  # complete decode step (0 when nothing was decoded)


@dataclass(frozen=True)
class WorkloadResult:
    """What a synthetic run measured. Latency is the complete decode step: begin, every
    layer's RoPE + append + decode, commit, device sync."""

    config: SyntheticWorkloadConfig
    device: str
    dtype: str
    append_backend: str
    decode_backend: str
    num_requests: int
    finished: int
    rejected: int
    completion_rate: float
    steps: int
    decode_steps: int
    tokens_decoded: int
    prompt_tokens_imported: int
    elapsed_s: float  # sum of complete-step times
    tokens_per_s: float
    step_latency: LatencyStats
    schedule_latency: LatencyStats  # snapshot + plan + apply
    max_service_wait_steps: int
    max_waiting_steps: int
    jain_service_rate: float
    peak_used_blocks: int
    peak_kv_bytes: int
    bytes_per_block: int
    final_used_blocks: int
    invariants_checked: int
    trajectory: tuple[StepRecord, ...]
    stopped_early: bool  # max_steps ended the run with requests left (they were cancelled)
    unfinished: int  # requests cancelled by that clean-up, or never submitted
    # per KV layer group (one entry without kv_spec): geometry, window, pool, peak blocks used
    groups: tuple[dict, ...] = ()


@dataclass(frozen=True)
class IntegratedWorkloadResult(WorkloadResult):
    """The synthetic measurements plus prefix sharing and fault-injection outcomes."""

    prefix_hits: int = 0
    prefix_misses: int = 0
    context_blocks_private: int = 0  # context blocks allocated for prefix misses
    context_blocks_shared: int = 0  # prefix blocks registered (counted once)
    context_blocks_without_sharing: int = 0  # what every admitted context would need alone
    prefix_savings_blocks: int = 0
    prefix_savings_bytes: int = 0
    injected_failures: int = 0
    verified_rollbacks: int = 0


def _build_requests(config, rng: random.Random, prefix_ids, prefix_tokens):
    """Specs and arrival steps: exponential gaps, prefix hits with ``prefix_hit_rate``."""
    hit_rate = getattr(config, "prefix_hit_rate", 0.0)
    specs, arrivals, clock = [], [], 0.0
    for i in range(config.num_requests):
        clock += rng.expovariate(config.arrivals_per_step)
        arrivals.append(int(clock))
        new_tokens = rng.randint(config.min_new_tokens, config.max_new_tokens)
        if prefix_ids and rng.random() < hit_rate:
            pid = rng.choice(prefix_ids)
            specs.append(RequestSpec(f"r{i}", prefix_tokens, new_tokens, i, prefix_id=pid))
        else:
            context = rng.randint(config.min_context, config.max_context)
            specs.append(RequestSpec(f"r{i}", context, new_tokens, i))
    return specs, arrivals


class RandomKVExecutor(StepExecutor):
    """The loop's executor for synthetic workloads: seeded random Q/K/V for every layer.

    Prompts are imported in one transaction per step; decode steps are timed end to end (begin,
    every layer, commit, device sync). With ``failure_rate`` a step is first attempted with a
    malformed K at a random layer, and the automatic abort is verified to have left the cache as
    it was, before the real step runs.
    """

    def __init__(self, engine: DecodeEngine, config, num_layers: int, device, dtype) -> None:
        self.engine = engine
        self.config = config
        self.num_layers = num_layers
        self.device = device
        self.dtype = dtype
        # each layer's (KV heads, head_dim, dtype): its group's
        cache = engine.cache
        self.layer_shapes = [
            (spec.num_kv_heads, spec.head_dim, spec.dtype)
            for spec in (cache.kv_groups[cache.layout.layer_group(i)] for i in range(num_layers))
        ]
        self.rng = random.Random(config.seed)
        self.gen = torch.Generator(device=device).manual_seed(config.seed)
        self.failure_rate = getattr(config, "failure_rate", 0.0)
        self.single_layer_api = not isinstance(config, IntegratedWorkloadConfig)
        self.latencies: list[float] = []
        self.prompt_tokens = 0
        self.failures = 0
        self.rollbacks = 0

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = torch.randn(*shape, generator=self.gen, device=self.device)
        return out.to(self.dtype if dtype is None else dtype)

    def prefill(self, requests: Sequence[tuple[object, int]]) -> None:
        engine = self.engine
        total = sum(n for _, n in requests)
        tx = engine.begin_prefill([rid for rid, _ in requests], [n for _, n in requests])
        for layer, (hkv, dim, dtype) in enumerate(self.layer_shapes):
            kv = self.randn(2, total, hkv, dim, dtype=dtype)
            engine.prefill_layer(tx, layer, kv[0], kv[1])
        engine.commit_step(tx)
        self.prompt_tokens += total

    def decode(self, batch: Sequence) -> tuple:
        c, engine = self.config, self.engine
        inputs = [
            (
                self.randn(len(batch), c.num_q_heads, dim, dtype=dtype),
                self.randn(len(batch), hkv, dim, dtype=dtype),
                self.randn(len(batch), hkv, dim, dtype=dtype),
            )
            for hkv, dim, dtype in self.layer_shapes
        ]
        if self.failure_rate and self.rng.random() < self.failure_rate:
            self.failures += 1
            self._failed_attempt(list(batch), inputs)
            self.rollbacks += 1
        self._sync()
        start = time.perf_counter()
        if self.single_layer_api and self.num_layers == 1:
            engine.step(list(batch), *inputs[0])
        else:
            tx = engine.begin_step(list(batch))
            for layer, (q, k, v) in enumerate(inputs):
                engine.step_layer(tx, layer, q, k, v)
            engine.commit_step(tx)
        self._sync()
        self.latencies.append(time.perf_counter() - start)
        return ()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _failed_attempt(self, batch: list, inputs) -> None:
        """Run the step with a broken input at a random layer and prove it rolled back."""
        cache = self.engine.cache
        groups = range(cache.layout.num_groups)
        lens_before = [cache.seq_len(rid) for rid in batch]
        blocks_before = [[cache.request_block_ids(rid, group=g) for g in groups] for rid in batch]
        free_before = cache.num_free_blocks
        fail_layer = self.rng.randrange(self.num_layers)
        tx = self.engine.begin_step(batch)
        try:
            for layer, (q, k, v) in enumerate(inputs):
                if layer == fail_layer:
                    k = k[:, :, :-1]  # a malformed K: the write must refuse it
                self.engine.step_layer(tx, layer, q, k, v)
        except ValueError:
            pass
        else:
            raise AssertionError("the injected failure did not fail")
        if (
            self.engine.has_open_step
            or [cache.seq_len(rid) for rid in batch] != lens_before
            or [[cache.request_block_ids(rid, group=g) for g in groups] for rid in batch]
            != blocks_before
            or cache.num_free_blocks != free_before
        ):
            raise AssertionError("an automatic abort left the cache changed")
        cache.validate_invariants()


class _EngineRun:
    """One workload run: cache, engine, prefixes, the trace, the loop and its executor."""

    def __init__(self, config: SyntheticWorkloadConfig, num_layers: int) -> None:
        self.config = config
        place = config.placement()
        self.device, self.dtype = place.device, place.dtype
        append_backend, decode_backend = place.append_backend, place.decode_backend
        self.num_layers = num_layers
        integrated = isinstance(config, IntegratedWorkloadConfig)
        uses_prefixes = integrated and config.prefix_hit_rate > 0
        num_prefixes = config.num_prefixes if uses_prefixes else 0
        prefix_blocks = config.prefix_blocks if integrated else 0
        if config.kv_spec:
            cache = PagedKVCache(
                kv_spec=config.kv_spec,
                device=self.device,
                prefix_cache_capacity_blocks=num_prefixes * prefix_blocks,
            )
        else:
            cache = PagedKVCache(
                num_layers=num_layers,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                block_size=config.block_size,
                max_blocks=config.num_blocks,
                dtype=self.dtype,
                device=self.device,
                prefix_cache_capacity_blocks=num_prefixes * prefix_blocks,
            )
        self.engine = DecodeEngine(
            cache, append_backend=append_backend, decode_backend=decode_backend
        )
        self.executor = RandomKVExecutor(self.engine, config, num_layers, self.device, self.dtype)
        scheduler = BlockAwareScheduler(
            SchedulerConfig(
                max_active_requests=config.max_active_requests,
                max_batch_size=config.max_batch_size,
                reserve_blocks=config.reserve_blocks,
                aging_threshold=config.aging_threshold,
            )
        )
        self.prefix_ids = [f"prefix{i}" for i in range(num_prefixes)]
        shape = (num_layers, prefix_blocks, config.num_kv_heads, config.block_size, config.head_dim)
        for pid in self.prefix_ids:
            self.engine.register_prefix(
                pid, self.executor.randn(*shape), self.executor.randn(*shape)
            )
        rng = random.Random(config.seed)
        self.specs, self.arrivals = _build_requests(
            config, rng, self.prefix_ids, prefix_blocks * config.block_size
        )
        self.loop = ServingLoop(
            self.engine, scheduler, self.executor, check_invariants=config.check_invariants
        )

    def run(self, progress: Callable[[int, int], None] | None = None) -> dict:
        config, engine, cache = self.config, self.engine, self.engine.cache
        arrival = {s.request_id: a for s, a in zip(self.specs, self.arrivals, strict=True)}
        admitted_at: dict = {}
        left_at: dict = {}
        decoded: Counter = Counter()  # tokens per request (the loop keeps only live ones)
        trajectory: list[StepRecord] = []
        done = 0
        peak_used = max_service_wait = peak_bytes = 0
        latencies = self.executor.latencies
        specs = cache.kv_groups
        group_peaks = [0] * len(specs)

        def on_step(record: LoopStep) -> None:
            nonlocal done, peak_used, max_service_wait, peak_bytes
            for rid in record.admitted:
                admitted_at[rid] = record.step
            for rid in (*record.rejected, *record.finished):
                left_at[rid] = record.step
            decoded.update(record.served)
            done += len(record.rejected) + len(record.finished)
            used = cache.max_blocks - record.free_blocks
            peak_used = max(peak_used, used)
            used_bytes = 0
            for g, spec in enumerate(specs):  # groups' blocks differ in size
                in_use = spec.num_blocks - cache.layout.group_free_blocks(g)
                group_peaks[g] = max(group_peaks[g], in_use)
                used_bytes += in_use * spec.block_bytes
            peak_bytes = max(peak_bytes, used_bytes)
            max_service_wait = max(max_service_wait, record.max_service_wait)
            trajectory.append(
                StepRecord(
                    step=record.step,
                    waiting=record.waiting,
                    active=record.active,
                    batch=len(record.served),
                    free_blocks=record.free_blocks,
                    used_blocks=used,
                    latency_ms=latencies[-1] * 1e3 if record.served else 0.0,
                )
            )
            if progress is not None:
                progress(done, len(self.specs))

        outcome = run_loop(
            self.loop,
            zip(self.arrivals, self.specs, strict=True),
            max_steps=config.max_steps,
            on_step=on_step,
        )
        # cleanup: every request terminal (run_loop cancelled the rest), every prefix evicted
        for pid in self.prefix_ids:
            engine.evict_prefix(pid)
        cache.validate_invariants()
        steps = outcome.num_steps
        states = {s.request_id: self._final_state(s.request_id) for s in self.specs}
        finished = sum(state == "finished" for state in states.values())
        rates = [
            decoded[rid] / (left_at.get(rid, steps) - arrival[rid] + 1)
            for rid in states
            if states[rid] not in ("rejected", "not submitted")
        ]
        waits = [admitted_at[rid] - arrival[rid] for rid in admitted_at]
        elapsed = sum(latencies)
        tokens = sum(decoded.values())
        return dict(
            config=config,
            device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""),
            append_backend=engine.append_backend,
            decode_backend=engine.decode_backend,
            num_requests=len(self.specs),
            finished=finished,
            rejected=sum(state == "rejected" for state in states.values()),
            completion_rate=ratio(finished, len(self.specs)),
            steps=steps,
            decode_steps=len(latencies),
            tokens_decoded=tokens,
            prompt_tokens_imported=self.executor.prompt_tokens,
            elapsed_s=elapsed,
            tokens_per_s=safe_rate(tokens, elapsed),
            step_latency=LatencyStats.from_seconds(latencies),
            schedule_latency=LatencyStats.from_seconds([r.schedule_s for r in outcome.steps]),
            max_service_wait_steps=max_service_wait,
            max_waiting_steps=max(waits, default=0),
            jain_service_rate=jain_index(rates),
            peak_used_blocks=peak_used,
            peak_kv_bytes=peak_bytes,
            # one group: K and V bytes of a block over all layers; several: group 0's
            bytes_per_block=specs[0].block_bytes,
            final_used_blocks=cache.max_blocks - cache.num_free_blocks,
            invariants_checked=len(outcome.steps) if config.check_invariants else 0,
            trajectory=tuple(trajectory),
            stopped_early=outcome.stopped_early,
            unfinished=len(outcome.unfinished),
            groups=tuple(
                {
                    "group": g,
                    "layers": list(cache.layout.group_layers(g)),
                    "num_kv_heads": spec.num_kv_heads,
                    "head_dim": spec.head_dim,
                    "block_size": spec.block_size,
                    "window": spec.window,
                    "num_blocks": spec.num_blocks,
                    "peak_used_blocks": group_peaks[g],
                    "block_bound_per_request": cache.metrics()["groups"][g][
                        "block_bound_per_request"
                    ],
                }
                for g, spec in enumerate(specs)
            ),
            _extra=dict(admitted=list(admitted_at)),
        )

    def _final_state(self, request_id) -> str:
        try:
            return self.engine.request_state(request_id).value
        except ValueError:
            return "not submitted"  # it had not arrived when max_steps stopped the run


def run_synthetic_workload(
    config: SyntheticWorkloadConfig | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    **overrides,
) -> WorkloadResult:
    """Single-layer dynamic engine workload (``engine.step``).

    See :class:`SyntheticWorkloadConfig` for the knobs; keyword overrides replace its fields.
    """
    config = replace(config or SyntheticWorkloadConfig(), **overrides)
    if isinstance(config, IntegratedWorkloadConfig):
        raise TypeError("run_synthetic_workload takes a SyntheticWorkloadConfig")
    if config.warmup_run:
        _EngineRun(config, num_layers=config.layers).run(None)
    values = _EngineRun(config, num_layers=config.layers).run(progress)
    values.pop("_extra")
    return WorkloadResult(**values)


def run_integrated_workload(
    config: IntegratedWorkloadConfig | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    **overrides,
) -> IntegratedWorkloadResult:
    """Dynamic arrival, prefix hits and misses, multi-layer transactions, injected rollbacks and
    full cleanup; see :class:`IntegratedWorkloadConfig`."""
    config = replace(config or IntegratedWorkloadConfig(), **overrides)
    if config.warmup_run:
        _EngineRun(config, num_layers=config.layers).run(None)
    run = _EngineRun(config, num_layers=config.layers)
    values = run.run(progress)
    extra = values.pop("_extra")
    bs = config.block_size
    admitted = [s for s in run.specs if s.request_id in set(extra["admitted"])]
    hits = [s for s in admitted if s.prefix_id is not None]
    misses = [s for s in admitted if s.prefix_id is None]
    private = sum(-(-s.initial_context_tokens // bs) for s in misses)
    shared = len(run.prefix_ids) * config.prefix_blocks if hits else 0
    without = sum(-(-s.initial_context_tokens // bs) for s in admitted)
    savings = without - private - shared
    return IntegratedWorkloadResult(
        **values,
        prefix_hits=len(hits),
        prefix_misses=len(misses),
        context_blocks_private=private,
        context_blocks_shared=shared,
        context_blocks_without_sharing=without,
        prefix_savings_blocks=savings,
        prefix_savings_bytes=savings * values["bytes_per_block"],
        injected_failures=run.executor.failures,
        verified_rollbacks=run.executor.rollbacks,
    )
