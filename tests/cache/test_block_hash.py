"""The chained block hash of automatic prefix caching (flashdec.cache.block_hash)."""

import time

import numpy as np
import pytest

from flashdec.cache.block_hash import DIGEST_SIZE, extra_key_hash, hash_blocks

ROOT = extra_key_hash("model", "float32", 1.0, 4)


def test_full_blocks_only_and_digest_size():
    hashes = hash_blocks(list(range(10)), 4, ROOT)
    assert len(hashes) == 2
    assert all(isinstance(h, bytes) and len(h) == DIGEST_SIZE for h in hashes)
    assert hash_blocks([1, 2, 3], 4, ROOT) == []


def test_prompts_differing_only_in_last_block():
    a = list(range(12))
    b = [*a[:8], 100, 9, 10, 11]
    ha, hb = hash_blocks(a, 4, ROOT), hash_blocks(b, 4, ROOT)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]


def test_chain_depends_on_the_parent_and_the_key():
    # the same block after a different first block hashes differently
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert a[1] != b[1]
    other = extra_key_hash("model", "bfloat16", 1.0, 4)
    assert hash_blocks([1, 2, 3, 4], 4, other) != hash_blocks([1, 2, 3, 4], 4, ROOT)
    # token values that collide under a narrow encoding (or Python's hash) stay distinct
    assert hash_blocks([-1, 0], 2, ROOT) != hash_blocks([-2, 0], 2, ROOT)
    assert hash_blocks([2**32, 0], 2, ROOT) != hash_blocks([0, 1], 2, ROOT)


def test_incremental_equals_whole():
    tokens = np.arange(50) * 7
    whole = hash_blocks(tokens, 8, ROOT)
    head = hash_blocks(tokens[:20], 8, ROOT)
    tail = hash_blocks(tokens, 8, head[-1], start_block=len(head))
    assert head + tail == whole


def test_bad_shape():
    with pytest.raises(ValueError, match="one-dimensional"):
        hash_blocks(np.zeros((2, 4)), 4, ROOT)


def test_cost_per_thousand_tokens():
    tokens = np.random.default_rng(0).integers(0, 150_000, 32768)
    best = min(_timed(tokens) for _ in range(5))
    per_thousand_ms = best / 32.768 * 1e3
    assert per_thousand_ms < 1.0, per_thousand_ms


def _timed(tokens) -> float:
    t0 = time.perf_counter()
    hash_blocks(tokens, 16, ROOT)
    return time.perf_counter() - t0
