"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

- ``rms_norm(x, weight, eps)`` normalises each row of ``x [..., H]`` with transformers' RMSNorm
  math: float32 variance, ``x * rsqrt(mean(x^2) + eps)`` rounded to x's dtype, then multiplied
  by ``weight`` (rounded again).
- ``rms_norm(x, weight, eps, residual=r)`` first adds ``x`` into ``r`` in place (the sum rounded
  to the dtype, as ``residual + hidden`` is in transformers) and normalises that sum: one launch
  instead of an add and a norm, the contract of vLLM's fused_add_rms_norm.

One program per row holds the whole row in registers, so ``H`` is limited to
:data:`MAX_HIDDEN`. Reductions run in a different order than torch's, so results agree with
torch within float32 rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdec._checks import FLOAT_DTYPES, check_shape, check_tensor
from flashdec.kernels._runtime import Launcher, check_kernel_device, next_power_of_2
from flashdec.kernels.dependent_launch import _await_inputs, dependent_launch

MAX_HIDDEN = 32768  # one row per program, held in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask = offs_h < HIDDEN
    w = tl.load(weight_ptr + offs_h, mask=mask, other=0.0)  # a weight: no step writes it
    _await_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + offs_h, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + offs_h
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        # the sum is rounded to the activation dtype before the norm reads it
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs_h, out.to(out_ptr.dtype.element_ty), mask=mask)


_RMS_NORM = Launcher(_rms_norm_kernel)


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not 0.0 < eps < float("inf"):
        raise ValueError(f"eps must be a positive finite float, got {eps}")
    return float(eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of each row of ``x [..., H]`` with ``weight [H]``; returns a new tensor like x.

    With ``residual`` (x's shape, dtype and device, contiguous) it first does
    ``residual += x`` in place and returns the norm of the updated residual. Everything is
    checked before anything is written.
    """
    x = check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim [..., hidden], got a 0-d tensor")
    hidden = x.shape[-1]
    weight = check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check_shape("weight", weight, (hidden,))
    eps = _check_eps(eps)
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size (x.shape[-1]) must lie in [1, {MAX_HIDDEN}], got {hidden}")
    if residual is not None:
        residual = check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device)
        check_shape("residual", residual, tuple(x.shape))
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous: it is updated in place")
    check_kernel_device("x", x)

    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = x.numel() // hidden
    if rows == 0:
        return out
    x2 = x.reshape(rows, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = residual.view(rows, hidden) if residual is not None else x2
    out2 = out.view(rows, hidden)
    block_h = next_power_of_2(hidden)
    pdl = dependent_launch(x.device)
    _RMS_NORM(
        rows,
        (x2, r2, weight.contiguous(), out2),
        (x2.stride(0), r2.stride(0), out2.stride(0), float(eps)),
        (hidden, block_h, residual is not None, pdl),
        num_warps=min(16, max(1, block_h // 256)),
        pdl=pdl,
    )
    return out
