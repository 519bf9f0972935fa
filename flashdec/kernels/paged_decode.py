"""Paged single-token decode attention in Triton, with split-KV and a log-sum-exp merge.

One program handles one (request, KV head, split): the G = Hq / Hkv query heads that share the
KV head are packed into one ``[BLOCK_G, D]`` tile (padded to >= 16 rows so ``tl.dot`` runs on
tensor cores), and each loop iteration gathers ``BLOCK_N`` tokens — one or several pages —
through the block table. The softmax is computed online in float32 in the log2 domain (log2(e)
is folded into the scale so the kernel uses ``exp2``).

- stage 1: per-split partial softmax. With a single split the program normalises and writes the
  output directly; otherwise it writes its normalised partial output and log2-sum-exp.
- stage 2: merge the splits of each (request, query head) by log-sum-exp. With the workspace's
  arrival counters and a ``fused_merge`` plan, in the same launch: each split, after storing its
  partials, counts itself in on its (request, KV head) counter, and the last to arrive merges
  that request's G query heads (in split order, so results are bitwise reproducible) and resets
  the counter. Otherwise a second launch merges, one program per (request, query head).

Each program derives its token range from the device-side ``seq_lens``, so a plan sized for a
maximum length serves any shorter batch without a host sync (splits past a request's end write
nothing and are skipped by the merge), and the last split also takes any tokens past the planned
range, so longer requests stay correct. Limits: head_dim <= 256; any page size; strides honoured.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from flashdec._checks import (
    FP8_DTYPE,
    PagedDecodeDims,
    check_kv_scales,
    check_paged_decode_inputs,
    check_paged_decode_stats,
    check_positive_int,
    check_tensor,
    check_window,
    resolve_sm_scale,
    same_device,
)
from flashdec.kernels._runtime import INTERPRET, Launcher, check_kernel_device
from flashdec.kernels._scales import scale_tensor
from flashdec.kernels.decode_plan import DecodePlan, DecodeWorkspace, plan_decode
from flashdec.kernels.validation import decode_metadata_stats, lookup, metadata_key, remember

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
def _online_softmax_step(
    q, k, v, mask_n, acc, m_i, l_i, qk_scale, UPCAST, DOT_PRECISION, KV_FP8: tl.constexpr
):
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        if KV_FP8:
            # e4m3 -> fp16/bf16 is exact: the dots run on q's dtype (FP8 was loaded, half the
            # bytes; fp16 with FP8_F16); the V scale is applied to the output
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            if _FP8_STAGE_K & KV_FP8:
                k = _opaque(k)
            if _FP8_STAGE_V & KV_FP8:
                v = _opaque(v)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
    if (_FP8_F16 & KV_FP8) == 0:  # else q carries the factor already
        qk = qk * qk_scale
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tokens(
    q,
    k_base,
    v_base,
    table,
    lo,
    hi,
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
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax of the packed query tile over tokens [lo, hi); returns (acc, m, l).

    Without ``WINDOWED``, ``lo`` is a multiple of ``BLOCK_N``. With it, ``lo`` may be anywhere
    (a sliding window's first position): the tiles start at ``lo`` rounded down to ``BLOCK_N``
    and the positions before ``lo`` are masked, so neither their table entries nor their K/V are
    read. Only the first tile can hold such positions, and it also holds ``lo`` itself, so every
    tile has a valid token (no all-masked row in the online softmax).

    The page ids of the next tile are loaded one iteration early, by hand: their latency then
    overlaps this tile's math instead of stalling the K/V gather that depends on them, and
    Triton's pipeliner can keep three stages of K/V loads in flight (measured 1.1-1.5x faster
    than leaving the indirection to the pipeliner; benchmarks/results/decode_tuning.md).
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if WINDOWED:
        first = lo // BLOCK_N * BLOCK_N
        block_ids = _page_ids(
            table,
            first + offs_n0,
            (first + offs_n0 >= lo) & (first + offs_n0 < hi),
            stride_btn,
            PAGE_SIZE,
        )
    else:
        first = lo
        block_ids = _page_ids(table, lo + offs_n0, lo + offs_n0 < hi, stride_btn, PAGE_SIZE)
    for start_n in range(first, hi, BLOCK_N):
        offs_n = tl.multiple_of(start_n, BLOCK_N) + offs_n0
        mask_n = offs_n < hi
        if WINDOWED:
            mask_n = mask_n & (offs_n >= lo)
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
        next_n = offs_n + BLOCK_N  # past lo: only the first tile can start before it
        block_ids = _page_ids(table, next_n, next_n < hi, stride_btn, PAGE_SIZE)
        acc, m_i, l_i = _online_softmax_step(
            q, k, v, mask_n, acc, m_i, l_i, qk_scale, UPCAST, DOT_PRECISION, KV_FP8
        )
    return acc, m_i, l_i


@triton.jit
def _merge_group(
    po_base,  # partial_out of (request, first query head of the group)
    pl_base,
    o_base,
    n_splits,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_plh,
    stride_pls,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_G: tl.constexpr,
    MERGE_S: tl.constexpr,
):
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) for the GROUP heads, by chunks of
    MERGE_S splits in split order with a running maximum M. The partials were written by other
    programs of this launch: loaded through L2 (``.cg``), never from a stale L1 line."""
    offs_g = tl.arange(0, MERGE_G)
    offs_s0 = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    m_run = tl.full([MERGE_G], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([MERGE_G], dtype=tl.float32)
    acc = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
    # not software-pipelined: each step is already one wide load, and pipeline buffers would
    # add shared memory to every stage-1 program (fewer resident per SM) for a short loop
    for s0 in tl.range(0, n_splits, MERGE_S, num_stages=1):
        offs_s = s0 + offs_s0
        mask_gs = mask_g[:, None] & (offs_s[None, :] < n_splits)  # [MERGE_G, MERGE_S]
        lse = tl.load(
            pl_base + offs_g[:, None] * stride_plh + offs_s[None, :] * stride_pls,
            mask=mask_gs,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        po_ptrs = (
            po_base
            + offs_g[:, None, None] * stride_poh
            + offs_s[None, :, None] * stride_pos
            + offs_d[None, None, :] * stride_pod
        )
        o = tl.load(
            po_ptrs,
            mask=mask_gs[:, :, None] & mask_d[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [MERGE_G, MERGE_S, BLOCK_D]
        # finite for real heads (every chunk has a split); padding rows kept at 0, not NaN
        m_new = tl.where(mask_g, tl.maximum(m_run, tl.max(lse, 1)), 0.0)
        rescale = tl.exp2(m_run - m_new)
        w = tl.where(mask_gs, tl.exp2(lse - m_new[:, None]), 0.0)
        acc = acc * rescale[:, None] + tl.sum(w[:, :, None] * o, 1)
        denom = denom * rescale + tl.sum(w, 1)
        m_run = m_new
    res = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_ptrs = o_base + offs_g[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, res.to(o_base.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,  # float32 [Hkv], read only with KV_FP8
    v_scale_ptr,
    counters_ptr,  # int32 [B, Hkv] arrivals, read only with FUSED_MERGE (zero between launches)
    qk_scale,  # sm_scale * log2(e)
    batch,
    tokens_per_split,
    num_splits,  # per-request cap (workspace size); the last split takes any excess
    num_programs,
    window,  # read only with WINDOWED
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_plb,
    stride_plh,
    stride_pls,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPLIT: tl.constexpr,  # False: one program per (request, KV head), output written directly
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, so compute in fp32
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,  # attend to the last `window` positions of each request only
    KV_FP8: tl.constexpr,  # e4m3 cache (FP8_ON + option bits): key = stored * k_scale[head]
    FUSED_MERGE: tl.constexpr,  # split path: the last split of a (request, KV head) merges
    MERGE_G: tl.constexpr,  # GROUP padded to a power of two
    MERGE_S: tl.constexpr,  # splits per merge step
):
    pid = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_gd = mask_g[:, None] & (offs_d[None, :] < HEAD_DIM)

    if not SPLIT:
        b = pid // NUM_KV_HEADS
        kv_head = pid % NUM_KV_HEADS
        seq_len = tl.load(seq_lens_ptr + b)
        lo = 0
        if WINDOWED:
            lo = tl.maximum(seq_len - window, 0)
        heads = kv_head * GROUP + offs_g
        q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q, head_qk_scale = _query_tile(
            q_ptrs, mask_gd, qk_scale, k_scale_ptr + kv_head, UPCAST, KV_FP8
        )  # [BLOCK_G, BLOCK_D]
        acc, m_i, l_i = _attend_tokens(
            q,
            k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh,
            block_tables_ptr + b * stride_btb,
            lo,
            seq_len,
            head_qk_scale,
            stride_kb,
            stride_kt,
            stride_kd,
            stride_vb,
            stride_vt,
            stride_vd,
            stride_btn,
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_G,
            BLOCK_D,
            BLOCK_N,
            UPCAST,
            DOT_PRECISION,
            WINDOWED,
            KV_FP8,
        )
        # seq_len 0 leaves acc = 0 and l = 0 -> a zero row
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * tl.load(v_scale_ptr + kv_head)
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        # Work list: request b reads tokens [base_b, len_b) (base_b = 0, or with a window its
        # first position rounded down to BLOCK_N) and has n_b = clamp(ceil((len_b - base_b) /
        # tokens_per_split), 1, num_splits) splits; items (split, KV head) are numbered over
        # the whole batch and dealt to the programs round-robin, so a long request spreads over
        # many programs and no program exists only to find its split empty.
        offs_b = tl.arange(0, BLOCK_B)
        valid_b = offs_b < batch
        lens = tl.load(seq_lens_ptr + offs_b, mask=valid_b, other=0)
        if WINDOWED:
            bases = tl.maximum(lens - window, 0) // BLOCK_N * BLOCK_N
            n_splits = tl.cdiv(lens - bases, tokens_per_split)
        else:
            n_splits = tl.cdiv(lens, tokens_per_split)
        n_splits = tl.minimum(tl.maximum(n_splits, 1), num_splits)
        n_splits = tl.where(valid_b, n_splits, 0)
        ends = tl.cumsum(n_splits, 0)  # inclusive prefix sum
        total_items = tl.sum(n_splits, 0) * NUM_KV_HEADS
        for item in range(pid, total_items, num_programs):
            kv_head = item % NUM_KV_HEADS
            s_global = item // NUM_KV_HEADS
            b = tl.sum((ends <= s_global).to(tl.int32), 0)
            sel = offs_b == b
            my_splits = tl.sum(tl.where(sel, n_splits, 0), 0)
            seq_len = tl.sum(tl.where(sel, lens, 0), 0)
            split = s_global - (tl.sum(tl.where(sel, ends, 0), 0) - my_splits)
            lo = split * tokens_per_split
            if WINDOWED:
                lo += tl.sum(tl.where(sel, bases, 0), 0)
            hi = tl.minimum(lo + tokens_per_split, seq_len)
            hi = tl.where(split == my_splits - 1, seq_len, hi)  # the last split takes the rest
            if WINDOWED:
                lo = tl.maximum(lo, seq_len - window)  # the first split starts at the window

            heads = kv_head * GROUP + offs_g
            q_ptrs = (
                q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
            )
            q, head_qk_scale = _query_tile(
                q_ptrs, mask_gd, qk_scale, k_scale_ptr + kv_head, UPCAST, KV_FP8
            )
            acc, m_i, l_i = _attend_tokens(
                q,
                k_ptr + kv_head * stride_kh,
                v_ptr + kv_head * stride_vh,
                block_tables_ptr + b * stride_btb,
                lo,
                hi,
                head_qk_scale,
                stride_kb,
                stride_kt,
                stride_kd,
                stride_vb,
                stride_vt,
                stride_vd,
                stride_btn,
                PAGE_SIZE,
                HEAD_DIM,
                BLOCK_G,
                BLOCK_D,
                BLOCK_N,
                UPCAST,
                DOT_PRECISION,
                WINDOWED,
                KV_FP8,
            )
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc / l_safe[:, None]
            if KV_FP8:
                o = o * tl.load(v_scale_ptr + kv_head)  # the merge is linear in o
            if my_splits == 1:
                # a request with one split needs no merge: write its output directly
                o_ptrs = (
                    out_ptr
                    + b * stride_ob
                    + heads[:, None] * stride_oh
                    + offs_d[None, :] * stride_od
                )
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_gd)
            else:
                # stage 1 of 2: normalised partial output and log2-sum-exp of this split
                po_ptrs = (
                    part_out_ptr
                    + b * stride_pob
                    + heads[:, None] * stride_poh
                    + split * stride_pos
                    + offs_d[None, :] * stride_pod
                )
                tl.store(po_ptrs, o, mask=mask_gd)
                pl_ptrs = part_lse_ptr + b * stride_plb + heads * stride_plh + split * stride_pls
                tl.store(pl_ptrs, m_i + tl.log2(l_safe), mask=mask_g)
                if FUSED_MERGE:
                    # every thread's stores above precede the release of the arrival (the
                    # atomic runs on one thread); the acquire side pairs with the merge's loads
                    tl.debug_barrier()
                    counter = counters_ptr + b * NUM_KV_HEADS + kv_head
                    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                    if arrived == my_splits - 1:
                        tl.store(counter, 0)  # nobody else touches it until the next launch
                        head0 = kv_head * GROUP
                        _merge_group(
                            part_out_ptr + b * stride_pob + head0 * stride_poh,
                            part_lse_ptr + b * stride_plb + head0 * stride_plh,
                            out_ptr + b * stride_ob + head0 * stride_oh,
                            my_splits,
                            stride_poh,
                            stride_pos,
                            stride_pod,
                            stride_plh,
                            stride_pls,
                            stride_oh,
                            stride_od,
                            GROUP,
                            HEAD_DIM,
                            BLOCK_D,
                            MERGE_G,
                            MERGE_S,
                        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    tokens_per_split,
    num_splits,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_pod,
    stride_plb,
    stride_plh,
    stride_pls,
    stride_ob,
    stride_oh,
    stride_od,
    window,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the decode kernel's tile: a window's range starts on a multiple
    WINDOWED: tl.constexpr,
):
    # stage 2 of 2: out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M), M = max_s lse_s
    pid = tl.program_id(0)
    b = pid // NUM_Q_HEADS
    h = pid % NUM_Q_HEADS
    seq_len = tl.load(seq_lens_ptr + b)
    read_len = seq_len  # stage 1's split count, from the same range
    if WINDOWED:
        read_len = seq_len - tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    num_valid = tl.minimum(tl.cdiv(read_len, tokens_per_split), num_splits)
    # requests with at most one split were written by stage 1 (zero rows included)
    num_valid = tl.where(num_valid > 1, num_valid, 0)

    offs_s0 = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse_base = part_lse_ptr + b * stride_plb + h * stride_plh
    po_base = part_out_ptr + b * stride_pob + h * stride_poh

    # one pass with a running maximum: chunks of BLOCK_S splits, rescaled as the max grows
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
    denom = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_valid, BLOCK_S):
        offs_s = s0 + offs_s0
        mask_s = offs_s < num_valid
        lse = tl.load(lse_base + offs_s * stride_pls, mask=mask_s, other=float("-inf"))
        po_ptrs = po_base + offs_s[:, None] * stride_pos + offs_d[None, :] * stride_pod
        o = tl.load(po_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(lse, 0))  # finite: every chunk has a valid split
        rescale = tl.exp2(m_run - m_new)
        w = tl.where(mask_s, tl.exp2(lse - m_new), 0.0)  # [BLOCK_S]
        acc = acc * rescale + tl.sum(w[:, None] * o, 0)
        denom = denom * rescale + tl.sum(w, 0)
        m_run = m_new
    res = acc / tl.where(denom > 0.0, denom, 1.0)
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_d & (num_valid > 1))


_DECODE = Launcher(_decode_kernel)
_MERGE = Launcher(_merge_splits_kernel)


def _check_plan_matches(
    plan: DecodePlan,
    dims: PagedDecodeDims,
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    kv_layout: str,
    window: int | None,
) -> None:
    """Structural agreement between a workspace's plan and this call (no host sync). Also the
    check of an :class:`~flashdec.kernels.extend_plan.ExtendPlan`, which has the same fields."""
    if (
        dims.num_q_heads == plan.num_q_heads
        and dims.num_kv_heads == plan.num_kv_heads
        and dims.head_dim == plan.head_dim
        and dims.block_size == plan.block_size
        and dims.batch <= plan.batch
        and q.dtype == plan.dtype
        and kv_layout == plan.kv_layout
        and q.device == plan.device
        and window == plan.window
        and kv_dtype == plan.cache_dtype
    ):
        return  # the common case
    for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"):
        if getattr(dims, name) != getattr(plan, name):
            raise ValueError(
                f"workspace was planned for {name}={getattr(plan, name)}, but the inputs have "
                f"{name}={getattr(dims, name)}"
            )
    if dims.batch > plan.batch:
        raise ValueError(f"workspace was planned for batch <= {plan.batch}, got {dims.batch}")
    if q.dtype != plan.dtype:
        raise TypeError(f"workspace was planned for dtype {plan.dtype}, got {q.dtype}")
    if kv_dtype != plan.cache_dtype:
        raise TypeError(
            f"workspace was planned for a {plan.cache_dtype} cache, got {kv_dtype} (pass "
            "kv_dtype= to the plan)"
        )
    if kv_layout != plan.kv_layout:
        raise ValueError(
            f"workspace was planned for kv_layout {plan.kv_layout!r}, got {kv_layout!r}"
        )
    if not same_device(q.device, plan.device):
        raise TypeError(f"workspace lives on {plan.device}, inputs on {q.device}")
    if window != plan.window:
        raise ValueError(
            f"workspace was planned for window={plan.window}, got window={window} (pass "
            "window= to the plan)"
        )


class _PlanConstants:
    """What a launch reads off its plan, computed once per plan object."""

    __slots__ = ("decode", "decode_fused", "fp8", "merge", "plan", "swap_kv", "window")

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan  # held so that the id() key cannot be reused while the entry lives
        self.fp8 = plan.cache_dtype == FP8_DTYPE
        kv_fp8 = 0
        if self.fp8:
            kv_fp8 = FP8_ON | (FP8_F16 if plan.fp8_compute == "f16" else 0)
            if not INTERPRET:  # staging is a GPU code-layout choice (same values either way)
                kv_fp8 |= _STAGING_BITS[plan.fp8_staging]
        # fp16 dots are right in the interpreter: an fp8_compute="f16" plan runs its GPU path
        upcast = INTERPRET and plan.dtype == torch.bfloat16 and not kv_fp8 & FP8_F16
        precision = "ieee" if (plan.dtype == torch.float32 or upcast) else "tf32"
        self.decode = (
            plan.num_kv_heads,
            plan.group_size,
            plan.block_size,
            plan.head_dim,
            plan.block_g,
            plan.block_d,
            plan.block_n,
            plan.block_b,
            plan.uses_split,
            upcast,
            precision,
            plan.window is not None,
            kv_fp8,
        )
        # (FUSED_MERGE, MERGE_G, MERGE_S): the merge tile only matters, and only specialises
        # the kernel, when the launch merges in place
        self.decode_fused = (*self.decode, True, plan.merge_block_g, plan.merge_chunk_splits)
        self.decode = (*self.decode, False, 1, 1)
        self.merge = (
            plan.num_q_heads,
            plan.head_dim,
            plan.block_d,
            plan.merge_block_s,
            plan.block_n,
            plan.window is not None,
        )
        self.window = 0 if plan.window is None else plan.window
        self.swap_kv = plan.kv_layout == "dim_major"  # (dim, token) strides -> (token, dim)


_CONSTANTS: dict[int, _PlanConstants] = {}


def _plan_constants(plan: DecodePlan) -> _PlanConstants:
    consts = _CONSTANTS.get(id(plan))
    if consts is None or consts.plan is not plan:
        if len(_CONSTANTS) >= 1024:
            _CONSTANTS.clear()
        consts = _CONSTANTS[id(plan)] = _PlanConstants(plan)
    return consts


def _decode_launches(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    sm_scale,
    plan,
    out,
    partial_out,
    partial_lse,
    batch,
    k_scale,
    v_scale,
    counters,
) -> tuple[tuple, tuple | None]:
    """The arguments of the decode launch and, with splits merged by a second kernel (a plan
    without ``fused_merge``, or no counters), of the merge launch."""
    consts = _plan_constants(plan)
    if not consts.fp8:  # never read: seq_lens stands in for the scale pointers
        k_scale = v_scale = seq_lens
    fused = plan.fused_merge and counters is not None
    if not fused:  # likewise for the counters
        counters = seq_lens
    skb, skh, sk2, sk3 = k_cache.stride()
    svb, svh, sv2, sv3 = v_cache.stride()
    if consts.swap_kv:
        sk2, sk3, sv2, sv3 = sk3, sk2, sv3, sv2
    splits = plan.num_splits
    if splits == 1:  # the partial buffers are not touched: out stands in for their pointers
        grid = batch * plan.num_kv_heads
        tensors = (
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            out,
            out,
            k_scale,
            v_scale,
            counters,
        )
        partial_strides = (0, 0, 0, 0, 0, 0, 0)
    else:
        grid = plan.num_programs
        tensors = (
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            partial_out,
            partial_lse,
            k_scale,
            v_scale,
            counters,
        )
        partial_strides = (*partial_out.stride(), *partial_lse.stride())
    decode_args = (
        grid,
        tensors,
        (
            sm_scale * LOG2E,
            batch,
            plan.tokens_per_split,
            splits,
            grid,
            consts.window,
            *q.stride(),
            skb,
            skh,
            sk2,
            sk3,
            svb,
            svh,
            sv2,
            sv3,
            *block_tables.stride(),
            *out.stride(),
            *partial_strides,
        ),
        consts.decode_fused if fused else consts.decode,
        plan.num_warps,
        plan.num_stages,
    )
    merge_args = None
    if splits > 1 and not fused:
        merge_args = (
            batch * plan.num_q_heads,
            (partial_out, partial_lse, seq_lens, out),
            (
                plan.tokens_per_split,
                splits,
                *partial_out.stride(),
                *partial_lse.stride(),
                *out.stride(),
                consts.window,
            ),
            consts.merge,
            4,
        )
    return decode_args, merge_args


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    plan: DecodePlan,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    batch: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Trusted launcher: no checks, no allocation, no host sync (inputs already validated).

    An FP8 plan (``kv_dtype=float8_e4m3fn``) needs ``k_scale``/``v_scale`` as contiguous
    float32 device tensors ``[num_kv_heads]`` (read on the device: CUDA-graph capturable).
    ``counters`` (a workspace's: contiguous int32 ``[>= batch, num_kv_heads]``, zero, and left
    zero) lets a ``fused_merge`` plan merge its splits in the same launch; without them a split
    plan launches a second, merge kernel."""
    if batch == 0:
        return out
    decode_args, merge_args = _decode_launches(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        sm_scale,
        plan,
        out,
        partial_out,
        partial_lse,
        batch,
        k_scale,
        v_scale,
        counters,
    )
    _DECODE(*decode_args)
    if merge_args is not None:
        _MERGE(*merge_args)
    return out


class BoundDecode:
    """:func:`launch_decode` bound to one step's metadata, plan and workspace: a call takes the
    layer's ``q, k_cache, v_cache, out`` — with the dtypes and strides of the ones it was bound
    with (a caller that cannot promise that binds again) — and launches with no per-call
    argument building. The plan's window applies; an FP8 plan's ``k_scale``/``v_scale``
    tensors are bound too (fixed addresses: update their values in place), and so are the
    workspace's ``counters`` (one launch instead of two with a ``fused_merge`` plan)."""

    __slots__ = ("decode", "merge", "single")

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        sm_scale,
        plan,
        out,
        partial_out,
        partial_lse,
        batch,
        k_scale=None,
        v_scale=None,
        counters=None,
    ) -> None:
        decode_args, merge_args = _decode_launches(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            sm_scale,
            plan,
            out,
            partial_out,
            partial_lse,
            batch,
            k_scale,
            v_scale,
            counters,
        )
        self.single = not plan.uses_split  # out also stands in for the two partial buffers
        if self.single:
            self.decode = _DECODE.bind(*decode_args, dynamic=(0, 1, 2, 5, 6, 7))
        else:
            self.decode = _DECODE.bind(*decode_args, dynamic=(0, 1, 2, 5))
        # splits merged by a second launch (a plan without fused_merge, or no counters)
        self.merge = None if merge_args is None else _MERGE.bind(*merge_args, dynamic=(3,))

    def __call__(self, q, k_cache, v_cache, out) -> torch.Tensor:
        if self.single:
            self.decode(q, k_cache, v_cache, out, out, out)
        else:
            self.decode(q, k_cache, v_cache, out)
            if self.merge is not None:
                self.merge(out)
        return out


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    block_size: int | None = None,
    num_warps: int | None = None,
    kv_layout: str = "token_major",
    num_stages: int | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention of ``q [B, Hq, D]`` over one layer's cache; returns ``[B, Hq, D]``.

    Same semantics as :func:`flashdec.paged_decode_attention_ref`. ``block_size``, if given,
    must equal the cache's page size. ``num_warps`` / ``num_stages`` override the tuned defaults.

    ``window`` (sliding-window layers): each request of length ``L`` attends only to positions
    ``[max(0, L - window), L)``. The kernel starts at the window's first block and the splits cut
    only the window, so bytes read and time follow ``min(L, window)``; table entries of blocks
    wholly before the window are never read (nor checked) and may hold anything. With a
    workspace, its plan must have been made with the same ``window``.

    FP8 KV: with ``torch.float8_e4m3fn`` caches (q and the output fp16/bf16) ``k_scale`` and
    ``v_scale`` are required — each a float or a float32 tensor ``[num_kv_heads]`` — and a key
    is ``stored.float() * k_scale[kv_head]`` (a value likewise). The kernel loads FP8 (half the
    bytes) and converts it on chip; by default (``DecodePlan.fp8_compute="f16"``) the K scale and
    softmax scale are folded into q in float32 and both dots run in fp16, so q times that
    factor must stay below 65504 (q itself may exceed fp16's range); the V scale is applied to
    the output. For CUDA-graph capture pass tensors (a float becomes a small cached device
    tensor). Float caches take no scales (ValueError); the workspace's plan must have been made
    with ``kv_dtype=torch.float8_e4m3fn``.

    With ``workspace`` (from :func:`plan_decode`) the call allocates nothing and never syncs with
    the host (CUDA-graph capturable): the split count is the plan's, the output goes to ``out``
    or ``workspace.out``, and the metadata's values are the caller's responsibility.

    Without it, the lengths and the used block ids are range-checked on the device and read back
    in one small transfer, which also sizes the plan. What that read established is cached per
    metadata tensor: a later call with the same ``block_tables`` and ``seq_lens`` objects,
    unmodified, pays no read at all. Every in-place write through PyTorch (``copy_``, indexing,
    ``out=``) invalidates the entry; a table written behind PyTorch's back (a custom kernel, a
    CUDA-graph replay, ``.data``, a NumPy/DLPack view) must be passed as a fresh tensor, or the
    cache emptied with :func:`flashdec.kernels.clear_validation_cache`. Inference-mode tensors
    are checked on every call.
    """
    dims = check_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_layout)
    check_kernel_device("q", q)
    if window is not None:
        check_window(window)
    kv_dtype = k_cache.dtype
    if k_scale is not None or v_scale is not None or kv_dtype == FP8_DTYPE:
        k_scale, v_scale = check_kv_scales(kv_dtype, k_scale, v_scale, dims.num_kv_heads, q.device)
        k_scale = scale_tensor(k_scale, dims.num_kv_heads, q.device)
        v_scale = scale_tensor(v_scale, dims.num_kv_heads, q.device)
    if block_size is not None or num_warps is not None or num_stages is not None:
        _check_overrides(dims, block_size, num_warps, num_stages)
    if dims.head_dim > 256:
        raise ValueError(f"head_dim must be <= 256, got {dims.head_dim}")
    scale = resolve_sm_scale(sm_scale, dims.head_dim)
    if out is not None:
        out = check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")

    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise TypeError(f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
        plan = workspace.plan
        _check_plan_matches(plan, dims, q, kv_dtype, kv_layout, window)
        if out is None:
            out = workspace.out if dims.batch == plan.batch else workspace.out[: dims.batch]
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
        counters = workspace.counters
    else:
        if dims.batch == 0:
            return torch.empty_like(q) if out is None else out
        plan = _validated_plan(q, kv_dtype, block_tables, seq_lens, dims, kv_layout, window)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if plan.uses_split:
            shape = (dims.batch, dims.num_q_heads, plan.num_splits)
            partial_out = torch.empty(*shape, dims.head_dim, dtype=torch.float32, device=q.device)
            partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        else:
            partial_out = partial_lse = out
        counters = None
        if plan.fused_merge:
            counters = torch.zeros(
                dims.batch, dims.num_kv_heads, dtype=torch.int32, device=q.device
            )
    if num_warps is not None or num_stages is not None:
        plan = dataclasses.replace(
            plan,
            num_warps=plan.num_warps if num_warps is None else num_warps,
            num_stages=plan.num_stages if num_stages is None else num_stages,
        )
    return launch_decode(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        plan,
        out,
        partial_out,
        partial_lse,
        dims.batch,
        k_scale,
        v_scale,
        counters,
    )


def _check_overrides(
    dims: PagedDecodeDims, block_size: object, num_warps: object, num_stages: object
) -> None:
    if block_size is not None:
        check_positive_int("block_size", block_size)
        if block_size != dims.block_size:
            raise ValueError(
                f"block_size={block_size} does not match the cache's page size {dims.block_size}"
            )
    if num_warps is not None:
        check_positive_int("num_warps", num_warps)
        if num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if num_stages is not None:
        check_positive_int("num_stages", num_stages)


def _validated_plan(
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: PagedDecodeDims,
    kv_layout: str,
    window: int | None,
) -> DecodePlan:
    """The plan of an eager call, after the metadata's range checks (cached per metadata)."""
    try:
        key = ("decode", metadata_key(block_tables), metadata_key(seq_lens), dims, kv_layout)
        key += (q.dtype, kv_dtype, window)
    except RuntimeError:  # inference tensors have no version counter: never cached
        key = None
    if key is not None:
        plan = lookup(key, block_tables, seq_lens)
        if plan is not None:
            return plan  # type: ignore[return-value]
    stats = decode_metadata_stats(block_tables, seq_lens, dims, window)
    check_paged_decode_stats(stats, dims)
    plan = _cached_plan(
        dims,
        _bucket(stats.max_len),
        _bucket(stats.total_len),
        q.dtype,
        q.device,
        kv_layout,
        window,
        kv_dtype,
    )
    if key is not None:
        remember(key, plan, block_tables, seq_lens)
    return plan


def _bucket(n: int) -> int:
    """Round up to a few significant bits so that plans are reused across nearby lengths."""
    if n <= 64:
        return n
    shift = n.bit_length() - 4
    return ((n + (1 << shift) - 1) >> shift) << shift


_PLAN_CACHE: dict[tuple, DecodePlan] = {}


def _cached_plan(
    dims: PagedDecodeDims,
    max_len: int,
    total: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_layout: str,
    window: int | None,
    kv_dtype: torch.dtype,
) -> DecodePlan:
    key = (dims.batch, dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size)
    key += (max_len, total, dtype, device, kv_layout, window, kv_dtype)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if len(_PLAN_CACHE) >= 4096:
            _PLAN_CACHE.clear()
        plan = plan_decode(
            dims.batch,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
            dims.block_size,
            max_len,
            dtype,
            device,
            kv_layout,
            max_blocks_per_seq=max(1, math.ceil(max_len / dims.block_size)),
            total_tokens=total,
            window=window,
            kv_dtype=kv_dtype,
        )
        _PLAN_CACHE[key] = plan
    return plan


paged_decode_attention = decode
