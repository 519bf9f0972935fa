"""The Triton kernels of paged single-token decode attention: split-KV and a log-sum-exp merge.

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
Launched by :mod:`flashdec.kernels.paged_decode`; the tile helpers shared with extend are in
:mod:`flashdec.kernels.attention_tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdec.kernels.attention_tiles import _attend_keys, _merge_partials, _query_tile
from flashdec.kernels.dependent_launch import _await_inputs


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
    PDL: tl.constexpr,  # wait for the kernel before (dependent launch) before reading anything
):
    _await_inputs(PDL)
    pid = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_gd = mask_g[:, None] & (offs_d[None, :] < HEAD_DIM)

    if SPLIT:
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
        item_step = num_programs
    else:  # one item per program: a (request, KV head) and all of its tokens
        total_items = pid + 1
        item_step = 1
    for item in range(pid, total_items, item_step):
        kv_head = item % NUM_KV_HEADS
        if SPLIT:
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
        else:
            b = item // NUM_KV_HEADS
            my_splits = 1
            split = 0
            seq_len = tl.load(seq_lens_ptr + b)
            lo = 0
            hi = seq_len
        if WINDOWED:
            lo = tl.maximum(lo, seq_len - window)  # the first split starts at the window

        heads = kv_head * GROUP + offs_g
        q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q, head_qk_scale = _query_tile(
            q_ptrs, mask_gd, qk_scale, k_scale_ptr + kv_head, UPCAST, KV_FP8
        )  # [BLOCK_G, BLOCK_D]
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        # the range is masked as a whole (no per-row bound): with a window, lo may sit anywhere
        # in the first tile, whose keys before lo are neither read nor their page ids
        acc, m_i, l_i = _attend_keys(
            q,
            k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh,
            block_tables_ptr + b * stride_btb,
            lo // BLOCK_N * BLOCK_N,
            hi,
            lo,
            hi,
            lo,  # no per-row bounds: never read
            lo,
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
            False,
            False,
            UPCAST,
            DOT_PRECISION,
            KV_FP8,
        )
        # seq_len 0 leaves acc = 0 and l = 0 -> a zero row
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        if KV_FP8:
            o = o * tl.load(v_scale_ptr + kv_head)  # the merge is linear in o
        if my_splits == 1:
            # a request with one split needs no merge: write its output directly
            o_ptrs = (
                out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
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
                # every thread's stores above precede the release of the arrival (the atomic
                # runs on one thread); the acquire side pairs with the merge's loads
                tl.debug_barrier()
                counter = counters_ptr + b * NUM_KV_HEADS + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == my_splits - 1:
                    tl.store(counter, 0)  # nobody else touches it until the next launch
                    head0 = kv_head * GROUP
                    res = _merge_partials(
                        part_out_ptr + b * stride_pob + head0 * stride_poh,
                        part_lse_ptr + b * stride_plb + head0 * stride_plh,
                        my_splits,
                        stride_poh,
                        stride_pos,
                        stride_pod,
                        stride_plh,
                        stride_pls,
                        GROUP,
                        HEAD_DIM,
                        MERGE_G,
                        BLOCK_D,
                        MERGE_S,
                    )
                    offs_mg = tl.arange(0, MERGE_G)
                    o_ptrs = (
                        out_ptr
                        + b * stride_ob
                        + (head0 + offs_mg)[:, None] * stride_oh
                        + offs_d[None, :] * stride_od
                    )
                    mask_out = (offs_mg < GROUP)[:, None] & (offs_d[None, :] < HEAD_DIM)
                    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_out)


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
    D_CHUNKS: tl.constexpr,  # programs per (request, query head), each MERGE_D dims
    MERGE_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the decode kernel's tile: a window's range starts on a multiple
    WINDOWED: tl.constexpr,
    PDL: tl.constexpr,
):
    _await_inputs(PDL)
    # stage 2 of 2: out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M), M = max_s lse_s.
    # One program per (request, query head, slice of MERGE_D dims): a split launch is used
    # where few (request, head) pairs merge many splits (MQA or small KV at batch 1), so the
    # head dimension is cut too, and one wide load usually covers every split.
    pid = tl.program_id(0)
    d_chunk = pid % D_CHUNKS
    b = pid // (D_CHUNKS * NUM_Q_HEADS)
    h = pid // D_CHUNKS % NUM_Q_HEADS
    seq_len = tl.load(seq_lens_ptr + b)
    read_len = seq_len  # stage 1's split count, from the same range
    if WINDOWED:
        read_len = seq_len - tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    num_valid = tl.minimum(tl.cdiv(read_len, tokens_per_split), num_splits)
    # requests with at most one split were written by stage 1 (zero rows included)
    num_valid = tl.where(num_valid > 1, num_valid, 0)

    offs_s0 = tl.arange(0, BLOCK_S)
    offs_d = d_chunk * MERGE_D + tl.arange(0, MERGE_D)
    mask_d = offs_d < HEAD_DIM
    lse_base = part_lse_ptr + b * stride_plb + h * stride_plh
    po_base = part_out_ptr + b * stride_pob + h * stride_poh

    # one pass with a running maximum: chunks of BLOCK_S splits, rescaled as the max grows
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
    denom = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    acc = tl.zeros([MERGE_D], dtype=tl.float32)
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
