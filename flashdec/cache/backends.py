"""How the cache writes one token per request into one layer: torch scatter or Triton kernels.

The Triton launchers live in ``flashdec.kernels.append`` and are imported lazily, so the cache
works (with the torch backend) before that module exists and never imports Triton eagerly.
The cache calls the *trusted* launchers: it validated its own reservation, so no index check
(and no host sync) is repeated per layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

APPEND_BACKENDS = ("torch", "triton")
ROPE_BACKENDS = ("torch", "triton", "fused")


def check_backend(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def torch_scatter(
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """``k_layer[block_ids[b], :, offsets[b]] = k[b]`` (same for v): one index_put each."""
    k_layer[block_ids, :, offsets] = k  # [B, Hkv, D]
    v_layer[block_ids, :, offsets] = v


def load_launcher(backend: str) -> Callable[..., object]:
    """The trusted Triton launcher for ``backend`` ("triton" or "fused"), imported on demand."""
    try:
        kernels = importlib.import_module("flashdec.kernels.append")
    except ImportError as err:
        raise RuntimeError(
            f"append_backend={backend!r} needs flashdec.kernels.append, which cannot be "
            f"imported ({err}); use append_backend='torch'"
        ) from err
    name = "launch_kv_append" if backend == "triton" else "launch_fused_rope_kv_append"
    launcher = getattr(kernels, name, None)
    if launcher is None:
        raise RuntimeError(f"flashdec.kernels.append has no {name} (append_backend={backend!r})")
    return launcher
