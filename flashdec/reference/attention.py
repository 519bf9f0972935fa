"""Reference attention over a KV cache: single-token decode (dense and paged) and paged extend.

The two decode references are written differently on purpose (batched masked softmax vs a
per-request gather and explicit max-subtracted exponentials) so that each is the other's check;
the extend reference (several new tokens per request, causal among themselves) shares only the
paged gather with the second and is checked against it with one new token per request. All
compute in float32 and return q's dtype. A decode request with seq_len 0 gets an all-zero row.

``window`` (sliding-window layers, SPEC §8.2): a request of length ``L`` attends only to its last
``window`` positions, ``[max(0, L - window), L)`` — the current token and ``window - 1`` before it,
as transformers' sliding-window masks define it. ``None`` attends to all ``L``.
"""

from __future__ import annotations

import torch

from flashdec._checks import (
    FLOAT_DTYPES,
    KVScale,
    check_int_tensor,
    check_kv_scales,
    check_paged_decode_inputs,
    check_paged_decode_values,
    check_paged_extend_inputs,
    check_query_len_stats,
    check_tensor,
    check_window,
    query_len_stats,
    resolve_sm_scale,
)
from flashdec.reference.quant import dequantize_fp8


def dense_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over dense ``k/v_cache [B, max_len, Hkv, D]``.

    Only the first ``seq_lens[b]`` positions of request ``b`` are attended (of those, the last
    ``window`` when it is set).
    """
    window = check_window(window)
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    seq_lens = check_int_tensor("seq_lens", seq_lens, ndim=1, device=q.device)
    batch, num_q_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape")
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim or seq_lens.shape[0] != batch:
        raise ValueError(
            f"k/v_cache must be [batch={batch}, max_len, num_kv_heads, head_dim={head_dim}] and "
            f"seq_lens [batch], got {tuple(k_cache.shape)} and {tuple(seq_lens.shape)}"
        )
    max_len, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if batch and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_len):
        raise ValueError(f"seq_lens must lie in [0, {max_len}], got {seq_lens.tolist()}")
    scale = resolve_sm_scale(sm_scale, head_dim)
    group = num_q_heads // num_kv_heads

    qf = q.float().view(batch, num_kv_heads, group, head_dim)
    kf = k_cache.float()
    vf = v_cache.float()
    scores = torch.einsum("bhgd,blhd->bhgl", qf, kf) * scale  # [B, Hkv, G, L]
    positions = torch.arange(max_len, device=q.device)[None, :]
    valid = positions < seq_lens[:, None].long()  # [B, L]
    if window is not None:
        valid &= positions >= seq_lens[:, None].long() - window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows: all -inf -> zeros
    out = torch.einsum("bhgl,blhd->bhgd", probs, vf)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    kv_layout: str = "token_major",
    window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over one layer's paged cache.

    ``k/v_cache`` is ``[num_blocks, Hkv, block_size, D]`` (token_major) or
    ``[num_blocks, Hkv, D, block_size]`` (dim_major); token ``t`` of request ``b`` lives in block
    ``block_tables[b, t // block_size]`` at offset ``t % block_size``. With ``window`` only the
    last ``window`` tokens are gathered: table entries of blocks wholly before the window are
    never read (a sliding-window cache may have released them).

    An FP8 cache (``torch.float8_e4m3fn``, beside fp16/bf16 ``q``) needs ``k_scale`` and
    ``v_scale`` (a float or a float32 tensor ``[num_kv_heads]``): a key is
    ``stored.float() * k_scale[kv_head]`` (:func:`flashdec.reference.quant.dequantize_fp8`), a
    value likewise. A float cache takes no scales (ValueError).
    """
    window = check_window(window)
    dims = check_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_layout)
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale, dims.num_kv_heads, q.device)
    check_paged_decode_values(block_tables, seq_lens, dims, window)
    scale = resolve_sm_scale(sm_scale, dims.head_dim)
    group = dims.num_q_heads // dims.num_kv_heads
    if kv_layout == "dim_major":  # view as token-major: [N, Hkv, block_size, D]
        k_cache = k_cache.transpose(2, 3)
        v_cache = v_cache.transpose(2, 3)

    out = torch.zeros(dims.batch, dims.num_q_heads, dims.head_dim, dtype=torch.float32)
    lens = seq_lens.to("cpu").tolist()
    tables = block_tables.to("cpu").tolist()
    for b, seq_len in enumerate(lens):
        if seq_len == 0:
            continue
        first = 0 if window is None else max(0, seq_len - window)
        k, v = _gather_kv(k_cache, v_cache, tables[b], first, seq_len, k_scale, v_scale)
        for h in range(dims.num_q_heads):
            kv_head = h // group
            logits = (k[:, kv_head, :] @ q[b, h].float().cpu()) * scale  # [L]
            weights = torch.exp(logits - logits.max())
            out[b, h] = (weights @ v[:, kv_head, :]) / weights.sum()
    return out.to(device=q.device, dtype=q.dtype)


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float | None = None,
    kv_layout: str = "token_major",
    window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of several new tokens per request over one layer's paged cache (SPEC §8.6).

    ``q [total_q, Hq, D]`` holds the new tokens' queries packed request by request;
    ``query_lens [B]`` (each >= 1, summing to ``total_q``) says how many belong to each request,
    and ``seq_lens [B]`` counts them too (their K/V are already in the cache). Query ``i`` of
    request ``b`` sits at position ``p = seq_lens[b] - query_lens[b] + i`` and attends to the
    positions ``<= p`` — with a ``window``, only those ``> p - window``. Returns ``[total_q, Hq,
    D]`` in q's dtype; with every query_len 1 it is :func:`paged_decode_attention_ref`. Cache
    layouts, FP8 scales and errors as there; a query_len of 0, one above its seq_len or a sum
    other than ``total_q`` is a ValueError. Table entries of blocks wholly before the first new
    token's window are never read.
    """
    window = check_window(window)
    dims, total_q = check_paged_extend_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_lens, kv_layout
    )
    k_scale, v_scale = check_kv_scales(k_cache.dtype, k_scale, v_scale, dims.num_kv_heads, q.device)
    if dims.batch:
        check_query_len_stats(query_len_stats(query_lens, seq_lens), total_q)
    check_paged_decode_values(block_tables, seq_lens, dims, window, query_lens)
    scale = resolve_sm_scale(sm_scale, dims.head_dim)
    hkv, group = dims.num_kv_heads, dims.num_q_heads // dims.num_kv_heads
    if kv_layout == "dim_major":  # view as token-major: [N, Hkv, block_size, D]
        k_cache = k_cache.transpose(2, 3)
        v_cache = v_cache.transpose(2, 3)

    out = torch.empty(total_q, dims.num_q_heads, dims.head_dim, dtype=torch.float32)
    tables = block_tables.to("cpu").tolist()
    row = 0
    for b, (seq_len, query_len) in enumerate(
        zip(seq_lens.tolist(), query_lens.tolist(), strict=True)
    ):
        context = seq_len - query_len  # tokens before the new ones
        first = 0 if window is None else max(0, context - window + 1)
        k, v = _gather_kv(k_cache, v_cache, tables[b], first, seq_len, k_scale, v_scale)
        keys = torch.arange(first, seq_len)[None, :]  # [1, L] positions
        positions = context + torch.arange(query_len)[:, None]  # [n, 1]
        allowed = keys <= positions  # [n, L]: causal over the new tokens
        if window is not None:
            allowed &= keys > positions - window
        qb = q[row : row + query_len].float().cpu().view(query_len, hkv, group, dims.head_dim)
        logits = torch.einsum("nhgd,lhd->nhgl", qb, k) * scale
        logits = logits.masked_fill(~allowed[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # every query attends at least to itself
        attn = torch.einsum("nhgl,lhd->nhgd", probs, v)
        out[row : row + query_len] = attn.reshape(query_len, dims.num_q_heads, dims.head_dim)
        row += query_len
    return out.to(device=q.device, dtype=q.dtype)


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: list[int],
    first: int,
    last: int,
    k_scale: KVScale | None,
    v_scale: KVScale | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 CPU K and V ``[last - first, Hkv, D]`` of positions ``[first, last)`` of one
    request (token-major ``[N, Hkv, block_size, D]`` caches; FP8 ones dequantised). Only the
    table entries of those positions' blocks are read."""
    block_size = k_cache.shape[2]
    tokens = torch.arange(first, last)
    blocks = torch.tensor(table, dtype=torch.long)[tokens // block_size]
    offsets = tokens % block_size
    index = (blocks.to(k_cache.device), slice(None), offsets.to(k_cache.device))
    if k_scale is None:
        return k_cache[index].float().cpu(), v_cache[index].float().cpu()
    # gathered as bytes: indexing kernels need not support float8
    k = k_cache.view(torch.uint8)[index].cpu().view(k_cache.dtype)
    v = v_cache.view(torch.uint8)[index].cpu().view(v_cache.dtype)
    return dequantize_fp8(k, k_scale), dequantize_fp8(v, v_scale)
