"""Workload configurations: the frozen knobs every workload and the CLI share.

The CLI generates one ``--flag`` per field (with the field's ``help``), so a knob added here is a
command-line option too. Every config validates itself in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from flashdec.workloads.scheduler_workload import TRACE_NAMES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _knob(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class SyntheticWorkloadConfig:
    """Knobs of the single-layer dynamic workload (``auto`` = chosen from the device)."""

    num_requests: int = _knob(16, "requests in the trace")
    num_q_heads: int = _knob(8, "query heads")
    num_kv_heads: int = _knob(2, "KV heads")
    head_dim: int = _knob(32, "head dimension")
    block_size: int = _knob(8, "tokens per KV block")
    num_blocks: int = _knob(48, "blocks in the pool")
    max_batch_size: int = _knob(8, "requests decoded per step at most")
    max_active_requests: int = _knob(12, "requests resident in the cache at most")
    reserve_blocks: int = _knob(0, "blocks kept out of every lifetime commitment")
    aging_threshold: int = _knob(8, "overtakes before a waiting request blocks later ones")
    arrivals_per_step: float = _knob(0.5, "mean request arrivals per step")
    min_context: int = _knob(4, "shortest prompt (tokens)")
    max_context: int = _knob(40, "longest prompt (tokens)")
    min_new_tokens: int = _knob(4, "fewest tokens to generate")
    max_new_tokens: int = _knob(24, "most tokens to generate")
    dtype: str = _knob("auto", "float32 | float16 | bfloat16 | auto (fp32 CPU, bf16 GPU)")
    device: str = _knob("auto", "cpu | cuda | auto")
    append_backend: str = _knob("auto", "torch | triton | fused | auto (torch CPU, fused GPU)")
    decode_backend: str = _knob("auto", "torch | triton | auto (torch CPU, triton GPU)")
    seed: int = _knob(0, "random seed (arrivals, lengths, K/V values)")
    max_steps: int = _knob(5000, "stop after this many steps")
    check_invariants: bool = _knob(True, "validate the cache after every step")
    warmup_run: bool = _knob(
        False, "run the whole workload once untimed first (Triton compiles each new launch shape)"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise TypeError(f"{f.name} must be a bool, got {value!r}")
            elif isinstance(f.default, int) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{f.name} must be an int >= 0, got {value!r}")
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {[*DTYPES, 'auto']}, got {self.dtype!r}")
        if self.min_context > self.max_context or self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_context/min_new_tokens must not exceed their max")
        if self.min_new_tokens < 1 or self.num_requests < 1:
            raise ValueError("num_requests and min_new_tokens must be >= 1")
        if not self.arrivals_per_step > 0:
            raise ValueError(f"arrivals_per_step must be > 0, got {self.arrivals_per_step}")


@dataclass(frozen=True)
class IntegratedWorkloadConfig(SyntheticWorkloadConfig):
    """Knobs of the integrated workload: the synthetic ones plus layers, prefixes and faults."""

    num_layers: int = _knob(4, "transformer layers (one token transaction spans all)")
    num_prefixes: int = _knob(2, "shared prefixes registered before the first submission")
    prefix_blocks: int = _knob(2, "full blocks per shared prefix")
    prefix_hit_rate: float = _knob(0.5, "fraction of requests whose prompt is a shared prefix")
    failure_rate: float = _knob(0.1, "fraction of steps hit by an injected failure (retried)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        for name in ("prefix_hit_rate", "failure_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.prefix_hit_rate > 0 and (self.num_prefixes < 1 or self.prefix_blocks < 1):
            raise ValueError("prefix hits need num_prefixes >= 1 and prefix_blocks >= 1")

    @classmethod
    def demo_defaults(cls, seed: int = 0) -> IntegratedWorkloadConfig:
        """What ``flashdec demo`` runs: small on the CPU, Llama-like heads on a GPU."""
        if torch.cuda.is_available():
            return cls(
                num_requests=64,
                num_layers=8,
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=128,
                block_size=16,
                num_blocks=2048,
                max_batch_size=32,
                max_active_requests=48,
                arrivals_per_step=2.0,
                min_context=64,
                max_context=512,
                min_new_tokens=16,
                max_new_tokens=64,
                prefix_blocks=16,
                seed=seed,
                warmup_run=True,  # measured on an H200: first-use compiles put p90 at 0.5 s
            )
        return cls(seed=seed)


@dataclass(frozen=True)
class SchedulerWorkloadConfig:
    """CLI knobs of ``run_scheduler_workload`` (all policies are compared on one trace)."""

    trace: str = field(default="boundary", metadata={"help": f"one of {', '.join(TRACE_NAMES)}"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    prefix_sharing: bool = field(default=True, metadata={"help": "share prefixes"})
    check_invariants: bool = field(default=True, metadata={"help": "validate after each step"})
