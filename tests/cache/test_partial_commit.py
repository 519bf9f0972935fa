"""Partial commit: ``commit_token(tx, accept)`` keeps the first ``accept[i]`` tokens of each
request, restores the rest bit-identically and returns blocks left without a committed token."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache
from tests.cache.helpers import group_kv, request_first_block
from tests.cache.snapshot import assert_rejected, assert_same_state, snapshot
from tests.cache.util import make_cache, tokens

GROUPED = "(2,16,2,2,4):float32:2;(2,16,2,1,4):float32:1:window=6"


def _write_all(cache, tx, num_tokens: int, seed: int) -> None:
    for layer in range(cache.num_layers):
        g = cache.layout.layer_group(layer)
        spec = cache.kv_groups[g]
        gen = torch.Generator().manual_seed(seed * 100 + layer)
        shape = (num_tokens, spec.num_kv_heads, spec.head_dim)
        k = torch.randn(shape, generator=gen).to(spec.dtype)
        v = torch.randn(shape, generator=gen).to(spec.dtype)
        cache.write_token_layer(tx, layer, k, v)


def _grow(cache, rids, counts, seed):
    tx = cache.begin_tokens(rids, counts)
    _write_all(cache, tx, sum(counts), seed)
    cache.commit_token(tx)


def _blocks_held(cache, rid) -> list[int]:
    return [len(cache.request_block_ids(rid, group=g)) for g in range(cache.layout.num_groups)]


@pytest.mark.parametrize("kv_spec", [None, GROUPED])
@pytest.mark.parametrize("accept", [[0, 0], [1, 3], [4, 0], [2, 5], [4, 5]])
def test_partial_commit_equals_committing_only_the_kept_tokens(kv_spec, accept):
    """The cache after keeping ``accept`` of ``[4, 5]`` new tokens equals the cache that was
    only ever given those tokens: lengths, blocks held, free counts and every stored byte a
    request can read — and the rejected slots hold their old bytes."""

    def build():
        if kv_spec is None:
            cache = make_cache(max_blocks=16, prefix_cache_capacity_blocks=0)
        else:
            cache = PagedKVCache(kv_spec=kv_spec, device="cpu")
        for rid in ("a", "b"):
            cache.add_request(rid)
        _grow(cache, ["a", "b"], [3, 1], seed=1)  # a mid-block, b at the start of one
        return cache

    partial, whole = build(), build()
    storage_before = [
        t.clone() for g in range(partial.layout.num_groups) for t in group_kv(partial, g)
    ]
    tx = partial.begin_tokens(["a", "b"], [4, 5])
    _write_all(partial, tx, 9, seed=2)
    view = partial.commit_token(tx, accept)
    partial.validate_invariants()
    assert view.seq_lens.tolist() == [3 + accept[0], 1 + accept[1]]
    assert [partial.seq_len("a"), partial.seq_len("b")] == view.seq_lens.tolist()

    # the reference: write all 9 tokens' values, but only keep `accept` by construction
    kept = [(rid, n) for rid, n in zip(["a", "b"], accept, strict=True) if n]
    if kept:
        tx = whole.begin_tokens([rid for rid, _ in kept], [n for _, n in kept])
        _write_kept(whole, tx, accept, seed=2)
        whole.commit_token(tx)
    whole.validate_invariants()
    for rid in ("a", "b"):
        assert whole.seq_len(rid) == partial.seq_len(rid)
        assert _blocks_held(whole, rid) == _blocks_held(partial, rid)
    for g in range(partial.layout.num_groups):
        assert whole.layout.group_free_blocks(g) == partial.layout.group_free_blocks(g)
    # what each request can read is the same, and every other slot holds its old bytes
    for rid in ("a", "b"):
        assert _readable(whole, rid) == _readable(partial, rid)
    for g in range(partial.layout.num_groups):
        owned = {slot for rid in ("a", "b") for slot in _slots(partial, rid, g)}
        for now, before in zip(
            group_kv(partial, g), storage_before[2 * g : 2 * g + 2], strict=True
        ):
            changed = (now != before).any(-1).any(2).any(0)  # [L, NB, H, bs, D] -> [NB, bs]
            assert {tuple(x) for x in changed.nonzero().tolist()} <= owned


def _slots(cache, rid, g) -> list[tuple[int, int]]:
    """(block, offset) of every token of ``rid`` that group ``g`` holds."""
    bs = cache.kv_groups[g].block_size
    table = cache.block_tables([rid], group=g)[0].tolist()
    first = request_first_block(cache, rid, group=g)
    return [(table[p // bs], p % bs) for p in range(first * bs, cache.seq_len(rid))]


def _readable(cache, rid) -> list[list[float]]:
    out = []
    for g in range(cache.layout.num_groups):
        k, v = group_kv(cache, g)
        for block, offset in _slots(cache, rid, g):
            out.append(torch.cat([k[:, block, :, offset], v[:, block, :, offset]]).tolist())
    return out


def _write_kept(cache, tx, accept, seed):
    """Write, for the kept tokens only, the rows ``_write_all`` gives them in a 9-token tx."""
    for layer in range(cache.num_layers):
        g = cache.layout.layer_group(layer)
        spec = cache.kv_groups[g]
        gen = torch.Generator().manual_seed(seed * 100 + layer)
        shape = (9, spec.num_kv_heads, spec.head_dim)
        k = torch.randn(shape, generator=gen).to(spec.dtype)
        v = torch.randn(shape, generator=gen).to(spec.dtype)
        rows = [*range(accept[0]), *range(4, 4 + accept[1])]
        cache.write_token_layer(tx, layer, k[rows], v[rows])


def test_rejected_slots_are_restored_bit_identically(cache):
    cache.add_request("a")
    _grow(cache, ["a"], [1], seed=1)
    before = snapshot(cache)
    k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()
    tx = cache.begin_tokens(["a"], [3])
    _write_all(cache, tx, 3, seed=5)
    cache.commit_token(tx, [0])
    kept = ("requests", "num_free_blocks", "k", "v")  # the version and history moved on
    assert_same_state(cache, {key: before[key] for key in kept})
    assert torch.equal(cache.k_cache, k_before) and torch.equal(cache.v_cache, v_before)
    assert cache.seq_len("a") == 1
    cache.validate_invariants()


def test_one_token_transaction_takes_accept_too(cache):
    for rid in ("a", "b"):
        cache.add_request(rid)
    _grow(cache, ["a", "b"], [2, 1], seed=1)  # a at a block boundary
    free = cache.num_free_blocks
    tx = cache.begin_token(["a", "b"])
    _write_all(cache, tx, 2, seed=3)
    cache.commit_token(tx, [0, 1])
    assert (cache.seq_len("a"), cache.seq_len("b")) == (2, 2)
    assert cache.num_free_blocks == free  # a's new block went back
    cache.validate_invariants()
    # the next steps are planned afresh and stay exact
    for seed in range(4):
        tx = cache.begin_token(["a", "b"])
        _write_all(cache, tx, 2, seed=10 + seed)
        cache.commit_token(tx)
        cache.validate_invariants()
    assert (cache.seq_len("a"), cache.seq_len("b")) == (6, 6)


@pytest.mark.parametrize(
    ("accept", "error", "match"),
    [
        ("ab", TypeError, "accept must be a list or tuple"),
        ([1], ValueError, "1 entries for 2 requests"),
        ([1, -1], ValueError, r"accept\[1\] must be >= 0"),
        ([1, 3], ValueError, r"accept\[1\] = 3 is more than the 2"),
        ([True, 1], TypeError, r"accept\[0\] must be an int"),
        ([1.0, 1], TypeError, r"accept\[0\] must be an int"),
    ],
)
def test_a_bad_accept_changes_nothing_and_leaves_the_transaction_open(cache, accept, error, match):
    for rid in ("a", "b"):
        cache.add_request(rid)
    tx = cache.begin_tokens(["a", "b"], [2, 2])
    _write_all(cache, tx, 4, seed=1)
    before = snapshot(cache)
    assert_rejected(cache, error, match, lambda: cache.commit_token(tx, accept))
    assert_same_state(cache, before)
    assert cache.steps.open_transaction_id == tx.transaction_id
    cache.commit_token(tx, [2, 1])
    assert (cache.seq_len("a"), cache.seq_len("b")) == (2, 1)
    cache.validate_invariants()


def test_accept_before_every_layer_is_written_is_refused(cache):
    cache.add_request("a")
    tx = cache.begin_tokens(["a"], [2])
    cache.write_token_layer(tx, 0, tokens(cache, 2, 1), tokens(cache, 2, 2))
    with pytest.raises(RuntimeError, match="1 of 2 layers written"):
        cache.commit_token(tx, [1])
    cache.abort_token(tx)
    cache.validate_invariants()


def test_a_window_group_that_skipped_tokens_commits_whole_or_aborts():
    cache = PagedKVCache(
        kv_spec="(2,16,2,2,4):float32:1;(2,16,2,1,4):float32:1:window=3", device="cpu"
    )
    cache.add_request("a")
    tx = cache.begin_tokens(["a"], [6])  # a prompt import: the window group stores the tail
    _write_all(cache, tx, 6, seed=1)
    assert_rejected(
        cache, ValueError, "did not store every token", lambda: cache.commit_token(tx, [3])
    )
    cache.commit_token(tx, [6])
    assert cache.seq_len("a") == 6
    cache.validate_invariants()
