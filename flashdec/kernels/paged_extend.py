"""Paged extend attention in Triton: each request brings ``n >= 1`` new tokens (a prompt chunk,
speculative tokens to verify, or one decode token), each attending causally to its paged context
and the new tokens before it (SPEC §8.6).

One program handles one (query tile, KV head, split). A query tile is ``BLOCK_M`` rows of one
request: its new tokens times the G = Hq / Hkv query heads of the KV head (row ``r``: token
``r // G``, head ``r % G``), so every K/V tile loaded serves all G heads and a few verification
tokens still fill a tensor-core tile. The loop walks the request's KV through the block table,
``BLOCK_N`` keys per step, FlashAttention-2 style: ``tl.dot`` for QK^T and PV, the softmax online
in float32 in the log2 domain. A tile's key range is cut in three: keys before every row's window
(masked; windows only), keys every row attends (no mask at all), and the causal edge — the last
new tokens — masked per row. Keys wholly before the first row's window are never read, nor are
their table entries.

- Tiles: numbered request by request; each program finds its request by a prefix sum of the
  device-side ``query_lens`` over the batch (so any lengths run under one plan, and a CUDA
  graph replays with new ones); each request's tiles are dealt last-token first (the longest
  causal ranges start first); programs past the last tile exit at once.
- Split-KV (stage 1): a tile's key range is cut into ``tokens_per_split`` pieces; each split
  writes its normalised partial output and log2-sum-exp per row.
- Merge (stage 2, same launch): the last split of a tile to arrive (an atomic counter per tile
  and KV head) merges the splits by log-sum-exp, in split order (bitwise reproducible), and
  resets the counter.

Limits: head_dim <= 256; any page size; strides honoured; token-major and dim-major caches; FP8
(e4m3) caches beside fp16/bf16 queries (tiles converted to q's dtype on chip, the K scale folded
into the logit factor, the V scale applied to the output).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flashdec._checks import (
    FP8_DTYPE,
    PagedDecodeDims,
    check_kv_scales,
    check_paged_decode_stats,
    check_paged_extend_inputs,
    check_query_len_stats,
    check_tensor,
    check_window,
    resolve_sm_scale,
)
from flashdec.kernels._runtime import INTERPRET, Launcher, check_kernel_device
from flashdec.kernels._scales import scale_tensor
from flashdec.kernels.attention_tiles import FP8_ON, LOG2E, _load_kv_tile, _page_ids, _query_tile
from flashdec.kernels.extend_plan import (
    ExtendPlan,
    ExtendWorkspace,
    allocate_partials,
    plan_extend,
)
from flashdec.kernels.paged_decode import _bucket, _check_plan_matches
from flashdec.kernels.validation import extend_metadata_stats, lookup, metadata_key, remember


@triton.jit
def _operands(q, k, v, UPCAST, KV_FP8: tl.constexpr):
    """K/V tiles in the dots' dtype: q's (e4m3 -> fp16/bf16 is exact), or fp32 where the
    interpreter's bf16 dot is wrong."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
    return k, v


