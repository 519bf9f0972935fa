"""The pieces every config of :mod:`flashdec.workloads` is made of: :func:`knob` (a field with
its help, bounds and choices, which the CLI turns into a ``--flag``), the checks that read them
(:func:`check_fields`, :func:`check_min_max`), the shared bounds, and :class:`MemoryEstimate`
(what a configured run will hold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from flashdec._checks import INT32_MAX, check_choice, check_positive_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")
TRITON_BACKENDS = ("triton", "fused")  # backends that launch Triton kernels

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
# Far above any real model: they catch typos and keep every product of sizes small.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_BLOCK_SIZE = 1024
MAX_HEAD_DIM = 256  # the decode kernels' limit

# Host bytes a run keeps per request (spec, arrival, loop, engine and cache bookkeeping; the
# block-table row is counted apart) and per step (trajectory record, timings). tracemalloc on
# run_synthetic_workload (CPU, torch backends) at d015b47 measured 1.07 KB per request and
# 0.40 KB per step; these budget about twice that.
HOST_BYTES_PER_REQUEST = 2048
HOST_BYTES_PER_STEP = 800


def knob(
    default,
    help_text: str,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    why: str = "",
    choices: tuple[str, ...] | None = None,
):
    """A config field; ``minimum``/``maximum`` (inclusive), ``above`` (exclusive, for reals) and
    ``choices`` are checked in ``__post_init__`` and shown by the CLI; ``why`` explains the
    maximum in error messages."""
    metadata = {"help": help_text, "minimum": minimum, "maximum": maximum, "why": why}
    if above is not None:
        metadata["above"] = above
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_fields(config) -> None:
    """Each field on its own: type, choices and bounds from its metadata."""
    for f in fields(config):
        name, value, meta = f.name, getattr(config, f.name), f.metadata
        maximum = meta["maximum"]
        if "choices" in meta:
            check_choice(name, value, meta["choices"])
        elif isinstance(f.default, str):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        elif isinstance(f.default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        elif isinstance(f.default, int):
            check_positive_int(name, value, minimum=meta["minimum"])
            if maximum is None:
                maximum = INT32_MAX  # counts reach int32 tensors; nothing sane is larger
        else:
            _check_real(name, value)
            if meta["minimum"] is not None and value < meta["minimum"]:
                raise ValueError(f"{name} must be >= {meta['minimum']}, got {value}")
            if "above" in meta and not value > meta["above"]:
                raise ValueError(f"{name} must be > {meta['above']:g}, got {value}")
        if maximum is not None and value > maximum:
            why = f" ({meta['why']})" if meta["why"] else ""
            raise ValueError(f"{name} must be <= {maximum}{why}, got {value}")


def check_min_max(config, low: str, high: str) -> None:
    if getattr(config, low) > getattr(config, high):
        raise ValueError(
            f"{low} ({getattr(config, low)}) must not exceed {high} ({getattr(config, high)})"
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run holds at its peak, estimated from the config before anything is allocated.

    ``device_bytes`` (KV cache, one step's Q/K/V for every layer, prompt and prefix staging) live
    on ``device``; ``host_bytes`` is the Python bookkeeping, plus ``device_bytes`` when the device
    is the CPU. Kernel workspaces and allocator slack come on top.
    """

    device: torch.device
    kv_cache_bytes: int
    device_bytes: int
    host_bytes: int
    weight_bytes: int = 0  # a model's weights (in device_bytes); the workloads have none
