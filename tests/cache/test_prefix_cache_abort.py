"""Automatic prefix caching across aborted steps: a cached block a step evicts comes back,
under its hash and with its bytes, when the step is taken back (BlockCache journal)."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache
from tests.cache.helpers import cached_prefix_tokens

BS, LAYERS = 2, 2


def _cache(restore_on_abort: bool = True) -> PagedKVCache:
    return PagedKVCache(
        LAYERS,
        1,
        2,
        BS,
        4,
        dtype=torch.float32,
        device="cpu",
        enable_prefix_caching=True,
        restore_on_abort=restore_on_abort,
    )


def _write(cache: PagedKVCache, tx, n: int, value: float) -> None:
    for layer in range(LAYERS):
        kv = torch.full((n, 1, 2), value + layer)
        cache.write_token_layer(tx, layer, kv, kv)


def _cached_request(cache: PagedKVCache, tokens: int = 6) -> list[bytes]:
    """Request "a" of ``tokens`` (full blocks) imported and finished: all cached, evictable."""
    hashes = cache.prefix_cache.block_hashes(list(range(tokens)))
    cache.add_request("a")
    assert cache.prefix_cache.attach_cached_prefix("a", hashes, tokens) == 0
    tx = cache.begin_tokens(["a"], [tokens])
    _write(cache, tx, tokens, 1.0)
    cache.commit_token(tx)
    cache.finish_request("a")
    assert cache.prefix_cache.stats()["cached_blocks"] == tokens // BS
    return hashes


def _blocks(cache: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for layer in range(LAYERS) for t in cache.layout.layer_kv(layer)]


def test_an_aborted_step_gives_its_evicted_block_back():
    cache = _cache()
    hashes = _cached_request(cache)
    before = _blocks(cache)
    stats = cache.prefix_cache.stats()
    cache.add_request("b")
    tx = cache.begin_tokens(["b"], [4])  # 2 blocks: 1 truly free, 1 evicted (a's first)
    assert cache.prefix_cache.stats()["evicted_blocks"] == 1
    assert cached_prefix_tokens(cache, hashes, 7) == 0
    _write(cache, tx, 4, 9.0)
    cache.abort_token(tx)
    cache.validate_invariants()
    assert cache.prefix_cache.stats() == stats
    assert all(torch.equal(x, y) for x, y in zip(before, _blocks(cache), strict=True))
    assert cached_prefix_tokens(cache, hashes, 7) == 6  # a hit again, whole
    cache.add_request("c")
    assert cache.prefix_cache.attach_cached_prefix("c", hashes, 7) == 6
    cache.validate_invariants()


def test_a_partial_commit_gives_back_the_evicted_block_it_does_not_keep():
    cache = _cache()
    hashes = _cached_request(cache, tokens=8)  # the whole pool cached: nothing truly free
    cache.add_request("b")
    tx = cache.begin_tokens(["b"], [4])  # evicts a's first two blocks
    assert cache.prefix_cache.stats()["evicted_blocks"] == 2
    _write(cache, tx, 4, 9.0)
    cache.commit_token(tx, accept=[2])  # b keeps its first block, gives the second back
    cache.validate_invariants()
    stats = cache.prefix_cache.stats()
    assert stats["evicted_blocks"] == 1 and stats["cached_blocks"] == 3
    # the free list is a stack: b took a's second block first, so it gave back a's first,
    # which is cached again (bytes put back): the chain hits through it, then stops
    assert cache.request_block_ids("b") == [1]
    assert cached_prefix_tokens(cache, hashes, 8) == BS


def test_without_restore_on_abort_the_evicted_block_stays_gone():
    """Bytes not put back: the block must not be cached again (it would serve wrong K/V)."""
    cache = _cache(restore_on_abort=False)
    hashes = _cached_request(cache)
    cache.add_request("b")
    tx = cache.begin_tokens(["b"], [4])
    _write(cache, tx, 4, 9.0)
    cache.abort_token(tx)
    cache.validate_invariants()
    stats = cache.prefix_cache.stats()
    assert stats["evicted_blocks"] == 1 and stats["cached_blocks"] == 2
    assert cached_prefix_tokens(cache, hashes, 7) == 0  # the chain's first block is gone


def test_a_begin_that_fails_evicts_nothing():
    cache = _cache()
    _cached_request(cache)
    stats = cache.prefix_cache.stats()
    cache.add_request("b")
    with pytest.raises(RuntimeError):
        cache.begin_tokens(["b"], [10])  # 5 blocks of 4: nothing taken
    assert cache.prefix_cache.stats() == stats
    cache.validate_invariants()
