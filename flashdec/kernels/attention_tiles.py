"""Triton device helpers shared by the paged decode and extend kernels: the log2-domain logit
factor (``LOG2E``), the bits of the kernels' ``KV_FP8`` constexpr, the page ids of token positions
through the block table, the gather of a K/V tile and the load of a packed query tile.

A kernel uses a helper by importing it by name into its own module (Triton resolves the calls of
a ``@triton.jit`` function through its module's globals).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# The kernel's KV_FP8 constexpr: 0 for a float cache; for an e4m3 cache FP8_ON plus the plan's
# options (DecodePlan.fp8_compute, fp8_staging), as bits so that no launch signature grows.
FP8_ON = 1
FP8_F16 = 2  # the dots in fp16, the logit factor folded into q (fp8_compute="f16")
FP8_STAGE_V = 4  # V converted in its load layout and staged as 16-bit (fp8_staging "v", "kv")
FP8_STAGE_K = 8  # K likewise (fp8_staging="kv")
_FP8_F16 = tl.constexpr(FP8_F16)
_FP8_STAGE_V = tl.constexpr(FP8_STAGE_V)
_FP8_STAGE_K = tl.constexpr(FP8_STAGE_K)
_STAGING_BITS = {"none": 0, "v": FP8_STAGE_V, "kv": FP8_STAGE_V | FP8_STAGE_K}


@triton.jit
def _page_ids(table, offs_n, mask_n, stride_btn, PAGE_SIZE: tl.constexpr):
    """Physical block id of every token position (int64: caches can exceed 2**31 elements)."""
    ids = tl.load(table + (offs_n // PAGE_SIZE) * stride_btn, mask=mask_n, other=0)
    return ids.to(tl.int64)


@triton.jit
def _load_kv_tile(
    k_base,
    v_base,
    block_ids,
    offs_n,
    mask_n,
    offs_d,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Gather the K and V rows of ``offs_n`` ([BLOCK_N, BLOCK_D] each; zeros where masked)."""
    in_page = offs_n % PAGE_SIZE
    if BLOCK_D == HEAD_DIM:
        kv_mask = mask_n[:, None]
    else:
        kv_mask = mask_n[:, None] & (offs_d[None, :] < HEAD_DIM)
    k_ptrs = (
        k_base
        + block_ids[:, None] * stride_kb
        + in_page[:, None] * stride_kt
        + offs_d[None, :] * stride_kd
    )
    v_ptrs = (
        v_base
        + block_ids[:, None] * stride_vb
        + in_page[:, None] * stride_vt
        + offs_d[None, :] * stride_vd
    )
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _query_tile(q_ptrs, mask_gd, qk_scale, k_scale_ptr, UPCAST, KV_FP8: tl.constexpr):
    """The packed query tile ``[BLOCK_G, BLOCK_D]`` and the factor of its logits (log2 units).

    With an FP8 cache the factor includes the head's K scale. ``FP8_F16`` folds it into q in
    float32 and rounds q to fp16 once: the tiles then convert e4m3 -> fp16 (one cvt per two
    values on sm_90, where e4m3 -> bf16 takes three), the logits need no multiply, and the PV
    dot runs in fp16 (p rounded to 11 bits instead of bf16's 8). The scaled q must stay below
    fp16's 65504 (one logit term would be 65504 * |key| log2 units, past any usable softmax).
    """
    q = tl.load(q_ptrs, mask=mask_gd, other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        if _FP8_F16 & KV_FP8:
            q = (q.to(tl.float32) * qk_scale).to(tl.float16)
    if UPCAST:
        q = q.to(tl.float32)
    return q, qk_scale
