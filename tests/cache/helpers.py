"""Reads of a :class:`~flashdec.PagedKVCache` that only tests need (they were cache methods that
no library code called): built on the cache's public API where it has one, else on its state."""

from __future__ import annotations

import torch

from flashdec.cache import PagedKVCache, TokenTransactionView


def decode_inputs(
    cache: PagedKVCache, tx: TokenTransactionView | int, *, group: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tables, seq_lens after)`` of an open transaction in ``group`` (the cache's own
    device tensors: read them, never write), for attending over the new tokens."""
    slots = cache.steps.transaction_slots(tx, group=group)
    return slots.block_tables[: slots.batch], slots.seq_lens_after[: slots.batch]


def request_first_block(cache: PagedKVCache, request_id: object, *, group: int = 0) -> int:
    """Logical index of the request's first held block in ``group`` (0 for full attention; a
    window group's earlier table entries are released and never read)."""
    record = cache._requests.record(request_id)
    return record.run(cache.layout._group(group).index).first_block


def group_kv(cache: PagedKVCache, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V storage of ``group``: ``[layers_in_group, num_blocks, Hkv, bs, D]`` each (the
    cache's own tensors)."""
    g = cache.layout._group(group)
    return g.k, g.v


def cached_prefix_tokens(cache: PagedKVCache, hashes: list[bytes], num_tokens: int) -> int:
    """Tokens a request of ``num_tokens`` whose full blocks hash to ``hashes`` would find cached
    now (whole blocks, at most ``num_tokens - 1``). Reads only."""
    prefix_cache = cache.prefix_cache
    prefix_cache._require_prefix_caching()
    hashes = prefix_cache._check_hashes(hashes, num_tokens)
    return prefix_cache._hit_blocks(hashes, num_tokens) * cache.block_size
