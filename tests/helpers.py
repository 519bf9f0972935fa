"""Builders shared by tests: random paged caches with permuted block ids, tolerances."""

from __future__ import annotations

import warnings

import torch

# (atol, rtol) per dtype for kernel-vs-reference comparisons
TOLERANCES = {
    torch.float32: (2e-3, 2e-3),  # GPU fp32 dots may run as tf32
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def device_syncs(fn) -> int:
    """How many times ``fn()`` synchronises the host with the GPU (torch's sync debug warnings)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_layout: str = "token_major",
    extra_blocks: int = 3,
    generator: torch.Generator | None = None,
):
    """Random K/V in a paged cache with randomly permuted block ids.

    Returns ``(k_cache, v_cache, block_tables, seq_lens_tensor, k_dense, v_dense)``; the dense
    tensors are ``[B, max_len, Hkv, D]`` copies of the same tokens for the dense reference.
    Table entries past each request's used blocks are filled with -1 (never read).
    """
    gen = generator or torch.Generator().manual_seed(0)
    dev = torch.device(device)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max([1, *blocks_per_seq])
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cursor = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[cursor : cursor + nb].to(torch.int32)
        cursor += nb
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=dev, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=dev, dtype=dtype)
    tables = tables.to(dev)
    # dense copies by one gather (token t of request b: block tables[b, t // bs], slot t % bs);
    # positions past a request's length hold junk and are masked by seq_lens in the references
    tok = torch.arange(max([1, *seq_lens]), device=dev)
    ids = tables.long().clamp(min=0)[:, tok // block_size]  # [B, max_len]
    k_dense = k_cache[ids, :, tok % block_size]  # [B, max_len, Hkv, D]
    v_dense = v_cache[ids, :, tok % block_size]
    if kv_layout == "dim_major":
        k_cache = k_cache.transpose(2, 3).contiguous()
        v_cache = v_cache.transpose(2, 3).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return k_cache, v_cache, tables, lens, k_dense, v_dense
