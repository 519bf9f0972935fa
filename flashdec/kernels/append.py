"""KV append kernels: scatter one token per request into a paged layer, optionally fused with RoPE.

- ``kv_append`` scatters ``k, v [B, Hkv, D]`` into a token-major layer ``[num_blocks, Hkv,
  block_size, D]`` at ``(block_ids[b], offsets[b])``; the copy is bitwise.
- ``fused_rope_kv_append`` does, in ONE launch, what a decode layer needs before attention:
  rotate q (all heads) and k at ``positions`` with split-half RoPE (as
  :func:`flashdec.apply_rope`: float32 angles ``position * base ** (-2i / rotary_dim)``, dims
  past ``rotary_dim`` unchanged), write the rotated k and the plain v into the cache, return the
  rotated q.

The public functions check every shape, dtype, device and index value (one host sync) and raise
before anything is written. The ``launch_*`` variants are for callers that validated their own
reservation (the cache): no checks, no allocation besides an optional q output, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from flashdec._checks import FLOAT_DTYPES, check_int_tensor, check_shape, check_tensor
from flashdec.kernels._runtime import INTERPRET, check_kernel_device, launch, next_power_of_2
from flashdec.reference.rope import check_rotary_dim


@triton.jit
def _kv_append_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_ids_ptr,
    offsets_ptr,
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
):
    b = tl.program_id(0)
    block = tl.load(block_ids_ptr + b).to(tl.int64)
    slot = tl.load(offsets_ptr + b)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        k_ptr + b * stride_kb + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        v_ptr + b * stride_vb + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask
    )
    kc = k_cache_ptr + block * stride_kcb + slot * stride_kct
    vc = v_cache_ptr + block * stride_vcb + slot * stride_vct
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd, k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v, mask=mask)


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
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,  # accurate sin/cos on the GPU (angles reach 1e4+ radians)
):
    b = tl.program_id(0)
    half: tl.constexpr = ROTARY_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    rot = offs_d < ROTARY_DIM
    first = offs_d < half
    # same float32 ops as the reference: angle = float(position) * inv_freq[i]
    freq_idx = tl.where(first, offs_d, offs_d - half)
    inv_freq = tl.load(inv_freq_ptr + freq_idx, mask=rot, other=0.0)
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

    # q: every query head, rotated, to q_out
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

    # k rotated, v as is, scattered into the cache slot
    block = tl.load(block_ids_ptr + b).to(tl.int64)
    slot = tl.load(offsets_ptr + b)
    offs_hk = tl.arange(0, BLOCK_HK)
    mask_k = (offs_hk[:, None] < NUM_KV_HEADS) & mask_d[None, :]
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
    tl.store(kc_ptrs, k_rot.to(k_cache_ptr.dtype.element_ty), mask=mask_k)
    v = tl.load(
        v_ptr + b * stride_vb + offs_hk[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask_k,
    )
    vc = v_cache_ptr + block * stride_vcb + slot * stride_vct
    tl.store(vc + offs_hk[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v, mask=mask_k)


_INV_FREQ_CACHE: dict[tuple[str, int, float], torch.Tensor] = {}


def _inv_freq(device: torch.device, rotary_dim: int, base: float) -> torch.Tensor:
    """float32 ``base ** (-2i / rotary_dim)``, computed once per device with the reference's ops."""
    key = (str(device), rotary_dim, float(base))
    table = _INV_FREQ_CACHE.get(key)
    if table is None:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device)
        table = 1.0 / (base ** (exponents.float() / rotary_dim))
        _INV_FREQ_CACHE[key] = table
    return table


