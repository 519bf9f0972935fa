"""The Triton kernels of the KV append, one program per request row: ``_kv_append_kernel``
scatters the row's K and V (every KV head) into its cache slot; ``_fused_rope_kv_append_kernel``
first rotates q (every query head, to a new tensor) and k with split-half RoPE in float32, and
can back up the slot's old bytes before it writes. A negative block id marks a padding row: its
K/V are neither read nor stored. For FP8 caches both store ``x / scale`` saturated and rounded
to nearest even. Launched by :mod:`flashdec.kernels.append`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from flashdec._checks import FP8_MAX
from flashdec.kernels._runtime import INTERPRET
from flashdec.kernels.dependent_launch import _await_inputs

_FP8_MAX = tl.constexpr(FP8_MAX)
# Triton 3.6's interpreter rounds float -> FP8 wrongly (half-up, no carry into the exponent) but
# converts exact e4m3 values exactly: when interpreting, round in float32 first
_ROUND_BY_HAND = tl.constexpr(INTERPRET)


@triton.jit
def _kv_append_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    offsets_ptr,
    k_scale_ptr,  # float32 [Hkv], read only with QUANTIZE
    v_scale_ptr,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_kcd,
    stride_vcb,
    stride_vch,
    stride_vct,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,  # FP8 cache: store x / scale, saturated
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    _await_inputs(PDL)
    block = tl.load(block_ids_ptr + b).to(tl.int64)
    slot = tl.load(offsets_ptr + b)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # a negative block id marks a padding row: nothing is read or written
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (block >= 0)
    k = tl.load(
        k_ptr + b * stride_kb + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        v_ptr + b * stride_vb + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask
    )
    if QUANTIZE:
        k = _quantize_fp8(k, k_scale_ptr, offs_h, NUM_KV_HEADS, k_cache_ptr.dtype.element_ty)
        v = _quantize_fp8(v, v_scale_ptr, offs_h, NUM_KV_HEADS, v_cache_ptr.dtype.element_ty)
    kc = k_cache_ptr + block * stride_kcb + slot * stride_kct
    vc = v_cache_ptr + block * stride_vcb + slot * stride_vct
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd, k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v, mask=mask)


@triton.jit
def _quantize_fp8(x, scale_ptr, offs_h, NUM_KV_HEADS: tl.constexpr, dtype: tl.constexpr):
    """Rows ``x [BLOCK_H, BLOCK_D]`` of heads ``offs_h`` as FP8: ``x / scale[head]`` (IEEE
    division, as the reference), saturated to +-448, rounded to nearest even."""
    scale = tl.load(scale_ptr + offs_h, mask=offs_h < NUM_KV_HEADS, other=1.0)
    y = tl.div_rn(x.to(tl.float32), scale[:, None])
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    if _ROUND_BY_HAND:
        y = _round_to_e4m3(y)
    return y.to(dtype)


@triton.jit
def _round_to_e4m3(y):
    """float32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even: the grid step
    is 2**(e - 3) for exponent e (>= -6, below which the subnormal step 2**-9 holds), and adding
    then subtracting 2**23 rounds to an integer multiple in float32's own RTNE."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    units = tl.abs(y) / step  # exact: a power-of-two step
    rounded = ((units + 8388608.0) - 8388608.0) * step
    # the sign bit put back as a bit: -0.0 and tiny negatives stay negative zeros
    return (rounded.to(tl.int32, bitcast=True) | (bits & -(2**31))).to(tl.float32, bitcast=True)


@triton.jit
def _rotate_rows(base, stride_h, stride_d, offs_h, offs_d, partner, mask, rot, cos, sin_signed):
    """Split-half RoPE of the rows ``base[offs_h, :]``: x*cos + partner*(+-sin), in float32."""
    ptrs = base + offs_h[:, None] * stride_h
    x = tl.load(ptrs + offs_d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptrs + partner[None, :] * stride_d, mask=mask & rot[None, :], other=0.0)
    rotated = x * cos[None, :] + xp.to(tl.float32) * sin_signed[None, :]
    return tl.where(rot[None, :], rotated, x)


