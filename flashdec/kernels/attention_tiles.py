"""Triton device helpers shared by the paged decode and extend kernels, so that a change to the
tile loop lands in both: the log2-domain logit factor (``LOG2E``), the bits of the kernels'
``KV_FP8`` constexpr, the page ids of token positions through the block table, the gather of a
K/V tile, the load of a packed query tile, one online-softmax step, the loop over a key range
and the log-sum-exp merge of split partials.

A decode program is the extend tile of one token: its rows are the G query heads of a KV head,
its key range is masked as a whole (``[lo, hi)``), never per row. An extend tile's rows are
(token, head) pairs; its causal edge and sliding windows are masked per row.

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


@triton.jit
def _opaque(x):
    """``x``, through an identity the compiler cannot see into (GPU only: no inline asm in the
    interpreter). Triton would otherwise move the conversion of a loaded e4m3 tile into the MMA
    operand layout, where V (tokens strided) is read from shared memory one byte per load and
    packed by hand; behind this, the tile is converted in its load layout (16 bytes per load)
    and reaches the operand layout through shared memory as 16-bit values (ldmatrix), as a
    bf16 tile does. Measured on sm_90 SASS: about half the instructions per FP8 byte."""
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2
    )


@triton.jit
def _operands(q, k, v, UPCAST, KV_FP8: tl.constexpr):
    """K/V tiles in the dots' dtype: q's (e4m3 -> fp16/bf16 is exact; FP8 was loaded, half the
    bytes; fp16 with ``FP8_F16``), staged in 16 bits per ``FP8_STAGE_*``; or fp32 where the
    interpreter's bf16 dot is wrong. The V scale is applied to the output, not here."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            if _FP8_STAGE_K & KV_FP8:
                k = _opaque(k)
            if _FP8_STAGE_V & KV_FP8:
                v = _opaque(v)
    return k, v


