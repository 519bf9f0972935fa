"""The server's counters and histograms, written in the Prometheus text format (version 0.0.4).

Written here rather than with ``prometheus_client``: a dozen families need no dependency, and
the GPU machine that runs the server reaches no package registry. They live in the HTTP front
end: its engine client records requests and tokens as the engine's messages arrive, handlers
record rejected requests; ``/metrics`` renders a consistent copy under one lock, with the gauges
the engine thread reads from the LLM at that moment (a snapshot request over the pipe).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

# seconds; TTFT spans queueing and prompt import, TPOT one decode step
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == math.inf else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Thread-safe counters of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_received = 0  # accepted by the engine
        self.requests_rejected = 0  # answered with a 4xx before running
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def rejected(self) -> None:
        with self._lock:
            self.requests_rejected += 1

    def received(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests_received += 1
            self.prompt_tokens += prompt_tokens

    def first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def ended(self, reason: str, num_tokens: int, tpot_s: float | None) -> None:
        with self._lock:
            self.finished[reason] += 1
            self.generation_tokens += num_tokens
            if tpot_s is not None:
                self.tpot.observe(tpot_s)

    def render(self, gauges: dict) -> str:
        """The text exposition; ``gauges`` is the engine thread's snapshot
        (:meth:`flashdec.server.client.EngineClient.snapshot`)."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        with self._lock:
            family(
                "flashdec_requests_received_total",
                "counter",
                "Requests the engine accepted.",
                [f"flashdec_requests_received_total {self.requests_received}"],
            )
            family(
                "flashdec_requests_rejected_total",
                "counter",
                "Requests answered with a client error (4xx) before running.",
                [f"flashdec_requests_rejected_total {self.requests_rejected}"],
            )
            family(
                "flashdec_requests_finished_total",
                "counter",
                "Requests that ended, by reason (stop: EOS or a stop string; length: max_tokens; "
                "abort: the client went away or the server stopped; error: an internal error).",
                [
                    f'flashdec_requests_finished_total{{finish_reason="{r}"}} {n}'
                    for r, n in self.finished.items()
                ],
            )
            family(
                "flashdec_prompt_tokens_total",
                "counter",
                "Prompt tokens of accepted requests.",
                [f"flashdec_prompt_tokens_total {self.prompt_tokens}"],
            )
            family(
                "flashdec_generation_tokens_total",
                "counter",
                "Tokens generated for requests that ended.",
                [f"flashdec_generation_tokens_total {self.generation_tokens}"],
            )
            family(
                "flashdec_time_to_first_token_seconds",
                "histogram",
                "Arrival at the HTTP front end to its first token there.",
                self.ttft.lines("flashdec_time_to_first_token_seconds"),
            )
            family(
                "flashdec_time_per_output_token_seconds",
                "histogram",
                "Mean time between a request's later tokens.",
                self.tpot.lines("flashdec_time_per_output_token_seconds"),
            )
        for key, kind, help_text in (
            ("requests_running", "gauge", "Requests admitted to the KV cache."),
            ("requests_waiting", "gauge", "Requests queued for admission."),
            ("kv_blocks_used", "gauge", "KV cache blocks in use (all layer groups)."),
            ("kv_blocks_total", "gauge", "KV cache blocks in the pool (all layer groups)."),
            ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up."),
            ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the cache."),
            (
                "prefix_cache_host_hit_tokens_total",
                "counter",
                "Of the prompt tokens found, those copied up from the host tier.",
            ),
            ("host_kv_blocks_cached", "gauge", "KV blocks the host tier holds."),
            ("host_kv_blocks_total", "gauge", "KV blocks the host tier can hold."),
            *(
                (f"host_kv_copy_{way}_{what}_total", "counter", f"{text} copied {way}.")
                for way, where in (("down", "to the host"), ("up", "to the GPU"))
                for what, text in (
                    ("blocks", f"KV blocks {where},"),
                    ("bytes", f"Bytes {where},"),
                    ("seconds", f"Seconds the copies {where} took,"),
                    ("failures", f"Blocks whose copy {where} failed (recomputed),"),
                )
            ),
            (
                "requests_swapped_total",
                "counter",
                "Running requests swapped out for a waiting one (preemption by swap).",
            ),
            ("speculative_draft_tokens_total", "counter", "Draft tokens verified."),
            ("speculative_accepted_tokens_total", "counter", "Draft tokens accepted."),
        ):
            if key in gauges:  # the prefix-cache, host-tier and speculation families when on
                family(f"flashdec_{key}", kind, help_text, [f"flashdec_{key} {gauges[key]}"])
        return "\n".join(lines) + "\n"
