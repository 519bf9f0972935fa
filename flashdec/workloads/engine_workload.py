"""Engine workloads: requests arrive, the lifetime scheduler admits them, the engine decodes.

``run_synthetic_workload`` drives a single-layer engine with ``engine.step``;
``run_integrated_workload`` adds what a real deployment mixes in: multi-layer token
transactions, shared-prefix hits and misses, and injected failures whose rollback is verified
before the step is retried. Both end with full cleanup (no block in use, invariants clean) and are
deterministic under their seed (timings aside).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flashdec.cache import PagedKVCache
from flashdec.engine import DecodeEngine, EngineRequestState
from flashdec.scheduler import (
    BlockAwareScheduler,
    FairnessCounters,
    RequestSpec,
    SchedulerConfig,
    advance_fairness_counters,
)
from flashdec.workloads.config import DTYPES, IntegratedWorkloadConfig, SyntheticWorkloadConfig
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


def _resolve(config: SyntheticWorkloadConfig) -> tuple[torch.device, torch.dtype, str, str]:
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu")
        if config.device == "auto"
        else config.device
    )
    on_gpu = device.type == "cuda"
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    append = config.append_backend
    if append == "auto":
        append = "fused" if on_gpu else "torch"
    decode = config.decode_backend
    if decode == "auto":
        decode = "triton" if on_gpu else "torch"
    return device, DTYPES[dtype_name], append, decode


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


class _EngineRun:
    """State of one workload run (engine, scheduler, counters, measurements)."""

    def __init__(self, config: SyntheticWorkloadConfig, num_layers: int) -> None:
        self.config = config
        self.device, self.dtype, self.append_backend, self.decode_backend = _resolve(config)
        self.num_layers = num_layers
        self.rng = random.Random(config.seed)
        self.gen = torch.Generator(device=self.device).manual_seed(config.seed)
        num_prefixes = getattr(config, "num_prefixes", 0) if self._uses_prefixes else 0
        prefix_blocks = getattr(config, "prefix_blocks", 0)
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
            cache, append_backend=self.append_backend, decode_backend=self.decode_backend
        )
        self.scheduler = BlockAwareScheduler(
            SchedulerConfig(
                max_active_requests=config.max_active_requests,
                max_batch_size=config.max_batch_size,
                reserve_blocks=config.reserve_blocks,
                aging_threshold=config.aging_threshold,
            )
        )
        self.prefix_ids = [f"prefix{i}" for i in range(num_prefixes)]
        for pid in self.prefix_ids:
            shape = (
                num_layers,
                prefix_blocks,
                config.num_kv_heads,
                config.block_size,
                config.head_dim,
            )
            self.engine.register_prefix(pid, self._randn(*shape), self._randn(*shape))
        self.specs, self.arrivals = _build_requests(
            config, self.rng, self.prefix_ids, prefix_blocks * config.block_size
        )
        self.bytes_per_block = (
            (2 * num_layers * config.num_kv_heads * config.block_size * config.head_dim)
            * torch.finfo(self.dtype).bits
            // 8
        )

    @property
    def _uses_prefixes(self) -> bool:
        return isinstance(self.config, IntegratedWorkloadConfig) and self.config.prefix_hit_rate > 0

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device).to(self.dtype)

    def _layer_inputs(self, batch: int):
        c = self.config
        return [
            (
                self._randn(batch, c.num_q_heads, c.head_dim),
                self._randn(batch, c.num_kv_heads, c.head_dim),
                self._randn(batch, c.num_kv_heads, c.head_dim),
            )
            for _ in range(self.num_layers)
        ]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _import_context(self, rid) -> int:
        """Prompt tokens of a prefix miss, imported one all-layer transaction at a time."""
        spec = self.engine.request_spec(rid)
        if spec.prefix_id is not None:
            return 0
        c = self.config
        for _ in range(spec.initial_context_tokens):
            shape = (self.num_layers, c.num_kv_heads, c.head_dim)
            self.engine.prefill_request_layers(rid, self._randn(*shape), self._randn(*shape))
        return spec.initial_context_tokens

    def _decode_step(self, batch: list, inputs) -> float:
        """One complete timed step; returns seconds."""
        engine = self.engine
        self._sync()
        start = time.perf_counter()
        if self.num_layers == 1 and not isinstance(self.config, IntegratedWorkloadConfig):
            engine.step(batch, *inputs[0])
        else:
            tx = engine.begin_step(batch)
            for layer, (q, k, v) in enumerate(inputs):
                engine.step_layer(tx, layer, q, k, v)
            engine.commit_step(tx)
        self._sync()
        return time.perf_counter() - start

    def _failed_attempt(self, batch: list, inputs) -> None:
        """Run the step with a broken input at a random layer and prove it rolled back."""
        cache = self.engine.cache
        lens_before = [cache.seq_len(rid) for rid in batch]
        blocks_before = [cache.request_block_ids(rid) for rid in batch]
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
            or [cache.request_block_ids(rid) for rid in batch] != blocks_before
            or cache.num_free_blocks != free_before
        ):
            raise AssertionError("an automatic abort left the cache changed")
        cache.validate_invariants()

    def run(self, progress: Callable[[int, int], None] | None = None) -> dict:
        engine, config = self.engine, self.config
        cache = engine.cache
        pending = list(zip(self.arrivals, self.specs, strict=True))
        counters = FairnessCounters()
        generated = dict.fromkeys((s.request_id for s in self.specs), 0)
        arrived_at, admitted_at, first_served, left_at = {}, {}, {}, {}
        latencies, schedule_times, trajectory = [], [], []
        tokens = prompt_tokens = failures = rollbacks = invariants = 0
        peak_used = max_service_wait = 0
        failure_rate = getattr(config, "failure_rate", 0.0)
        step = 0
        done_states = (EngineRequestState.FINISHED, EngineRequestState.REJECTED)
        while step < config.max_steps:
            while pending and pending[0][0] <= step:
                _, spec = pending.pop(0)
                engine.submit_request(spec)
                arrived_at[spec.request_id] = step
            t0 = time.perf_counter()
            snapshot = engine.scheduling_snapshot(step, **counters.as_kwargs())
            decision = self.scheduler.plan(snapshot)
            engine.apply_scheduler_decision(decision, scheduler=self.scheduler, snapshot=snapshot)
            schedule_times.append(time.perf_counter() - t0)
            max_service_wait = max(
                [max_service_wait, *(r.service_wait_steps for r in snapshot.active)]
            )
            for rid in decision.admit:
                admitted_at[rid] = step
                prompt_tokens += self._import_context(rid)
            for rid in decision.reject:
                left_at[rid] = step
            batch = list(decision.batch)
            departed = []
            latency = 0.0
            if batch:
                inputs = self._layer_inputs(len(batch))
                if failure_rate and self.rng.random() < failure_rate:
                    failures += 1
                    self._failed_attempt(batch, inputs)
                    rollbacks += 1
                latency = self._decode_step(batch, inputs)
                latencies.append(latency)
                tokens += len(batch)
                for rid in batch:
                    first_served.setdefault(rid, step)
                    generated[rid] += 1
                    if generated[rid] == engine.request_spec(rid).max_new_tokens:
                        engine.finish_request(rid)
                        departed.append(rid)
                        left_at[rid] = step
            counters = advance_fairness_counters(
                snapshot, decision, served_ids=batch, departed_ids=departed
            )
            if config.check_invariants:
                cache.validate_invariants()
                invariants += 1
            used = cache.max_blocks - cache.num_free_blocks
            peak_used = max(peak_used, used)
            trajectory.append(
                StepRecord(
                    step=step,
                    waiting=len(engine.request_ids(EngineRequestState.WAITING)),
                    active=len(engine.request_ids(EngineRequestState.ACTIVE)),
                    batch=len(batch),
                    free_blocks=cache.num_free_blocks,
                    used_blocks=used,
                    latency_ms=latency * 1e3,
                )
            )
            step += 1
            terminal = sum(engine.request_state(rid) in done_states for rid in arrived_at)
            if progress is not None:
                progress(terminal, len(self.specs))
            if not pending and terminal == len(self.specs):
                break
        # cleanup: every request terminal, every prefix evicted, nothing left in use
        for pid in self.prefix_ids:
            engine.evict_prefix(pid)
        cache.validate_invariants()
        states = [engine.request_state(s.request_id) for s in self.specs]
        finished = states.count(EngineRequestState.FINISHED)
        rates = [
            generated[s.request_id]
            / (left_at.get(s.request_id, step) - arrived_at[s.request_id] + 1)
            for s in self.specs
            if s.request_id in arrived_at
            and engine.request_state(s.request_id) is not EngineRequestState.REJECTED
        ]
        waits = [
            admitted_at.get(rid, step) - t for rid, t in arrived_at.items() if rid in admitted_at
        ]
        elapsed = sum(latencies)
        return dict(
            config=config,
            device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""),
            append_backend=self.append_backend,
            decode_backend=self.decode_backend,
            num_requests=len(self.specs),
            finished=finished,
            rejected=states.count(EngineRequestState.REJECTED),
            completion_rate=ratio(finished, len(self.specs)),
            steps=step,
            decode_steps=len(latencies),
            tokens_decoded=tokens,
            prompt_tokens_imported=prompt_tokens,
            elapsed_s=elapsed,
            tokens_per_s=safe_rate(tokens, elapsed),
            step_latency=LatencyStats.from_seconds(latencies),
            schedule_latency=LatencyStats.from_seconds(schedule_times),
            max_service_wait_steps=max_service_wait,
            max_waiting_steps=max(waits, default=0),
            jain_service_rate=jain_index(rates),
            peak_used_blocks=peak_used,
            peak_kv_bytes=peak_used * self.bytes_per_block,
            bytes_per_block=self.bytes_per_block,
            final_used_blocks=cache.max_blocks - cache.num_free_blocks,
            invariants_checked=invariants,
            trajectory=tuple(trajectory),
            _extra=dict(
                failures=failures,
                rollbacks=rollbacks,
                admitted=[rid for rid in admitted_at],
            ),
        )


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
        _EngineRun(config, num_layers=1).run(None)
    values = _EngineRun(config, num_layers=1).run(progress)
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
        _EngineRun(config, num_layers=config.num_layers).run(None)
    run = _EngineRun(config, num_layers=config.num_layers)
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
        prefix_savings_bytes=savings * run.bytes_per_block,
        injected_failures=extra["failures"],
        verified_rollbacks=extra["rollbacks"],
    )
