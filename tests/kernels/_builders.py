"""Builders shared by the kernel tests."""

from __future__ import annotations

import torch


def random_paged_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int = 0,
    extra_blocks: int = 5,
):
    """Vectorised variant of tests.helpers.make_paged_kv for long sequences (GPU tests).

    Returns ``(k_cache, v_cache, block_tables, seq_lens, k_dense, v_dense)`` with token-major
    caches, permuted block ids and dense ``[B, max_len, Hkv, D]`` copies for the dense reference.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks) + extra_blocks
    max_blocks = max([1, *blocks])
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cursor = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = perm[cursor : cursor + nb].to(torch.int32)
        cursor += nb
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    tables = tables.to(device)
    max_len = max([1, *seq_lens])
    tok = torch.arange(max_len, device=device)
    ids = tables.long().clamp(min=0)[:, tok // block_size]  # [B, max_len]
    k_dense = k_cache[ids, :, tok % block_size]  # [B, max_len, Hkv, D]
    v_dense = v_cache[ids, :, tok % block_size]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens, k_dense, v_dense