@triton.jit
def _softmax_step(
    q,
    k,
    v,
    keep,
    acc,
    m_i,
    l_i,
    qk_scale,
    MASKED: tl.constexpr,
    EMPTY_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One key tile into the running (acc, m, l) of the online softmax (log2 domain).

    With ``MASKED``, only the keys where ``keep`` (broadcast to ``[rows, BLOCK_N]``) holds count.
    With ``EMPTY_ROWS`` too, a row may have no key in this tile nor before it (an extend split
    past its position): its maximum stays -inf and it contributes nothing (exponentials taken
    against 0 instead of -inf, no NaN); without it every tile has a key for every row (decode's
    tiles each hold a token of the range). Without ``MASKED`` every key of the tile counts."""
    k, v = _operands(q, k, v, UPCAST, KV_FP8)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [rows, BLOCK_N]
    if (_FP8_F16 & KV_FP8) == 0:  # else q carries the factor already
        qk = qk * qk_scale
    if MASKED:
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if EMPTY_ROWS else m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _key_mask(offs_n, lo, hi, end, MASKED: tl.constexpr, LO_MASK: tl.constexpr):
    """The keys of ``offs_n`` that ``_attend_keys`` reads: ``[lo, hi)`` (``lo`` only with
    ``LO_MASK``) with ``MASKED``, else those before ``end``."""
    if MASKED:
        if LO_MASK:
            return (offs_n >= lo) & (offs_n < hi)
        return offs_n < hi
    return offs_n < end


@triton.jit
def _attend_keys(
    q,
    k_base,
    v_base,
    table,
    start,
    end,
    lo,
    hi,
    row_lo,
    pos,
    acc,
    m_i,
    l_i,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vd,
    stride_btn,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    LO_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    ROW_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Keys [start, end) (``start`` a multiple of ``BLOCK_N``) into the running (acc, m, l).

    Without ``MASKED`` every row attends every key of the range (whole tiles). With it, only the
    keys below ``hi``, and with ``LO_MASK`` from ``lo`` on (a window's first key, anywhere in the
    first tile), are read (neither the others' K/V nor their page ids); ``CAUSAL`` rows keep the
    keys ``<= pos[row]`` (and may have none in a tile), and ``ROW_WINDOW`` rows those ``>=
    row_lo[row]`` too (neither is read otherwise).

    The page ids of the next tile are loaded one step early, by hand: their latency then
    overlaps this tile's math instead of stalling the K/V gather that depends on them, and
    Triton's pipeliner can keep three stages of K/V loads in flight (measured 1.1-1.5x faster
    than leaving the indirection to the pipeliner; benchmarks/results/decode_tuning.md).
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    first_n = start + offs_n0
    first_mask = _key_mask(first_n, lo, hi, end, MASKED, LO_MASK)
    block_ids = _page_ids(table, first_n, first_mask, stride_btn, PAGE_SIZE)
    for start_n in range(start, end, BLOCK_N):
        offs_n = tl.multiple_of(start_n, BLOCK_N) + offs_n0
        mask_n = _key_mask(offs_n, lo, hi, end, MASKED, LO_MASK)
        k, v = _load_kv_tile(
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
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_D,
        )
        next_n = offs_n + BLOCK_N  # past lo: only a range's first tile can start before it
        block_ids = _page_ids(table, next_n, next_n < end, stride_btn, PAGE_SIZE)
        keep = mask_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= pos[:, None])
        if ROW_WINDOW:
            keep = keep & (offs_n[None, :] >= row_lo[:, None])
        acc, m_i, l_i = _softmax_step(
            q, k, v, keep, acc, m_i, l_i, qk_scale, MASKED, CAUSAL, UPCAST, DOT_PRECISION, KV_FP8
        )
    return acc, m_i, l_i


@triton.jit
def _merge_partials(
    po_base,  # partial outputs of row 0, split 0
    pl_base,  # their log2-sum-exps
    n_splits,
    stride_por,
    stride_pos,
    stride_pod,
    stride_plr,
    stride_pls,
    ROWS: tl.constexpr,  # the rows that exist (< BLOCK_R: padding rows read nothing)
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_S: tl.constexpr,  # splits per step: one wide load each
):
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) per row, in split order, by chunks of
    ``MERGE_S`` splits with a running maximum M: ``[BLOCK_R, BLOCK_D]`` float32. A split with no
    key for a row wrote lse = -inf and weighs 0 (a row with none at all merges to 0). The
    partials were written by other programs of this launch: loaded through L2 (``.cg``), never
    from a stale L1 line."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_s0 = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < ROWS
    mask_d = offs_d < HEAD_DIM
    m_run = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    if MERGE_S == 1:
        # one split a step in 2-D tiles: the 3-D chunk's size-1 axis costs registers (a
        # 128-row split extend tile compiled to 252 instead of 225 on sm_90)
        mask_rd = mask_r[:, None] & mask_d[None, :]
        rows_d = offs_r[:, None] * stride_por + offs_d[None, :] * stride_pod
        for s in tl.range(0, n_splits, num_stages=1):
            lse = tl.load(
                pl_base + s * stride_pls + offs_r * stride_plr,
                mask=mask_r,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            o = tl.load(
                po_base + s * stride_pos + rows_d, mask=mask_rd, other=0.0, cache_modifier=".cg"
            )
            m_new = tl.maximum(m_run, lse)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            rescale = tl.exp2(m_run - m_ref)
            w = tl.exp2(lse - m_ref)
            acc = acc * rescale[:, None] + w[:, None] * o
            denom = denom * rescale + w
            m_run = m_new
    else:
        # a finite start instead of -inf: a row with no key yet then weighs 0 (exp2(-inf - m)
        # = 0) with no guard in the step. The guard (an extra select on the running maximum)
        # made ptxas interleave this loop's loads with its math, about ten L2 round trips a step
        # instead of one (sm_90 SASS; the MQA 32/1/128 B=32 L=4096 decode row, 36.0 -> 41.6 us)
        m_run = tl.full([BLOCK_R], -3.0e38, dtype=tl.float32)
        # not software-pipelined: each step is already one wide load, and pipeline buffers would
        # add shared memory to every stage-1 program (fewer resident per SM) for a short loop
        for s0 in tl.range(0, n_splits, MERGE_S, num_stages=1):
            offs_s = s0 + offs_s0
            mask_rs = mask_r[:, None] & (offs_s[None, :] < n_splits)  # [BLOCK_R, MERGE_S]
            lse = tl.load(
                pl_base + offs_r[:, None] * stride_plr + offs_s[None, :] * stride_pls,
                mask=mask_rs,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            po_ptrs = (
                po_base
                + offs_r[:, None, None] * stride_por
                + offs_s[None, :, None] * stride_pos
                + offs_d[None, None, :] * stride_pod
            )
            o = tl.load(
                po_ptrs,
                mask=mask_rs[:, :, None] & mask_d[None, None, :],
                other=0.0,
                cache_modifier=".cg",
            )  # [BLOCK_R, MERGE_S, BLOCK_D]
            m_new = tl.maximum(m_run, tl.max(lse, 1))
            rescale = tl.exp2(m_run - m_new)
            w = tl.exp2(lse - m_new[:, None])
            acc = acc * rescale[:, None] + tl.sum(w[:, :, None] * o, 1)
            denom = denom * rescale + tl.sum(w, 1)
            m_run = m_new
    return acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
