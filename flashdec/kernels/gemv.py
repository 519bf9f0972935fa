"""``x Wᵀ (+ b)`` for a few rows of ``x``, streaming ``W`` once: the decode step's projections at
small batch.

With ``M <= 8`` rows a projection reads its weight once and does little else, so its floor is
the weight's bytes over the memory bandwidth. On the H200, cuBLAS (``F.linear``) reaches 55-79%
of the copy bandwidth on Llama-3-8B's fused qkv, o and down weights at M = 1, against 89-101% on
the larger gate/up and LM-head weights (``benchmarks/results/gemm.md``).

Each program owns ``BLOCK_N`` output columns (weight rows, contiguous in K) and, split-K, one
slice of K. Products accumulate elementwise in float32 over the whole slice and are reduced once
at the end (no cross-lane reduction per tile). A split-K launch writes float32 partials that a
second launch sums, with the bias, into ``x``'s dtype; ``split_k = 1`` writes the output
directly. :func:`small_batch_linear` is what the decoder calls: this kernel where
:func:`gemv_wins` says it beats cuBLAS, ``F.linear`` everywhere else.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashdec._checks import FLOAT_DTYPES, check_tensor
from flashdec.kernels._runtime import (
    INTERPRET,
    Launcher,
    check_kernel_device,
    next_power_of_2,
    sm_count,
)
from flashdec.kernels.dependent_launch import _await_inputs, dependent_launch

MAX_ROWS = 8  # rows of x the kernel takes; the decoder uses it up to ROWS_USED
# at 4 rows it ran 1.4-1.9x cuBLAS on the H200 (one row: 0.81-0.97x where it is used)
ROWS_USED = 1
# FLASHDEC_GEMV=0 keeps every projection on cuBLAS (an A/B switch for benchmarks)
ENABLED = os.environ.get("FLASHDEC_GEMV", "1") != "0"
# the weights that take the kernel (see gemv_wins)
MAX_WEIGHT_ELEMENTS = 96 * 2**20
MIN_IN_FEATURES = 2048


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape: output columns per program, K per loop step, K slices, warps, and a
    cap on registers per thread (None: the compiler's choice; fewer registers, more programs
    resident per SM)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    max_registers: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.max_registers is not None and not 16 <= self.max_registers <= 255:
            raise ValueError(
                f"max_registers must be in [16, 255] or None, got {self.max_registers}"
            )


# One-row launches, largest tiles first, with the programs of each that fit on an SM at once:
# sm_90 compiles 4 x 1,024 to 66 registers a thread (7 four-warp programs an SM), 64 under a
# cap (8), 4 x 512 to 48 (10). A launch whose programs all fit runs in one wave; one more than
# fit runs a second, nearly empty wave at a fraction of the bandwidth (the H100 sweep of
# ``benchmarks/results/gemv_sweep.md``: Llama-3-8B's o and down, 1,024 programs, 16.1 -> 14.2
# and 51.6 -> 45.6 us with the cap; Qwen2-7B's qkv, 1,152, 15.6 -> 13.8 us with 4 x 512).
ONE_WAVE_LAUNCHES = (
    (GemvConfig(4, 1024, 1, 4), 7),
    (GemvConfig(4, 1024, 1, 4, max_registers=64), 8),
    (GemvConfig(4, 512, 1, 4), 10),
)


def default_config(rows: int, out_features: int, in_features: int, sms: int) -> GemvConfig:
    """Four output columns per program over all of K, 1,024 columns of K a loop step (the
    fastest launch of the H200 sweep at one row, ``benchmarks/results/gemm.md``), at one row the
    first of :data:`ONE_WAVE_LAUNCHES` whose programs fit on the SMs at once (none fits: the
    first). More rows keep the float32 products a program holds (rows x block_n x block_k) at
    4,096; K slices are added only where there are fewer output blocks than about four per SM."""
    block_n = 4
    block_k = min(1024 // next_power_of_2(rows), next_power_of_2(in_features))
    blocks = triton.cdiv(out_features, block_n)
    split = 1
    while blocks * split < 4 * sms and in_features >= 2 * split * 4 * block_k:
        split *= 2
    if split == 1 and block_k == 1024:  # one row, K of 1,024 or more
        for config, per_sm in ONE_WAVE_LAUNCHES:
            if triton.cdiv(out_features, config.block_n) <= per_sm * sms:
                return config
    return GemvConfig(block_n, block_k, split, 4)


@triton.jit
def _weight_tile(w_ptr, rows, offs_n, k, N, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """``W[offs_n, k : k + BLOCK_K]`` (zeros past N and K unless ``EVEN``), streamed once."""
    offs_k = k + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] + offs_k[None, :]
    if EVEN:  # no masks: N, the slices and M fill their blocks
        return tl.load(w_ptrs, eviction_policy="evict_first")
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    return tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _input_tile(x_ptr, offs_m, stride_xm, k, M, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """``x[offs_m, k : k + BLOCK_K]`` (zeros past M and K unless ``EVEN``)."""
    offs_k = k + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    if EVEN:
        return tl.load(x_ptrs)
    return tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    # program = (column block, K slice), slices fastest: neighbours read neighbouring rows
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    offs_n = (pid // SPLIT_K) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_n.to(tl.int64) * stride_wn
    k_start = split * k_per_split
    # the first weight tile is loaded before the wait (no step writes a weight): with PDL its
    # loads are in flight while the kernel before this one finishes
    w = _weight_tile(w_ptr, rows, offs_n, k_start, N, K, BLOCK_K, EVEN)
    _await_inputs(PDL)
    x = _input_tile(x_ptr, offs_m, stride_xm, k_start, M, K, BLOCK_K, EVEN)
    acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_M, BLOCK_N, K]
    for k in range(k_start + BLOCK_K, k_start + k_per_split, BLOCK_K):
        w = _weight_tile(w_ptr, rows, offs_n, k, N, K, BLOCK_K, EVEN)
        x = _input_tile(x_ptr, offs_m, stride_xm, k, M, K, BLOCK_K, EVEN)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # float32 partials [SPLIT_K, M, N]
        out = out_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(out, y, mask=mask)


@triton.jit
def _gemv_reduce_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    N,
    size,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    _await_inputs(PDL)
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # in slice order: the same sum on every run
        y += tl.load(part_ptr + s * size + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


_GEMV = Launcher(_gemv_kernel)
_REDUCE = Launcher(_gemv_reduce_kernel)
REDUCE_BLOCK = 1024


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` of at most :data:`MAX_ROWS` rows,
    ``weight [N, K]`` with unit column stride, ``bias [N]``, all of one float dtype on one
    device. Float32 accumulation; the result is rounded once to ``x``'s dtype. ``config``
    (default: :func:`default_config`) sets the launch."""
    x = check_tensor("x", x, dtypes=FLOAT_DTYPES)
    weight = check_tensor("weight", weight, dtypes=(x.dtype,), device=x.device)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim [..., in_features], got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be [out_features, {x.shape[-1]}] (x's last dim), got "
            f"{tuple(weight.shape)}"
        )
    if weight.stride(1) != 1:
        raise ValueError("weight must have unit column stride (rows contiguous in K)")
    out_features, in_features = weight.shape
    if bias is not None:
        bias = check_tensor("bias", bias, dtypes=(x.dtype,), device=x.device)
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
        bias = bias.contiguous()
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, in_features)
    if rows > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x, got {rows}: use F.linear")
    if config is not None and not isinstance(config, GemvConfig):
        raise TypeError(f"config must be a GemvConfig or None, got {type(config).__name__}")
    check_kernel_device("x", x)
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if in_features == 0:  # an empty sum
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = config or default_config(rows, out_features, in_features, sm_count(x.device))
    _launch(x2, weight, bias, out.view(rows, out_features), cfg)
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: GemvConfig,
) -> None:
    rows, (out_features, in_features) = x.shape[0], weight.shape
    block_k = min(cfg.block_k, next_power_of_2(in_features))
    split = max(1, min(cfg.split_k, triton.cdiv(in_features, block_k)))
    # every slice a whole number of loop steps; only the last may run past K (masked)
    k_per_split = triton.cdiv(triton.cdiv(in_features, split), block_k) * block_k
    split = triton.cdiv(in_features, k_per_split)
    block_m = next_power_of_2(rows)
    even = rows == block_m and out_features % cfg.block_n == 0 and in_features % k_per_split == 0
    has_bias = bias is not None
    pdl = dependent_launch(x.device)
    target = (
        out
        if split == 1
        else torch.empty((split, rows, out_features), dtype=torch.float32, device=x.device)
    )
    _GEMV(
        triton.cdiv(out_features, cfg.block_n) * split,
        (x, weight, bias if has_bias else weight, target),
        (out_features, in_features, k_per_split, x.stride(0), weight.stride(0)),
        (rows, block_m, cfg.block_n, block_k, split, has_bias, even, pdl),
        num_warps=cfg.num_warps,
        pdl=pdl,
        max_registers=None if INTERPRET else cfg.max_registers,
    )
    if split > 1:
        size = rows * out_features
        _REDUCE(
            triton.cdiv(size, REDUCE_BLOCK),
            (target, bias if has_bias else target, out),
            (out_features, size),
            (split, has_bias, REDUCE_BLOCK, pdl),
            num_warps=4,
            pdl=pdl,
        )


def gemv_wins(rows: int, weight: torch.Tensor) -> bool:
    """Whether :func:`small_batch_linear` takes the kernel: at most :data:`ROWS_USED` rows, a
    CUDA half-precision weight of at most :data:`MAX_WEIGHT_ELEMENTS` elements and at least
    :data:`MIN_IN_FEATURES` columns. Measured on the H200 (``benchmarks/bench_gemm.py --gemv``):
    cuBLAS is near the copy bandwidth on larger weights; shorter rows were not measured."""
    return (
        ENABLED
        and rows <= ROWS_USED
        and weight.is_cuda
        and weight.dtype in (torch.float16, torch.bfloat16)
        and weight.numel() <= MAX_WEIGHT_ELEMENTS
        and weight.shape[1] >= MIN_IN_FEATURES
        and weight.stride(1) == 1
    )


def small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through :func:`gemv` where :func:`gemv_wins`."""
    if gemv_wins(math.prod(x.shape[:-1]), weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
