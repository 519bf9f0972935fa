"""Reference FP8 (e4m3) KV quantisation: what the FP8 append kernels store and decode reads back.

A stored value is ``x / scale`` rounded to the nearest e4m3 number (ties to even) after
saturating to +-448, the format's largest finite value (e4m3fn has no infinities, and an
unsaturated overflow would become NaN). Dequantised: ``stored.float() * scale``. ``scale`` is a
float or a float32 tensor with one entry per KV head; the heads are the second-to-last dimension
of ``x`` (``[..., num_kv_heads, head_dim]``).
"""

from __future__ import annotations

import torch

from flashdec._checks import FP8_DTYPE, FP8_MAX, KVScale


def _per_head(scale: KVScale, device: torch.device) -> torch.Tensor | float:
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32)[:, None]  # [Hkv, 1]
    return float(scale)


def quantize_fp8(x: torch.Tensor, scale: KVScale) -> torch.Tensor:
    """``x [..., Hkv, D]`` (any float dtype) as float8_e4m3fn: ``x / scale`` saturated to +-448
    and rounded to nearest even, in float32 math."""
    scaled = x.float() / _per_head(scale, x.device)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(stored: torch.Tensor, scale: KVScale) -> torch.Tensor:
    """float32 ``stored.float() * scale`` of an FP8 ``[..., Hkv, D]`` tensor."""
    return stored.float() * _per_head(scale, stored.device)