def launch_kv_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Trusted scatter of ``k, v [B, Hkv, D]`` into the cache: no checks, no host sync."""
    batch, num_kv_heads, head_dim = k.shape
    if batch == 0:
        return
    launch(
        _kv_append_kernel,
        (batch,),
        (
            k,
            v,
            k_cache,
            v_cache,
            block_ids,
            offsets,
            *k.stride(),
            *v.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
        ),
        {
            "NUM_KV_HEADS": num_kv_heads,
            "HEAD_DIM": head_dim,
            "BLOCK_H": next_power_of_2(num_kv_heads),
            "BLOCK_D": next_power_of_2(head_dim),
        },
        num_warps=4,
    )


def launch_fused_rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int | None,
    base: float,
    q_out: torch.Tensor | None,
) -> torch.Tensor:
    """Trusted fused RoPE + append: no checks, no host sync; returns the rotated q."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if q_out is None:
        q_out = torch.empty_like(q)
    if batch == 0:
        return q_out
    launch(
        _fused_rope_kv_append_kernel,
        (batch,),
        (
            q,
            k,
            v,
            k_cache,
            v_cache,
            block_ids,
            offsets,
            positions,
            _inv_freq(q.device, rotary_dim, base),
            q_out,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *q_out.stride(),
        ),
        {
            "NUM_Q_HEADS": num_q_heads,
            "NUM_KV_HEADS": num_kv_heads,
            "HEAD_DIM": head_dim,
            "ROTARY_DIM": rotary_dim,
            "BLOCK_HQ": next_power_of_2(num_q_heads),
            "BLOCK_HK": next_power_of_2(num_kv_heads),
            "BLOCK_D": next_power_of_2(head_dim),
            "USE_LIBDEVICE": not INTERPRET,
        },
        num_warps=4,
    )
    return q_out


def _check_append_inputs(
    k_cache: object,
    v_cache: object,
    k: object,
    v: object,
    block_ids: object,
    offsets: object,
) -> None:
    """Every structural and value check of a scatter; raises before anything is written."""
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    device = k_cache.device
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    k = check_tensor("k", k, ndim=3, dtypes=(k_cache.dtype,), device=device)
    v = check_tensor("v", v, ndim=3, dtypes=(k_cache.dtype,), device=device)
    batch = k.shape[0]
    check_shape("k", k, (batch, num_kv_heads, head_dim))
    check_shape("v", v, (batch, num_kv_heads, head_dim))
    block_ids = check_int_tensor("block_ids", block_ids, ndim=1, device=device)
    offsets = check_int_tensor("offsets", offsets, ndim=1, device=device)
    check_shape("block_ids", block_ids, (batch,))
    check_shape("offsets", offsets, (batch,))
    check_kernel_device("k_cache", k_cache)
    if batch == 0:
        return
    ids = block_ids.to("cpu", torch.int64)
    offs = offsets.to("cpu", torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise ValueError(f"block_ids must lie in [0, {num_blocks}), got {ids.tolist()}")
    if int(offs.min()) < 0 or int(offs.max()) >= block_size:
        raise ValueError(f"offsets must lie in [0, {block_size}), got {offs.tolist()}")
    slots = ids * block_size + offs
    if torch.unique(slots).numel() != batch:
        raise ValueError("two rows target the same (block_id, offset) slot; each must be distinct")


def kv_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Write ``k, v [B, Hkv, D]`` into token-major ``k/v_cache [num_blocks, Hkv, block_size, D]``
    at block ``block_ids[b]``, offset ``offsets[b]`` (bitwise). Validates everything first.
    """
    _check_append_inputs(k_cache, v_cache, k, v, block_ids, offsets)
    launch_kv_append(k_cache, v_cache, k, v, block_ids, offsets)


def fused_rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int | None = None,
    base: float = 10000.0,
    *,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One kernel: rotate ``q [B, Hq, D]`` and ``k`` at ``positions [B]``, write rotated k and v
    into the cache slots, return rotated q (in ``q_out`` when given; it may be ``q`` itself).
    Validates everything first; a rejected call writes nothing.
    """
    _check_append_inputs(k_cache, v_cache, k, v, block_ids, offsets)
    q = check_tensor("q", q, ndim=3, dtypes=(k_cache.dtype,), device=k_cache.device)
    batch, _, head_dim = q.shape
    if q.shape[0] != k.shape[0] or head_dim != k.shape[2]:
        raise ValueError(
            f"q must be [batch={k.shape[0]}, num_q_heads, head_dim={k.shape[2]}], "
            f"got {tuple(q.shape)}"
        )
    positions = check_int_tensor("positions", positions, ndim=1, device=q.device)
    check_shape("positions", positions, (batch,))
    rotary_dim = check_rotary_dim(rotary_dim, head_dim)
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0:
        raise ValueError(f"base must be a float > 1, got {base!r}")
    if q_out is not None:
        q_out = check_tensor("q_out", q_out, ndim=3, dtypes=(q.dtype,), device=q.device)
        check_shape("q_out", q_out, tuple(q.shape))
    if batch and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {positions.tolist()}")
    return launch_fused_rope_kv_append(
        q, k, v, k_cache, v_cache, block_ids, offsets, positions, rotary_dim, float(base), q_out
    )
