"""Reference rotary position embedding (split-half, GPT-NeoX / Llama style)."""

from __future__ import annotations

import torch

from flashdec._checks import (
    DEFAULT_ROPE_BASE,
    FLOAT_DTYPES,
    check_int_tensor,
    check_inv_freq,
    check_rope_base,
    check_rotary_dim,
    check_tensor,
)

__all__ = ["apply_rope", "apply_rope_inv_freq", "check_rotary_dim", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(
    rotary_dim: int, base: float = DEFAULT_ROPE_BASE, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """float32 inverse frequencies ``base ** (-2i / rotary_dim)``, shape ``[rotary_dim // 2]``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device)
    return 1.0 / (base ** (exponents.float() / rotary_dim))


def rope_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    base: float = DEFAULT_ROPE_BASE,
    *,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos, sin`` of shape ``[len(positions), rotary_dim // 2]``.

    The angle is ``position * inv_freq[i]`` in float32; ``inv_freq`` defaults to
    :func:`rope_inv_freq` of ``base``.
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, base, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int | None = None,
    base: float = DEFAULT_ROPE_BASE,
) -> torch.Tensor:
    """Rotate ``x [B, H, D]`` at integer ``positions [B]``; returns a new tensor of x's dtype.

    The first ``rotary_dim`` dims are split in halves ``(x1, x2)`` and become
    ``(x1 cos - x2 sin, x2 cos + x1 sin)``; dims past ``rotary_dim`` are copied unchanged.
    Frequencies are ``base ** (-2i / rotary_dim)``; :func:`apply_rope_inv_freq` takes a table.
    """
    x, positions = _check_rope_inputs(x, positions)
    base = check_rope_base(base)
    rotary_dim = check_rotary_dim(rotary_dim, x.shape[-1])
    return _rotate(x, positions, rope_inv_freq(rotary_dim, base, x.device))


def apply_rope_inv_freq(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """:func:`apply_rope` with a given float32 table ``inv_freq [rotary_dim // 2]`` (e.g. a
    model's own rotary module's, which includes its scaling); rotates the first
    ``2 * len(inv_freq)`` dims."""
    x, positions = _check_rope_inputs(x, positions)
    if not isinstance(inv_freq, torch.Tensor):
        raise TypeError(f"inv_freq must be a torch.Tensor, got {type(inv_freq).__name__}")
    rotary_dim = check_rotary_dim(2 * inv_freq.shape[0] if inv_freq.dim() == 1 else -1, x.shape[-1])
    return _rotate(x, positions, check_inv_freq(inv_freq, rotary_dim, x.device, DEFAULT_ROPE_BASE))


def _check_rope_inputs(x: object, positions: object) -> tuple[torch.Tensor, torch.Tensor]:
    x = check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    positions = check_int_tensor("positions", positions, ndim=1, device=x.device)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions must have shape [{x.shape[0]}], got {tuple(positions.shape)}")
    return x, positions


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Float32 angles ``position * inv_freq``, float32 rotation, one rounding to x's dtype."""
    half = inv_freq.shape[0]
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [B, 1, half]
    x1 = x[..., :half].float()
    x2 = x[..., half : 2 * half].float()
    out = x.clone()
    out[..., :half] = (x1 * cos - x2 * sin).to(x.dtype)
    out[..., half : 2 * half] = (x2 * cos + x1 * sin).to(x.dtype)
    return out
