"""The Triton kernel of paged extend attention: each request brings ``n >= 1`` new tokens (a
prompt chunk, speculative tokens to verify, or one decode token), each attending causally to its
paged context and the new tokens before it (SPEC §8.6).

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
Launched by :mod:`flashdec.kernels.paged_extend`; the tile helpers shared with decode are in
:mod:`flashdec.kernels.attention_tiles`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashdec.kernels.attention_tiles import _attend_keys, _merge_partials, _query_tile


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
                acc, m_i, l_i = _attend_keys(
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
                    True,
                    True,
                    WINDOWED,
                    UPCAST,
                    DOT_PRECISION,
                    KV_FP8,
                )
            acc, m_i, l_i = _attend_keys(
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
                False,
                False,
                False,
                UPCAST,
                DOT_PRECISION,
                KV_FP8,
            )
            acc, m_i, l_i = _attend_keys(
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
                True,
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
                        res = _merge_partials(
                            tile_po,
                            tile_pl,
                            n_split,
                            stride_pom,
                            stride_pos,
                            stride_pod,
                            stride_plm,
                            stride_pls,
                            BLOCK_M,
                            HEAD_DIM,
                            BLOCK_M,
                            BLOCK_D,
                            1,  # one split a step: 2 (32-row tiles) measured 1.09-1.14x slower
                        )
                        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_out)
            else:
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_out)
