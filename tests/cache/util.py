"""Builders shared by the cache tests: tiny CPU caches and deterministic token tensors."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache


def make_cache(**overrides) -> PagedKVCache:
    params = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 4,
        "block_size": 2,
        "max_blocks": 8,
        "dtype": torch.float32,
        "device": "cpu",
        "prefix_cache_capacity_blocks": 4,
    }
    params.update(overrides)
    if "prefix_cache_capacity_blocks" not in overrides:  # the budget cannot exceed the pool
        params["prefix_cache_capacity_blocks"] = min(4, params["max_blocks"])
    return PagedKVCache(**params)


def tokens(cache: PagedKVCache, batch: int, seed: int, heads: int | None = None) -> torch.Tensor:
    """Random ``[batch, heads (default num_kv_heads), head_dim]`` in the cache's dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads or cache.num_kv_heads, cache.head_dim)
    return torch.randn(shape, generator=gen).to(cache.dtype)


def prefix_blocks(cache: PagedKVCache, num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (cache.num_layers, num_blocks, cache.num_kv_heads, cache.block_size, cache.head_dim)
    return torch.randn(shape, generator=gen).to(cache.dtype)


def stored(cache: PagedKVCache, rid, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_layers, Hkv, D]`` of token ``position`` of ``rid``, via its block table."""
    table = cache.block_tables([rid])[0]
    block = int(table[position // cache.block_size])
    offset = position % cache.block_size
    return cache.k_cache[:, block, :, offset], cache.v_cache[:, block, :, offset]


def commit_token(cache: PagedKVCache, rids, seed: int):
    """One full transaction; returns the per-layer (k, v) written."""
    tx = cache.begin_token(rids)
    written = []
    for layer in range(cache.num_layers):
        k = tokens(cache, len(rids), seed * 100 + 2 * layer)
        v = tokens(cache, len(rids), seed * 100 + 2 * layer + 1)
        cache.write_token_layer(tx, layer, k, v)
        written.append((k, v))
    cache.commit_token(tx)
    return written


def kernels_or_skip():
    """The Triton append kernels, or skip while flashdec.kernels.append is not there yet."""
    module = pytest.importorskip("flashdec.kernels.append")
    for name in ("launch_kv_append", "launch_fused_rope_kv_append"):
        if not hasattr(module, name):
            pytest.skip(f"flashdec.kernels.append has no {name} yet")
    return module
