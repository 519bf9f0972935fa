"""``flashdec bench-serve``: requests arrive as a Poisson process and are served through the loop.

Each request is submitted to :class:`flashdec.LLM` when its (wall-clock) arrival time has come,
and the loop steps whenever anything waits or runs — new requests join the running batch as
others finish (continuous batching). Per request: TTFT = first token − arrival, TPOT = the mean
time between its later tokens. Timestamps are taken when a step's tokens reach the host.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from flashdec._checks import check_positive_int
from flashdec.workloads.stats import LatencyStats


def _knob(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ServeBenchConfig:
    """Knobs of the Poisson-arrival serving benchmark."""

    num_requests: int = _knob(64, "requests in the run")
    request_rate: float = _knob(8.0, "mean arrivals per second (Poisson)")
    min_prompt_len: int = _knob(16, "shortest prompt (tokens)")
    max_prompt_len: int = _knob(128, "longest prompt (tokens)")
    max_new_tokens: int = _knob(32, "tokens to generate per request (EOS ignored)")
    seed: int = _knob(0, "random seed (arrivals, prompt lengths and ids)")

    def __post_init__(self) -> None:
        check_positive_int("num_requests", self.num_requests)
        check_positive_int("min_prompt_len", self.min_prompt_len)
        check_positive_int("max_prompt_len", self.max_prompt_len)
        check_positive_int("max_new_tokens", self.max_new_tokens)
        check_positive_int("seed", self.seed, minimum=0)
        if self.min_prompt_len > self.max_prompt_len:
            raise ValueError(
                f"min_prompt_len ({self.min_prompt_len}) must not exceed max_prompt_len "
                f"({self.max_prompt_len})"
            )
        rate = self.request_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e9:
            raise ValueError(f"request_rate must be a positive number, got {rate!r}")


@dataclass(frozen=True)
class ServeBenchResult:
    config: ServeBenchConfig
    ttft: LatencyStats
    tpot: LatencyStats
    elapsed_s: float
    output_tokens: int
    steps: int
    max_batch: int  # largest batch one step decoded

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "ttft_p50_ms": self.ttft.p50_ms,
            "ttft_p99_ms": self.ttft.p99_ms,
            "tpot_p50_ms": self.tpot.p50_ms,
            "tpot_p99_ms": self.tpot.p99_ms,
            "elapsed_s": self.elapsed_s,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tok_s,
            "steps": self.steps,
            "max_batch": self.max_batch,
        }


def run_serve_benchmark(llm, config: ServeBenchConfig | None = None) -> ServeBenchResult:
    """Serve ``config.num_requests`` Poisson arrivals with ``llm`` (a :class:`flashdec.LLM`)."""
    config = config or ServeBenchConfig()
    rng = random.Random(config.seed)
    vocab = llm.adapter.spec.vocab_size
    clock, arrivals = 0.0, []
    for _ in range(config.num_requests):
        clock += rng.expovariate(config.request_rate)
        length = rng.randint(config.min_prompt_len, config.max_prompt_len)
        arrivals.append((clock, [rng.randrange(vocab) for _ in range(length)]))
    start = time.perf_counter()
    arrived_at, rids = {}, []
    steps = max_batch = 0
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
                next_arrival += 1
            if llm.has_unfinished():
                record = llm.step()
                if record is not None:
                    steps += 1
                    max_batch = max(max_batch, len(record.served))
            else:  # idle until the next arrival
                time.sleep(max(0.0, arrivals[next_arrival][0] - now))
    finally:
        llm.loop.close()
    elapsed = time.perf_counter() - start
    ttft, tpot, tokens = [], [], 0
    for rid in rids:
        timing = llm.request_timing(rid)
        ttft.append(timing.first_token_at - arrived_at[rid])
        if timing.num_tokens > 1:
            tpot.append((timing.finished_at - timing.first_token_at) / (timing.num_tokens - 1))
        tokens += timing.num_tokens
        llm.release(rid)
    return ServeBenchResult(
        config=config,
        ttft=LatencyStats.from_seconds(ttft),
        tpot=LatencyStats.from_seconds(tpot),
        elapsed_s=elapsed,
        output_tokens=tokens,
        steps=steps,
        max_batch=max_batch,
    )
