"""SiLU(gate) × up in one launch: the elementwise middle of a gated MLP.

``silu_and_mul(gate, up)`` takes the two projections as separate tensors ``[..., I]``;
``silu_and_mul(gate_up)`` takes them concatenated ``[..., 2I]`` (gate first, vLLM's layout).
The math is transformers' ``act_fn(gate) * up`` in the input dtype: SiLU in float32 rounded to
the dtype, then the product in float32 rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdec._checks import FLOAT_DTYPES, check_shape, check_tensor
from flashdec.kernels._runtime import Launcher, check_kernel_device
from flashdec.kernels.dependent_launch import _await_inputs, dependent_launch

BLOCK_I = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    stride_g,
    stride_u,
    stride_o,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # a 1-D grid over (row, column block), column blocks fastest
    blocks_per_row: tl.constexpr = (WIDTH + BLOCK - 1) // BLOCK
    pid = tl.program_id(0)
    row = (pid // blocks_per_row).to(tl.int64)
    offs = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    _await_inputs(PDL)
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu, rounded like torch's
    out = act.to(tl.float32) * u
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


_SILU_AND_MUL = Launcher(_silu_and_mul_kernel)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit column stride (a view when it can be one)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``; ``x`` is ``gate [..., I]`` when ``up`` is given, else
    ``gate_up [..., 2I]``. Returns a new ``[..., I]`` tensor of x's dtype."""
    x = check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim [..., width], got a 0-d tensor")
    if up is None:
        if x.shape[-1] % 2:
            raise ValueError(
                f"gate_up's last dim must be even (gate and up concatenated), got {x.shape[-1]}"
            )
        width = x.shape[-1] // 2
    else:
        up = check_tensor("up", up, dtypes=(x.dtype,), device=x.device)
        check_shape("up", up, tuple(x.shape))
        width = x.shape[-1]
    check_kernel_device("x", x)

    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if up is None:
        both = _rows(x, 2 * width)
        gate, up2 = both[:, :width], both[:, width:]
    else:
        gate, up2 = _rows(x, width), _rows(up, width)
    out2 = out.view(-1, width)
    pdl = dependent_launch(x.device)
    _SILU_AND_MUL(
        out2.shape[0] * triton.cdiv(width, BLOCK_I),
        (gate, up2, out2),
        (gate.stride(0), up2.stride(0), out2.stride(0)),
        (width, BLOCK_I, pdl),
        num_warps=4,
        pdl=pdl,
    )
    return out
