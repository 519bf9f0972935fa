"""RoPE with a model's own inverse frequencies, in FlashDec's exact arithmetic.

Prompt K written by the adapter must be bit-identical to what the fused decode-time kernel
writes, so this repeats :func:`flashdec.apply_rope`'s math with a given ``inv_freq`` table:
float32 angles ``position * inv_freq``, float32 split-half rotation
``(x1 cos - x2 sin, x2 cos + x1 sin)`` of the first ``2 * len(inv_freq)`` dims, one rounding to
x's dtype, remaining dims copied.
"""

from __future__ import annotations

import torch


# TODO(lead): apply_rope(..., inv_freq=) once it lands; this is its math with a given table.
def apply_rope_inv_freq(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x [N, H, D]`` at ``positions [N]`` with float32 ``inv_freq [R / 2]``, R <= D."""
    half = inv_freq.shape[0]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [N, half]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [N, 1, half]
    x1 = x[..., :half].float()
    x2 = x[..., half : 2 * half].float()
    out = x.clone()
    out[..., :half] = (x1 * cos - x2 * sin).to(x.dtype)
    out[..., half : 2 * half] = (x2 * cos + x1 * sin).to(x.dtype)
    return out
