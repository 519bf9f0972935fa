"""Summary statistics every workload reports: latency percentiles, Jain's fairness index, rates.

Plain Python (no numpy): inputs are a few thousand numbers at most and results must be exact
and identical on every machine for the same input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


def _finite_numbers(name: str, values: Iterable[float]) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be an iterable of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}[{i}] must be a number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise ValueError(f"{name}[{i}] must be finite, got {v}")
        out.append(float(v))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    data = sorted(_finite_numbers("values", values))
    if not data:
        raise ValueError("percentile of an empty sequence is undefined")
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"q must be a number in [0, 100], got {q!r}")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyStats:
    """Latency summary in milliseconds; ``count`` samples (all zeros when there are none)."""

    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float

    @classmethod
    def from_seconds(cls, seconds: Iterable[float]) -> LatencyStats:
        data = _finite_numbers("seconds", seconds)
        if any(s < 0 for s in data):
            raise ValueError("latencies must be >= 0 seconds")
        if not data:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        ms = [s * 1e3 for s in data]
        return cls(
            count=len(ms),
            p50_ms=percentile(ms, 50),
            p90_ms=percentile(ms, 90),
            p99_ms=percentile(ms, 99),
            mean_ms=math.fsum(ms) / len(ms),
            max_ms=max(ms),
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one gets everything.

    Values must be >= 0. An empty input or all zeros counts as perfectly fair (1.0): nobody
    received more than anybody else.
    """
    data = _finite_numbers("values", values)
    if any(v < 0 for v in data):
        raise ValueError("jain_index needs values >= 0")
    square_sum = math.fsum(v * v for v in data)
    if not data or square_sum == 0:
        return 1.0
    return math.fsum(data) ** 2 / (len(data) * square_sum)


def safe_rate(amount: float, seconds: float) -> float:
    """``amount / seconds``, 0.0 when no time elapsed (nothing was measured)."""
    return amount / seconds if seconds > 0 else 0.0


def ratio(part: int, whole: int) -> float:
    """``part / whole`` as a fraction; 1.0 for an empty whole (nothing was left undone)."""
    return part / whole if whole else 1.0


@dataclass(frozen=True)
class SpeculationStats:
    """Speculative decoding over a run: drafts verified and accepted, and the mean tokens a
    request got per step that decoded it (1.0: no gain; 1 + num_speculative_tokens at most)."""

    method: str
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float  # accepted / drafted (0.0 when nothing was drafted)
    tokens_per_step: float
    held_steps: int = 0  # steps run plain: verification measured slower there

    @classmethod
    def between(cls, method: str, before: dict, after: dict) -> SpeculationStats:
        """From two readings of ``flashdec.LLM.speculative_counters()`` around a run."""
        d = {key: after[key] - before[key] for key in after}
        return cls(
            method=method,
            draft_tokens=d["draft_tokens"],
            accepted_tokens=d["accepted_tokens"],
            acceptance_rate=d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            tokens_per_step=d["step_tokens"] / d["request_steps"] if d["request_steps"] else 1.0,
            held_steps=d.get("held_steps", 0),
        )

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("speculation", self.method),
            ("draft tokens / accepted", f"{self.draft_tokens:,} / {self.accepted_tokens:,}"),
            ("acceptance rate", f"{100 * self.acceptance_rate:.1f}%"),
            ("tokens per step (per request)", f"{self.tokens_per_step:.2f}"),
            ("steps held plain (verification slower)", f"{self.held_steps:,}"),
        ]


@dataclass(frozen=True)
class HostTierStats:
    """The prefix cache's host tier over a run: prompt tokens found (all, and those copied up
    from the host), blocks and bytes moved each way, and the copies' time (completed copies)."""

    queried_tokens: int
    hit_tokens: int
    host_hit_tokens: int
    blocks_down: int
    blocks_up: int
    bytes_down: int
    bytes_up: int
    copy_down_s: float
    copy_up_s: float
    failed_copies: int

    @classmethod
    def between(cls, before: dict, after: dict) -> HostTierStats:
        """From two readings of ``flashdec.LLM.prefix_cache_stats()`` (with a host tier)."""
        host = {key: after["host"][key] - before["host"][key] for key in after["host"]}
        return cls(
            queried_tokens=after["queried_tokens"] - before["queried_tokens"],
            hit_tokens=after["hit_tokens"] - before["hit_tokens"],
            host_hit_tokens=after["host_hit_tokens"] - before["host_hit_tokens"],
            blocks_down=host["blocks_down"],
            blocks_up=host["blocks_up"],
            bytes_down=host["bytes_down"],
            bytes_up=host["bytes_up"],
            copy_down_s=host["copy_down_s"],
            copy_up_s=host["copy_up_s"],
            failed_copies=host["failed_down"] + host["failed_up"],
        )

    @staticmethod
    def _rate(num_bytes: int, seconds: float) -> str:
        return f"{num_bytes / seconds / 1e9:.1f} GB/s" if seconds > 0 else "-"

    def line(self) -> str:
        """One line for a progress display: host hits, then blocks, GiB and copy time each way."""

        def way(name: str, blocks: int, num_bytes: int, seconds: float) -> str:
            return f"{name} {blocks:,} blocks, {num_bytes / 2**30:.2f} GiB, {seconds * 1e3:.1f} ms"

        down = way("down", self.blocks_down, self.bytes_down, self.copy_down_s)
        up = way("up", self.blocks_up, self.bytes_up, self.copy_up_s)
        return f"host tier: {self.host_hit_tokens:,} hit tokens; {down}; {up}"

    def rows(self) -> list[tuple[str, str]]:
        share = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return [
            ("prefix hits: tokens (share of prompts)", f"{self.hit_tokens:,} ({share:.1%})"),
            ("  of them from the host tier", f"{self.host_hit_tokens:,}"),
            (
                "host tier down: blocks, GiB, rate",
                f"{self.blocks_down:,}, {self.bytes_down / 2**30:.2f}, "
                f"{self._rate(self.bytes_down, self.copy_down_s)}",
            ),
            (
                "host tier up: blocks, GiB, rate",
                f"{self.blocks_up:,}, {self.bytes_up / 2**30:.2f}, "
                f"{self._rate(self.bytes_up, self.copy_up_s)}",
            ),
            ("host tier copies failed (recomputed)", f"{self.failed_copies:,}"),
        ]
