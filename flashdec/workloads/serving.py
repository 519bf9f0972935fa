"""``flashdec bench-serve``: requests arrive as a Poisson process and are served through the loop.

Each request is submitted to :class:`flashdec.LLM` when its (wall-clock) arrival time has come,
and the loop steps whenever anything waits or runs — new requests join the running batch as
others finish (continuous batching). Per request: TTFT = first token − arrival, TPOT = the mean
time between its later tokens. Timestamps are taken when a step's tokens reach the host.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from flashdec.runtime import KernelBuilds, triton_mode
from flashdec.workloads.generation import transformers_greedy
from flashdec.workloads.model_config import ServeConfig
from flashdec.workloads.stats import HostTierStats, LatencyStats, SpeculationStats


@dataclass(frozen=True)
class ServeBenchResult:
    config: ServeConfig
    ttft: LatencyStats
    tpot: LatencyStats
    elapsed_s: float
    output_tokens: int
    steps: int
    max_batch: int  # largest batch one step decoded
    # with ``config.compare``: requests whose tokens equal transformers' greedy ones (else None)
    matches_transformers: int | None = None
    speculation: SpeculationStats | None = None  # with speculative decoding on
    # wall time of the loop's steps: decode-only ones, and those with prompt chunks (mixed)
    decode_step: LatencyStats | None = None
    mixed_step: LatencyStats | None = None
    kernel_builds: int = 0  # Triton kernels built during the pass (each one stalls a step)
    kernel_build_names: tuple[tuple[str, int], ...] = ()  # (kernel, builds) of those
    kernel_build_signatures: tuple[str, ...] = ()  # Triton's description of the first few
    host_tier: HostTierStats | None = None  # with the prefix cache's host tier on
    swaps: int = 0  # running requests swapped out (preemption by swap, with the host tier)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        rows = [
            ("requests", f"{self.config.num_requests} at {self.config.request_rate}/s (Poisson)"),
            ("TTFT p50 / p90 / p99", _p50_p90_p99(self.ttft, 1)),
            ("TPOT p50 / p90 / p99", _p50_p90_p99(self.tpot, 2)),
            ("output tokens/s", f"{self.output_tok_s:,.0f}"),
            ("steps, largest batch", f"{self.steps}, {self.max_batch}"),
        ]
        for label, stats in (("decode", self.decode_step), ("mixed", self.mixed_step)):
            if stats is not None and stats.count:
                rows.append(
                    (
                        f"{label} steps: count, p50 / p99 / max",
                        f"{stats.count}, {stats.p50_ms:.1f} / {stats.p99_ms:.1f} / "
                        f"{stats.max_ms:.1f} ms",
                    )
                )
        builds = kernel_builds_text(self.kernel_builds, dict(self.kernel_build_names))
        rows.append(("Triton kernels built during the run", builds))
        if self.speculation is not None:
            rows += self.speculation.rows()
        if self.host_tier is not None:
            rows += self.host_tier.rows()
            rows.append(("requests swapped out (preemption)", f"{self.swaps:,}"))
        if self.matches_transformers is not None:
            rows.append(
                (
                    "agreement with transformers",
                    f"{self.matches_transformers}/{self.config.num_requests} requests identical",
                )
            )
        return rows

    def as_dict(self) -> dict:
        return {
            "ttft_p50_ms": self.ttft.p50_ms,
            "ttft_p90_ms": self.ttft.p90_ms,
            "ttft_p99_ms": self.ttft.p99_ms,
            "tpot_p50_ms": self.tpot.p50_ms,
            "tpot_p90_ms": self.tpot.p90_ms,
            "tpot_p99_ms": self.tpot.p99_ms,
            "elapsed_s": self.elapsed_s,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tok_s,
            "steps": self.steps,
            "max_batch": self.max_batch,
            "matches_transformers": self.matches_transformers,
            "speculation": None if self.speculation is None else asdict(self.speculation),
            "host_tier": None if self.host_tier is None else asdict(self.host_tier),
            "swaps": self.swaps,
            "decode_step": None if self.decode_step is None else self.decode_step.as_dict(),
            "mixed_step": None if self.mixed_step is None else self.mixed_step.as_dict(),
            "kernel_builds": self.kernel_builds,
            "kernel_build_names": dict(self.kernel_build_names),
            "kernel_build_signatures": list(self.kernel_build_signatures),
        }


def kernel_builds_text(count: int, names: dict[str, int]) -> str:
    """``"2 (_extend_kernel x2)"``: how many kernels a pass built, then which."""
    listed = ", ".join(f"{name} x{n}" for name, n in names.items())
    return f"{count} ({listed})" if listed else str(count)


def _p50_p90_p99(stats: LatencyStats, digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in (stats.p50_ms, stats.p90_ms, stats.p99_ms)) + " ms"


def poisson_trace(
    *,
    seed: int,
    num_requests: int,
    request_rate: float,
    min_prompt_len: int,
    max_prompt_len: int,
    vocab_size: int,
) -> list[tuple[float, list[int]]]:
    """Poisson arrivals: (seconds after the start, prompt token ids) per request.

    ``random.Random(seed)``: exponential gaps at ``request_rate``, prompt lengths uniform in
    ``[min_prompt_len, max_prompt_len]``, ids uniform below ``vocab_size`` — drawn in that order
    per request, so the review's ``serve_trace.py`` (same seed and knobs) replays the same trace.
    """
    rng = random.Random(seed)
    clock, arrivals = 0.0, []
    for _ in range(num_requests):
        clock += rng.expovariate(request_rate)
        length = rng.randint(min_prompt_len, max_prompt_len)
        arrivals.append((clock, [rng.randrange(vocab_size) for _ in range(length)]))
    return arrivals


def run_serve_benchmark(
    llm, config: ServeConfig, progress: Callable[[int, int], None] | None = None
) -> ServeBenchResult:
    """Serve ``config.num_requests`` Poisson arrivals with ``llm`` (a :class:`flashdec.LLM`);
    ``progress(done, total)`` after every step (with the host tier on,
    ``progress(done, total, note)``: what it moved so far, ``HostTierStats.line``)."""
    arrivals = poisson_trace(
        seed=config.seed,
        num_requests=config.num_requests,
        request_rate=config.request_rate,
        min_prompt_len=config.min_prompt_len,
        max_prompt_len=config.max_prompt_len,
        vocab_size=llm.adapter.spec.vocab_size,
    )
    counted = llm.speculative_counters()
    host_before = llm.prefix_cache_stats() if llm.host_kv_cache_gib else None
    swaps_before = llm.num_swaps

    def host_tier() -> HostTierStats | None:
        if host_before is None:
            return None
        return HostTierStats.between(host_before, llm.prefix_cache_stats())

    # kernels a GPU builds mid-run (the interpreter builds none)
    builds = KernelBuilds() if triton_mode() == "native" else None
    with builds or contextlib.nullcontext():
        start = time.perf_counter()
        arrived_at, rids, running = {}, [], set()
        steps = max_batch = done = 0
        step_s: dict[bool, list[float]] = {False: [], True: []}  # by "had prompt chunks"
        next_arrival = 0
        try:
            while next_arrival < len(arrivals) or llm.has_unfinished():
                now = time.perf_counter() - start
                while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
                    rid = llm.add_request(
                        arrivals[next_arrival][1], config.max_new_tokens, ignore_eos=True
                    )
                    arrived_at[rid] = start + arrivals[next_arrival][0]
                    rids.append(rid)
                    running.add(rid)
                    next_arrival += 1
                if llm.has_unfinished():
                    began = time.perf_counter()
                    record = llm.step()
                    if record is not None:
                        step_s[bool(record.prefilled)].append(time.perf_counter() - began)
                        steps += 1
                        max_batch = max(max_batch, len(record.served))
                    if progress is not None:  # O(running) per step, not O(all requests)
                        timing = llm.request_timing
                        ended = {r for r in running if timing(r).finished_at is not None}
                        running -= ended
                        done += len(ended)
                        moved = host_tier()
                        if moved is None:
                            progress(done, config.num_requests)
                        else:
                            progress(done, config.num_requests, moved.line())
                else:  # idle until the next arrival
                    time.sleep(max(0.0, arrivals[next_arrival][0] - now))
        finally:
            llm.loop.close()
    elapsed = time.perf_counter() - start
    speculation = None
    if llm.speculative is not None:
        speculation = SpeculationStats.between(
            llm.speculative.method, counted, llm.speculative_counters()
        )
    ttft, tpot, tokens, outputs = [], [], 0, []
    for rid in rids:
        timing = llm.request_timing(rid)
        ttft.append(timing.first_token_at - arrived_at[rid])
        if timing.num_tokens > 1:
            tpot.append((timing.finished_at - timing.first_token_at) / (timing.num_tokens - 1))
        tokens += timing.num_tokens
        if config.compare:
            outputs.append(llm.output(rid))
        llm.release(rid)
    matches = None
    if config.compare:  # after the timed run: transformers' greedy, one prompt at a time
        expected = transformers_greedy(
            llm.model, [p for _, p in arrivals], config.max_new_tokens, ignore_eos=True
        )
        matches = sum(list(o) == list(e) for o, e in zip(outputs, expected, strict=True))
    return ServeBenchResult(
        config=config,
        ttft=LatencyStats.from_seconds(ttft),
        tpot=LatencyStats.from_seconds(tpot),
        elapsed_s=elapsed,
        output_tokens=tokens,
        steps=steps,
        max_batch=max_batch,
        matches_transformers=matches,
        speculation=speculation,
        decode_step=LatencyStats.from_seconds(step_s[False]),
        mixed_step=LatencyStats.from_seconds(step_s[True]),
        kernel_builds=0 if builds is None else builds.count,
        kernel_build_names=() if builds is None else tuple(sorted(builds.names.items())),
        kernel_build_signatures=() if builds is None else tuple(builds.signatures),
        host_tier=host_tier(),
        swaps=llm.num_swaps - swaps_before,
    )