@triton.jit
def _fused_rope_kv_append_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    offsets_ptr,
    positions_ptr,
    inv_freq_ptr,
    q_out_ptr,
    k_scale_ptr,  # float32 [Hkv], read only with QUANTIZE
    v_scale_ptr,
    backup_ptr,  # [rows * Hkv, D] this layer's K backup rows, read only with BACKUP
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_kcd,
    stride_vcb,
    stride_vch,
    stride_vct,
    stride_vcd,
    stride_qob,
    stride_qoh,
    stride_qod,
    stride_f,
    stride_br,  # backup row stride
    backup_v,  # elements from the K backup rows to the V backup rows
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,  # accurate sin/cos on the GPU (angles reach 1e4+ radians)
    QUANTIZE: tl.constexpr,  # FP8 cache: store x / scale, saturated (k from its float32 rotation)
    BACKUP: tl.constexpr,  # copy the slot's old bytes to backup row b * Hkv + h first (abort)
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    half: tl.constexpr = ROTARY_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    rot = offs_d < ROTARY_DIM
    first = offs_d < half
    # same float32 ops as the reference: angle = float(position) * inv_freq[i]
    freq_idx = tl.where(first, offs_d, offs_d - half)
    inv_freq = tl.load(inv_freq_ptr + freq_idx * stride_f, mask=rot, other=0.0)  # a constant
    _await_inputs(PDL)
    angle = tl.load(positions_ptr + b).to(tl.float32) * inv_freq
    if USE_LIBDEVICE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    sin_signed = tl.where(first, -sin, sin)  # x1' = x1 cos - x2 sin ; x2' = x2 cos + x1 sin
    partner = tl.where(first, offs_d + half, offs_d - half)
    mask_d = offs_d < HEAD_DIM

    # q: every query head, rotated, to q_out (padding rows too: q_out is always fully written)
    offs_hq = tl.arange(0, BLOCK_HQ)
    mask_q = (offs_hq[:, None] < NUM_Q_HEADS) & mask_d[None, :]
    q_rot = _rotate_rows(
        q_ptr + b * stride_qb,
        stride_qh,
        stride_qd,
        offs_hq,
        offs_d,
        partner,
        mask_q,
        rot,
        cos,
        sin_signed,
    )
    qo_ptrs = (
        q_out_ptr + b * stride_qob + offs_hq[:, None] * stride_qoh + offs_d[None, :] * stride_qod
    )
    tl.store(qo_ptrs, q_rot.to(q_out_ptr.dtype.element_ty), mask=mask_q)

    # k rotated, v as is, scattered into the cache slot; a negative block id is a padding row
    block = tl.load(block_ids_ptr + b).to(tl.int64)
    slot = tl.load(offsets_ptr + b)
    offs_hk = tl.arange(0, BLOCK_HK)
    mask_k = (offs_hk[:, None] < NUM_KV_HEADS) & mask_d[None, :] & (block >= 0)
    k_rot = _rotate_rows(
        k_ptr + b * stride_kb,
        stride_kh,
        stride_kd,
        offs_hk,
        offs_d,
        partner,
        mask_k,
        rot,
        cos,
        sin_signed,
    )
    kc = k_cache_ptr + block * stride_kcb + slot * stride_kct
    kc_ptrs = kc + offs_hk[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    vc = v_cache_ptr + block * stride_vcb + slot * stride_vct
    vc_ptrs = vc + offs_hk[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    if BACKUP:  # the same program reads the slot before it stores: no race with the write
        bk_ptrs = backup_ptr + (b * NUM_KV_HEADS + offs_hk[:, None]) * stride_br + offs_d[None, :]
        tl.store(bk_ptrs, tl.load(kc_ptrs, mask=mask_k), mask=mask_k)
        tl.store(bk_ptrs + backup_v, tl.load(vc_ptrs, mask=mask_k), mask=mask_k)
    v = tl.load(
        v_ptr + b * stride_vb + offs_hk[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask_k,
    )
    if QUANTIZE:
        k_store = _quantize_fp8(
            k_rot, k_scale_ptr, offs_hk, NUM_KV_HEADS, k_cache_ptr.dtype.element_ty
        )
        v = _quantize_fp8(v, v_scale_ptr, offs_hk, NUM_KV_HEADS, v_cache_ptr.dtype.element_ty)
    else:
        k_store = k_rot.to(k_cache_ptr.dtype.element_ty)
    tl.store(kc_ptrs, k_store, mask=mask_k)
    tl.store(vc_ptrs, v, mask=mask_k)