@triton.jit
def _full_step(q, k, v, acc, m_i, l_i, qk_scale, UPCAST, DOT_PRECISION, KV_FP8: tl.constexpr):
    """Online softmax over a key tile every row attends: no mask."""
    k, v = _operands(q, k, v, UPCAST, KV_FP8)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _masked_step(
    q, k, v, keep, acc, m_i, l_i, qk_scale, UPCAST, DOT_PRECISION, KV_FP8: tl.constexpr
):
    """Online softmax over a key tile with a per-row mask ``keep [BLOCK_M, BLOCK_N]``. A row may
    have no key in this tile nor before it (a split past its position): its maximum stays -inf
    and it contributes nothing (exponentials taken against 0 instead of -inf, no NaN)."""
    k, v = _operands(q, k, v, UPCAST, KV_FP8)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(
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
    WINDOWED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Keys [start, end) (start a multiple of BLOCK_N) into the running (acc, m, l).

    Without ``MASKED`` every row attends every key of the range. With it, row ``r`` keeps the
    keys in ``[row_lo[r], pos[r]]`` (``row_lo`` only when ``WINDOWED``); keys outside the tile's
    ``[lo, hi)`` are neither loaded nor their page ids read. As in decode, the page ids of the
    next tile are loaded one step early, so their latency overlaps this tile's math.
    """
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    first_n = start + offs_n0
    first_mask = (first_n >= lo) & (first_n < hi) if MASKED else first_n < end
    block_ids = _page_ids(table, first_n, first_mask, stride_btn, PAGE_SIZE)
    for start_n in range(start, end, BLOCK_N):
        offs_n = tl.multiple_of(start_n, BLOCK_N) + offs_n0
        mask_n = (offs_n >= lo) & (offs_n < hi) if MASKED else offs_n < end
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
        if MASKED:
            keep = mask_n[None, :] & (offs_n[None, :] <= pos[:, None])
            if WINDOWED:
                keep = keep & (offs_n[None, :] >= row_lo[:, None])
            acc, m_i, l_i = _masked_step(
                q, k, v, keep, acc, m_i, l_i, qk_scale, UPCAST, DOT_PRECISION, KV_FP8
            )
        else:
            acc, m_i, l_i = _full_step(
                q, k, v, acc, m_i, l_i, qk_scale, UPCAST, DOT_PRECISION, KV_FP8
            )
    return acc, m_i, l_i


@triton.jit
def _merge_tile(
    po_base,  # partial_out of (tile, KV head): [splits, BLOCK_M, D]
    pl_base,  # partial_lse of (tile, KV head): [splits, BLOCK_M]
    n_splits,
    stride_pos,
    stride_pom,
    stride_pod,
    stride_pls,
    stride_plm,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) per row, in split order with a running
    maximum M. A split with no key for a row wrote lse = -inf and weighs 0. The partials were
    written by other programs of this launch: loaded through L2 (``.cg``)."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_rd = (offs_r[:, None] >= 0) & (offs_d[None, :] < HEAD_DIM)
    rows_d = offs_r[:, None] * stride_pom + offs_d[None, :] * stride_pod  # [BLOCK_M, BLOCK_D]
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in tl.range(0, n_splits, num_stages=1):
        lse = tl.load(pl_base + s * stride_pls + offs_r * stride_plm, cache_modifier=".cg")
        o_ptrs = po_base + s * stride_pos + rows_d
        o = tl.load(o_ptrs, mask=mask_rd, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m_run - m_ref)
        w = tl.exp2(lse - m_ref)
        acc = acc * rescale[:, None] + w[:, None] * o
        denom = denom * rescale + w
        m_run = m_new
    return acc / tl.where(denom > 0.0, denom, 1.0)[:, None]


# ints that change from step to step are not specialised on (Triton would compile a kernel per
# value class: == 1, multiple of 16), so a serving run meets no compile after its warm start
@triton.jit(do_not_specialize=["batch", "num_splits", "tokens_per_split"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,  # int32 [max_tiles, Hkv] arrivals, read only with SPLIT (zero between launches)
    k_scale_ptr,  # float32 [Hkv], read only with KV_FP8
    v_scale_ptr,
    qk_scale,  # sm_scale * log2(e)
    batch,
    num_splits,
    tokens_per_split,
    window,  # read only with WINDOWED
    stride_qt,
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
    stride_sl,
    stride_ql,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pot,
    stride_poh,
    stride_pos,
    stride_pom,
    stride_pod,
    stride_plt,
    stride_plh,
    stride_pls,
    stride_plm,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SPLIT: tl.constexpr,  # False: one program per (tile, KV head), output written directly
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, so compute in fp32
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,  # query at p attends to (p - window, p] only
    KV_FP8: tl.constexpr,  # e4m3 cache: key = stored * k_scale[head], value likewise
):
    pid = tl.program_id(0)
    if SPLIT:
        split = pid % num_splits
        pid = pid // num_splits
    else:
        split = 0
    kv_head = pid % NUM_KV_HEADS
    slot = pid // NUM_KV_HEADS

    # the tile's request: tiles are numbered request by request (prefix sums over the batch)
    offs_b = tl.arange(0, BLOCK_B)
    qlens = tl.load(query_lens_ptr + offs_b * stride_ql, mask=offs_b < batch, other=0)
    n_tiles = tl.cdiv(qlens * GROUP, BLOCK_M)
    tile_ends = tl.cumsum(n_tiles, 0)
    if slot < tl.sum(n_tiles, 0):
        b = tl.sum((tile_ends <= slot).to(tl.int32), 0)
        sel = offs_b == b
        query_len = tl.sum(tl.where(sel, qlens, 0), 0)
        q_start = tl.sum(tl.where(sel, tl.cumsum(qlens, 0), 0), 0) - query_len
        # each request's tiles in reverse: its last tokens (the longest key ranges) start first
        m_tile = tl.sum(tl.where(sel, tile_ends, 0), 0) - 1 - slot
        seq_len = tl.load(seq_lens_ptr + b * stride_sl)
        context = seq_len - query_len  # tokens before the new ones
        rows = query_len * GROUP
        row0 = m_tile * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        valid_m = offs_m < rows
        row = tl.minimum(offs_m, rows - 1)  # padding rows repeat the last one (never stored)
        tok = row // GROUP
        head = kv_head * GROUP + row % GROUP
        pos = context + tok  # [BLOCK_M] each row's position: it attends keys <= pos
        t_first = row0 // GROUP
        t_last = (tl.minimum(row0 + BLOCK_M, rows) - 1) // GROUP
        hi = context + t_last + 1  # the tile's keys end after its last token
        causal_free = context + t_first + 1  # keys below: every row attends them
        if WINDOWED:
            row_lo = tl.maximum(pos - window + 1, 0)
            lo = tl.maximum(context + t_first - window + 1, 0)  # the first row's window
            window_free = tl.maximum(context + t_last - window + 1, 0)  # keys from here: all rows
        else:
            row_lo = pos  # never read
            lo = 0
            window_free = 0
        base = lo // BLOCK_N * BLOCK_N
        if SPLIT:
            n_split = tl.cdiv(hi - base, tokens_per_split)
            n_split = tl.minimum(tl.maximum(n_split, 1), num_splits)
        else:
            n_split = 1
        if split < n_split:
            if SPLIT:
                start = base + split * tokens_per_split
                end = tl.minimum(start + tokens_per_split, hi)
                end = tl.where(split == n_split - 1, hi, end)  # the last split takes the rest
            else:
                start = base
                end = hi
            offs_d = tl.arange(0, BLOCK_D)
            mask_d = offs_d < HEAD_DIM
            mask_md = (row[:, None] >= 0) & mask_d[None, :]
            q_rows = (q_start + tok).to(tl.int64)
            q_ptrs = (
                q_ptr
                + q_rows[:, None] * stride_qt
                + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd
            )
            q, head_qk_scale = _query_tile(
                q_ptrs, mask_md, qk_scale, k_scale_ptr + kv_head, UPCAST, KV_FP8
            )  # [BLOCK_M, BLOCK_D]

            # [start, c1): window edge, masked | [c1, c2): no mask | [c2, end): causal edge
            c1 = start
            if WINDOWED:
                c1 = tl.minimum(tl.maximum(tl.cdiv(window_free, BLOCK_N) * BLOCK_N, start), end)
            c2 = tl.minimum(tl.maximum(causal_free // BLOCK_N * BLOCK_N, c1), end)
            k_base = k_ptr + kv_head * stride_kh
            v_base = v_ptr + kv_head * stride_vh
            table = block_tables_ptr + b.to(tl.int64) * stride_btb
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            if WINDOWED:
                acc, m_i, l_i = _attend_range(
                    q,
                    k_base,
                    v_base,
                    table,
                    start,
                    c1,
                    lo,
                    hi,
                    row_lo,
                    pos,
                    acc,
                    m_i,
                    l_i,
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
                    BLOCK_D,
                    BLOCK_N,
                    True,
                    WINDOWED,
                    UPCAST,
                    DOT_PRECISION,
                    KV_FP8,
                )
            acc, m_i, l_i = _attend_range(
                q,
                k_base,
                v_base,
                table,
                c1,
                c2,
                lo,
                hi,
                row_lo,
                pos,
                acc,
                m_i,
                l_i,
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
                BLOCK_D,
                BLOCK_N,
                False,
                WINDOWED,
                UPCAST,
                DOT_PRECISION,
                KV_FP8,
            )
            acc, m_i, l_i = _attend_range(
                q,
                k_base,
                v_base,
                table,
                c2,
                end,
                lo,
                hi,
                row_lo,
                pos,
                acc,
                m_i,
                l_i,
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
                BLOCK_D,
                BLOCK_N,
                True,
                WINDOWED,
                UPCAST,
                DOT_PRECISION,
                KV_FP8,
            )

            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc / l_safe[:, None]
            if KV_FP8:
                o = o * tl.load(v_scale_ptr + kv_head)  # the merge is linear in o
            o_ptrs = (
                out_ptr
                + q_rows[:, None] * stride_ot
                + head[:, None] * stride_oh
                + offs_d[None, :] * stride_od
            )
            mask_out = valid_m[:, None] & mask_d[None, :]
            if SPLIT:
                if n_split == 1:
                    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_out)
                else:
                    # stage 1 of 2: this split's normalised rows and their log2-sum-exp
                    offs_r = tl.arange(0, BLOCK_M)
                    tile_po = part_out_ptr + slot.to(tl.int64) * stride_pot + kv_head * stride_poh
                    tile_pl = part_lse_ptr + slot.to(tl.int64) * stride_plt + kv_head * stride_plh
                    po_ptrs = (
                        tile_po
                        + split * stride_pos
                        + offs_r[:, None] * stride_pom
                        + offs_d[None, :] * stride_pod
                    )
                    tl.store(po_ptrs, o, mask=mask_md)
                    pl_ptrs = tile_pl + split * stride_pls + offs_r * stride_plm
                    tl.store(pl_ptrs, m_i + tl.log2(l_safe))  # -inf for a row with no key here
                    # stage 2 of 2, by the last split to arrive: every thread's stores above
                    # precede the release of the arrival (the atomic runs on one thread)
                    tl.debug_barrier()
                    counter = counters_ptr + slot * NUM_KV_HEADS + kv_head
                    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                    if arrived == n_split - 1:
                        tl.store(counter, 0)  # nobody else touches it until the next launch
                        res = _merge_tile(
                            tile_po,
                            tile_pl,
                            n_split,
                            stride_pos,
                            stride_pom,
                            stride_pod,
                            stride_pls,
                            stride_plm,
                            HEAD_DIM,
                            BLOCK_M,
                            BLOCK_D,
                        )
                        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_out)
            else:
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_out)


_EXTEND = Launcher(_extend_kernel)


class _PlanConstants:
    """What a launch reads off its plan, computed once per plan object."""

    __slots__ = ("constexprs", "fp8", "plan", "swap_kv", "window")

    def __init__(self, plan: ExtendPlan) -> None:
        self.plan = plan  # held so that the id() key cannot be reused while the entry lives
        self.fp8 = plan.cache_dtype == FP8_DTYPE
        upcast = INTERPRET and plan.dtype == torch.bfloat16
        precision = "ieee" if (plan.dtype == torch.float32 or upcast) else "tf32"
        self.constexprs = (
            plan.num_kv_heads,
            plan.group_size,
            plan.block_size,
            plan.head_dim,
            plan.block_m,
            plan.block_d,
            plan.block_n,
            plan.block_b,
            plan.uses_split,
            upcast,
            precision,
            plan.window is not None,
            FP8_ON if self.fp8 else 0,
        )
        self.window = 0 if plan.window is None else plan.window
        self.swap_kv = plan.kv_layout == "dim_major"  # (dim, token) strides -> (token, dim)


_CONSTANTS: dict[int, _PlanConstants] = {}


def _plan_constants(plan: ExtendPlan) -> _PlanConstants:
    consts = _CONSTANTS.get(id(plan))
    if consts is None or consts.plan is not plan:
        if len(_CONSTANTS) >= 1024:
            _CONSTANTS.clear()
        consts = _CONSTANTS[id(plan)] = _PlanConstants(plan)
    return consts


def launch_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float,
    plan: ExtendPlan,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    counters: torch.Tensor,
    batch: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Trusted launcher: no checks, no allocation, no host sync (inputs already validated;
    ``batch <= plan.batch`` requests, at most ``plan.total_q`` rows). A split plan needs a
    workspace's ``partial_out``/``partial_lse`` and its zeroed ``counters`` (left zero); an FP8
    plan ``k_scale``/``v_scale`` as contiguous float32 device tensors ``[num_kv_heads]``."""
    if batch == 0:
        return out
    _EXTEND(
        *extend_launch_arguments(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_lens,
            sm_scale,
            plan,
            out,
            partial_out,
            partial_lse,
            counters,
            batch,
            k_scale,
            v_scale,
        )
    )
    return out


def extend_launch_arguments(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_lens,
    sm_scale,
    plan,
    out,
    partial_out,
    partial_lse,
    counters,
    batch,
    k_scale,
    v_scale,
) -> tuple:
    """``(grid, tensors, scalars, constexprs, num_warps, num_stages)`` of the extend launch
    (also what ``benchmarks/compile_extend.py`` compiles for sm_90 without a GPU)."""
    consts = _plan_constants(plan)
    if not consts.fp8:  # never read: seq_lens stands in for the scale pointers
        k_scale = v_scale = seq_lens
    skb, skh, sk2, sk3 = k_cache.stride()
    svb, svh, sv2, sv3 = v_cache.stride()
    if consts.swap_kv:
        sk2, sk3, sv2, sv3 = sk3, sk2, sv3, sv2
    if plan.uses_split:
        partials = (partial_out, partial_lse, counters)
        partial_strides = (*partial_out.stride(), *partial_lse.stride())
    else:  # never touched: out and seq_lens stand in for their pointers
        partials = (out, out, seq_lens)
        partial_strides = (0,) * 9
    return (
        plan.num_programs,
        (q, k_cache, v_cache, block_tables, seq_lens, query_lens, out, *partials, k_scale, v_scale),
        (
            sm_scale * LOG2E,
            batch,
            plan.num_splits,
            plan.tokens_per_split,
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
            seq_lens.stride(0),
            query_lens.stride(0),
            *out.stride(),
            *partial_strides,
        ),
        consts.constexprs,
        plan.num_warps,
        plan.num_stages,
    )


def extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float | None = None,
    kv_layout: str = "token_major",
    *,
    out: torch.Tensor | None = None,
    workspace: ExtendWorkspace | None = None,
    window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged extend attention of ``q [total_q, Hq, D]`` (the new tokens' queries, packed request
    by request) over one layer's cache; returns ``[total_q, Hq, D]`` in q's dtype.

    Same semantics as :func:`flashdec.paged_extend_attention_ref`: ``query_lens [B]`` new tokens
    per request (each >= 1, summing to ``total_q``), whose K/V are already in the cache and
    counted in ``seq_lens [B]``; query ``i`` of request ``b`` is at position ``seq_lens[b] -
    query_lens[b] + i`` and attends to the positions up to its own — with ``window``, only the
    last ``window`` of them. With every query_len 1 it is :func:`flashdec.decode`'s attention.

    FP8 caches (``torch.float8_e4m3fn``, q fp16/bf16) need ``k_scale``/``v_scale``, a float or a
    float32 tensor ``[num_kv_heads]`` each, as for ``decode`` (pass tensors for CUDA graphs).

    With ``workspace`` (from :func:`~flashdec.kernels.extend_plan.plan_extend`) the call
    allocates nothing and never syncs with the host (CUDA-graph capturable): the output goes to
    ``out`` or ``workspace.out``, and the metadata's values are the caller's responsibility
    (``plan_extend``'s batch and total_q bound the call; its window and cache dtype must match).

    Without it, the lengths, the query lengths and the used block ids are checked on the device
    and read back in one small transfer, which also sizes the plan; what that read established is
    cached per unmodified metadata tensor, as for ``decode``.
    """
    dims, total_q = check_paged_extend_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_lens, kv_layout
    )
    check_kernel_device("q", q)
    if window is not None:
        check_window(window)
    kv_dtype = k_cache.dtype
    if k_scale is not None or v_scale is not None or kv_dtype == FP8_DTYPE:
        k_scale, v_scale = check_kv_scales(kv_dtype, k_scale, v_scale, dims.num_kv_heads, q.device)
        k_scale = scale_tensor(k_scale, dims.num_kv_heads, q.device)
        v_scale = scale_tensor(v_scale, dims.num_kv_heads, q.device)
    if dims.head_dim > 256:
        raise ValueError(f"head_dim must be <= 256, got {dims.head_dim}")
    scale = resolve_sm_scale(sm_scale, dims.head_dim)
    if out is not None:
        out = check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")

    if workspace is not None:
        if not isinstance(workspace, ExtendWorkspace):
            raise TypeError(f"workspace must be an ExtendWorkspace, got {type(workspace).__name__}")
        plan = workspace.plan
        _check_plan_matches(plan, dims, q, kv_dtype, kv_layout, window)
        if total_q > plan.total_q:
            raise ValueError(f"workspace was planned for total_q <= {plan.total_q}, got {total_q}")
        if out is None:
            out = workspace.out if total_q == plan.total_q else workspace.out[:total_q]
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
        counters = workspace.counters
    else:
        if dims.batch == 0:
            return torch.empty_like(q) if out is None else out
        plan = _validated_plan(
            q, kv_dtype, block_tables, seq_lens, query_lens, dims, total_q, kv_layout, window
        )
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        partial_out, partial_lse, counters = allocate_partials(plan)
    return launch_extend(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_lens,
        scale,
        plan,
        out,
        partial_out,
        partial_lse,
        counters,
        dims.batch,
        k_scale,
        v_scale,
    )


def _validated_plan(
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    dims: PagedDecodeDims,
    total_q: int,
    kv_layout: str,
    window: int | None,
) -> ExtendPlan:
    """The plan of an eager call, after the metadata's checks (cached per metadata)."""
    try:
        key = ("extend", metadata_key(block_tables), metadata_key(seq_lens))
        key += (metadata_key(query_lens), dims, total_q, kv_layout, q.dtype, kv_dtype, window)
    except RuntimeError:  # inference tensors have no version counter: never cached
        key = None
    if key is not None:
        plan = lookup(key, block_tables, seq_lens, query_lens)
        if plan is not None:
            return plan  # type: ignore[return-value]
    stats, queries = extend_metadata_stats(block_tables, seq_lens, query_lens, dims, window)
    check_query_len_stats(queries, total_q)
    check_paged_decode_stats(stats, dims)
    plan = _cached_plan(
        dims,
        total_q,
        _bucket(stats.max_len),
        _bucket(queries.max_len),
        q.dtype,
        q.device,
        kv_layout,
        window,
        kv_dtype,
    )
    if key is not None:
        remember(key, plan, block_tables, seq_lens, query_lens)
    return plan


_PLAN_CACHE: dict[tuple, ExtendPlan] = {}


def _cached_plan(
    dims: PagedDecodeDims,
    total_q: int,
    max_len: int,
    max_query_len: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_layout: str,
    window: int | None,
    kv_dtype: torch.dtype,
) -> ExtendPlan:
    key = (dims.batch, dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size)
    key += (total_q, max_len, max_query_len, dtype, device, kv_layout, window, kv_dtype)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if len(_PLAN_CACHE) >= 4096:
            _PLAN_CACHE.clear()
        plan = plan_extend(
            dims.batch,
            total_q,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
            dims.block_size,
            max_len,
            dtype,
            device,
            kv_layout,
            max_blocks_per_seq=max(1, math.ceil(max_len / dims.block_size)),
            max_query_len=min(max_query_len, total_q),
            window=window,
            kv_dtype=kv_dtype,
        )
        _PLAN_CACHE[key] = plan
    return plan


paged_extend_attention = extend
