"""Chained content hashes of full KV blocks, the keys of automatic prefix caching (SPEC §8.7).

Block ``i`` of a token sequence hashes ``(hash of block i-1, its block_size token ids)``, the
first block's parent being a digest of the *extra key*: everything besides the tokens that
changes the K/V a block holds (model identity, KV dtype, KV scales, block size). So two blocks
share a hash only when the whole token prefix up to and including them is the same, under the
same key. Each KV layer group keeps its own index (``flashdec.cache.block_cache``), so the group
is part of the key by construction and one chain serves every group.

Why a 128-bit BLAKE2b digest (``hashlib.blake2b(digest_size=16)``):

- A collision would silently give a request another prompt's K/V, so the hash must be
  collision resistant, not merely well spread. BLAKE2b is a cryptographic hash: no way is known
  to construct a collision faster than brute force. By the birthday bound, ``n`` distinct blocks
  collide with probability about ``n**2 / 2**129``: a pool that registers 10**9 blocks a day for
  a hundred years sees ~3.7e13 blocks, a probability below 2e-12.
- Python's ``hash()`` is unfit: 64 bits at most (birthday collisions after ~2**32 blocks, a
  day of heavy traffic), salted per process for str/bytes (unstable across processes) and
  trivially colliding for ints (``hash(-1) == hash(-2)``) and tuples built from them.
- BLAKE2b is the fastest strong hash in ``hashlib``; the token ids of a block go in as one
  little-endian int64 buffer (a numpy view, no per-token Python work), so hashing a 32k-token
  prompt costs a few microseconds per block (measured in tests/cache/test_block_hash.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

DIGEST_SIZE = 16  # bytes: 128 bits

BlockHash = bytes


def extra_key_hash(*parts: object) -> BlockHash:
    """The chain's root: a digest of everything besides the tokens that changes K/V (each part
    by its ``repr``, so pass plain values: names, dtypes, floats, ints)."""
    text = "\x1f".join(repr(p) for p in parts)
    return blake2b(text.encode(), digest_size=DIGEST_SIZE, person=b"flashdec-root").digest()


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: BlockHash,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` from block ``start_block`` on;
    ``parent`` is the hash of block ``start_block - 1`` (the root, ``extra_key_hash``, for
    block 0). A trailing partial block gets no hash."""
    tokens = np.asarray(token_ids, dtype="<i8")
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    num_full = tokens.shape[0] // block_size
    if start_block >= num_full:
        return []
    data = tokens[start_block * block_size : num_full * block_size].tobytes()
    step = block_size * 8
    out: list[BlockHash] = []
    for offset in range(0, len(data), step):
        parent = blake2b(parent + data[offset : offset + step], digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return out
