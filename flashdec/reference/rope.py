"""Reference rotary position embedding (split-half, GPT-NeoX / Llama style)."""

from __future__ import annotations

import torch

from flashdec._checks import FLOAT_DTYPES, check_int_tensor, check_tensor


def check_rotary_dim(rotary_dim: int | None, head_dim: int) -> int:
    if rotary_dim is None:
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}"
        )
    return rotary_dim


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of shape ``[len(positions), rotary_dim // 2]``.

    Frequencies are ``base ** (-2i / rotary_dim)``; the angle is ``position * frequency``.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (base ** (exponents.float() / rotary_dim))  # [rotary_dim // 2]
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int | None = None,
    base: float = 10000.0,
) -> torch.Tensor:
    """Rotate ``x [B, H, D]`` at integer ``positions [B]``; returns a new tensor of x's dtype.

    The first ``rotary_dim`` dims are split in halves ``(x1, x2)`` and become
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``; dims past ``rotary_dim`` are copied unchanged.
    """
    x = check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    positions = check_int_tensor("positions", positions, ndim=1, device=x.device)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions must have shape [{x.shape[0]}], got {tuple(positions.shape)}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0:
        raise ValueError(f"base must be a float > 1, got {base!r}")
    rotary_dim = check_rotary_dim(rotary_dim, x.shape[-1])
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, rotary_dim, base)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [B, 1, half]
    x1 = x[..., :half].float()
    x2 = x[..., half:rotary_dim].float()
    out = x.clone()
    out[..., :half] = (x1 * cos - x2 * sin).to(x.dtype)
    out[..., half:rotary_dim] = (x2 * cos + x1 * sin).to(x.dtype)
    return out
