"""The repeated-batch path of one-token transactions (``BatchMemo``) and the skipped table gather:
a cache stepping the same batch again must be indistinguishable from one that re-plans every
step from the request records (``twin``: its memo is dropped after each commit)."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache
from tests.cache.snapshot import assert_rejected, snapshot
from tests.cache.util import make_cache, tokens

GROUPED = "(2,24,2,2,4):float32:2;(2,24,4,1,4):float32:1"


def _write_all(cache: PagedKVCache, tx, seed: int) -> None:
    count = len(tx.request_ids)
    for layer in range(cache.num_layers):
        g = cache.layout.layer_group(layer)
        spec = cache.kv_groups[g]
        k = tokens(cache, count, seed * 100 + 2 * layer, spec.num_kv_heads)
        v = tokens(cache, count, seed * 100 + 2 * layer + 1, spec.num_kv_heads)
        device = cache.device
        cache.write_token_layer(tx, layer, k.to(device), v.to(device))


def _observed(cache: PagedKVCache, tx, rids) -> list[torch.Tensor]:
    """Everything a step's caller and writers read: the view and every group's slots."""
    out = [tx.positions, tx.block_ids, tx.offsets, tx.seq_lens, tx.block_tables]
    for g in range(len(cache.kv_groups)):
        slots = cache.steps.transaction_slots(tx, group=g)
        batch = slots.num_rows
        # the gathered tables must equal the device tables' rows (whatever path made them)
        rows = slots.request_slots[: slots.batch]
        device_tables = cache._groups[g].tables.tensor
        assert torch.equal(slots.block_tables[: slots.batch], device_tables[rows])
        out += [
            slots.positions,
            slots.block_ids,
            slots.offsets,
            slots.seq_lens_after,
            slots.slot_rows,
            slots.block_tables[: slots.batch],
            slots.request_slots,
            torch.tensor([batch]),
        ]
        for rid in rids:
            table = cache.request_block_ids(rid, group=g)
            assert cache.seq_len(rid) <= len(table) * cache.kv_groups[g].block_size
    return [t.clone() for t in out]


def _step_both(fast: PagedKVCache, twin: PagedKVCache, rids, seed: int, **kwargs) -> bool:
    """One committed step on both caches; returns whether ``fast`` took the memo path."""
    used_memo = fast._memo is not None and fast._memo.matches(rids, fast.version)
    txs = [cache.begin_token(rids, **kwargs) for cache in (fast, twin)]
    seen = [_observed(cache, tx, rids) for cache, tx in zip((fast, twin), txs, strict=True)]
    for a, b in zip(*seen, strict=True):
        assert torch.equal(a, b)
    for cache, tx in zip((fast, twin), txs, strict=True):
        _write_all(cache, tx, seed)
        cache.commit_token(tx)
        cache.validate_invariants()
    twin._memo = None  # the twin re-plans from the records every step
    _assert_same(fast, twin)
    return used_memo


def _assert_same(fast: PagedKVCache, twin: PagedKVCache) -> None:
    a, b = snapshot(fast), snapshot(twin)
    for key in a:
        if key in ("k", "v"):
            assert torch.equal(a[key], b[key])
        elif key == "kv":
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True))
        elif key != "history":
            assert a[key] == b[key], key


def _pair(**kwargs) -> tuple[PagedKVCache, PagedKVCache]:
    return make_cache(**kwargs), make_cache(**kwargs)


@pytest.mark.parametrize(
    "kind, device",
    [
        ("single", "cpu"),
        ("grouped", "cpu"),
        pytest.param("single", "cuda", marks=pytest.mark.gpu),  # pageable staging, no events
        pytest.param("grouped", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_repeated_batch_steps_equal_replanned_steps(kind, device):
    if kind == "single":
        fast, twin = _pair(max_blocks=24, prefix_cache_capacity_blocks=0, device=device)
    else:
        fast, twin = (PagedKVCache(kv_spec=GROUPED, device=device) for _ in range(2))
    rids = ["a", "b", "c"]
    for cache in (fast, twin):
        for rid in rids:
            cache.add_request(rid)
    # a: one token ahead so the requests cross block boundaries at different steps
    for cache in (fast, twin):
        tx = cache.begin_token(["a"])
        _write_all(cache, tx, 0)
        cache.commit_token(tx)
    paths = [_step_both(fast, twin, rids, seed) for seed in range(1, 9)]
    assert paths[0] is False and all(paths[1:])  # re-planned once, then the memo every step
    # padding rows, and a tuple of the same ids (same objects): still the memo
    assert _step_both(fast, twin, tuple(rids), 20, pad_to=5)
    assert _step_both(fast, twin, rids, 21)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_inside_held_blocks_advance_the_device_metadata_in_place(device, monkeypatch):
    """Between block boundaries the last step's device metadata is moved one token on by one
    add (no packing, no copy); every step still equals the twin's re-planned upload, and an
    abort, another row count or a boundary falls back to the full upload."""
    from flashdec.cache.slots import SlotBuffers

    advanced = []
    real = SlotBuffers.advance_resident

    def spy(self, *args):
        done = real(self, *args)
        advanced.append(done)
        return done

    monkeypatch.setattr(SlotBuffers, "advance_resident", spy)
    fast, twin = _pair(block_size=8, max_blocks=24, prefix_cache_capacity_blocks=0, device=device)
    rids = ["a", "b"]
    for cache in (fast, twin):
        for rid in rids:
            cache.add_request(rid)
    for seed in range(1, 12):  # crosses the boundary at token 8
        _step_both(fast, twin, rids, seed)
    # steps 2..8 and 10..11 advance (step 1 plans and uploads, step 9 takes blocks: uploads)
    assert advanced == [True] * 9
    assert _step_both(fast, twin, rids, 30, pad_to=3)  # other rows: uploaded
    assert advanced[-1] is False
    assert _step_both(fast, twin, rids, 31, pad_to=3)  # the same rows again: advanced
    assert advanced[-1] is True
    tx = fast.begin_token(rids)  # 2 rows after 3: uploaded; then aborted (the memo goes)
    assert advanced[-1] is False
    fast.abort_token(tx)
    twin.abort_token(twin.begin_token(rids))
    calls = len(advanced)
    assert not _step_both(fast, twin, rids, 32)  # re-planned and uploaded
    assert len(advanced) == calls
    assert _step_both(fast, twin, rids, 33)
    assert advanced[-1] is True


@pytest.mark.parametrize("kind", ["single", "grouped"])
def test_memo_room_counts_down_to_each_block_boundary(kind):
    """The steady step skips the block arithmetic while every request has room in its held
    blocks: the tracked room must equal the recomputed one after every step, through several
    staggered boundaries, and the steps must match the re-planned twin."""
    if kind == "single":
        fast, twin = _pair(max_blocks=24, block_size=8, prefix_cache_capacity_blocks=0)
    else:  # block sizes 2 and 1: some request crosses a boundary at every step
        fast, twin = (PagedKVCache(kv_spec=GROUPED, device="cpu") for _ in range(2))
    rids = ["a", "b", "c"]
    for cache in (fast, twin):
        for rid in rids:
            cache.add_request(rid)
        for ahead, seed in ((["a", "b"], 0), (["a"], 1)):  # lengths 2, 1, 0: staggered
            tx = cache.begin_token(ahead)
            _write_all(cache, tx, seed)
            cache.commit_token(tx)
    skipped = 0
    for seed in range(2, 14):
        _step_both(fast, twin, rids, seed)
        memo = fast._memo
        memo.settle()
        for g, spec in enumerate(fast.kv_groups):
            expected = int((memo.held[g] * spec.block_size - memo.lens).min())
            if memo.room[g] is not None:
                assert memo.room[g] == expected
                skipped += expected > 0
            assert memo.held_list(g) == memo.held[g].tolist()
    assert bool(skipped) is (kind == "single")  # the fast path was taken where it can be


def test_any_other_change_leaves_the_memo():
    fast, twin = _pair(max_blocks=24, prefix_cache_capacity_blocks=4)
    rids = ["a", "b"]
    for c in (fast, twin):
        for rid in (*rids, "p"):
            c.add_request(rid)
    _step_both(fast, twin, rids, 1)
    assert _step_both(fast, twin, rids, 2)
    # a prompt import of another request writes the device tables: regathered, same result
    for c in (fast, twin):
        tx = c.begin_tokens(["p"], [3])
        for layer in range(c.num_layers):
            c.write_token_layer(tx, layer, *(tokens(c, 3, 7),) * 2)
        c.commit_token(tx)
    assert not _step_both(fast, twin, rids, 3)
    assert _step_both(fast, twin, rids, 4)
    # another batch in between, an abort, a finished request, an attached prefix
    assert not _step_both(fast, twin, ["b"], 5)
    assert not _step_both(fast, twin, rids, 6)
    for c in (fast, twin):
        c.abort_token(c.begin_token(rids))
    assert not _step_both(fast, twin, rids, 7)
    assert _step_both(fast, twin, rids, 8)
    for c in (fast, twin):
        c.finish_request("p")
        c.register_prefix(
            "x", tokens(c, 2, 1).new_zeros(2, 1, 2, 2, 4), tokens(c, 2, 1).new_ones(2, 1, 2, 2, 4)
        )
        c.add_request("q")
        c.attach_prefix("q", "x")
    assert not _step_both(fast, twin, [*rids, "q"], 9)
    assert _step_both(fast, twin, [*rids, "q"], 10)


def test_memo_needs_the_same_id_objects_and_types():
    cache = make_cache(max_blocks=24)
    for rid in (1, 2):
        cache.add_request(rid)
    for _ in range(2):
        tx = cache.begin_token([1, 2])
        _write_all(cache, tx, 0)
        cache.commit_token(tx)
    assert cache._memo is not None
    with pytest.raises(TypeError):
        cache.begin_token([True, 2])  # equal to 1, but not a request id
    with pytest.raises(TypeError):
        cache.begin_token("ab")
    tx = cache.begin_token([1, 2])  # the memo still serves the real batch
    assert tx.positions.tolist() == [2, 2]
    cache.abort_token(tx)


def test_full_request_and_short_pool_raise_the_general_errors_and_change_nothing():
    # 2 requests, blocks of 2, tables 3 wide: both are full after 6 tokens
    cache = make_cache(max_blocks=6, max_blocks_per_seq=3, prefix_cache_capacity_blocks=0)
    for rid in ("a", "b"):
        cache.add_request(rid)
    for seed in range(6):
        tx = cache.begin_token(["a", "b"])
        _write_all(cache, tx, seed)
        cache.commit_token(tx)
    assert cache._memo is not None
    assert_rejected(cache, RuntimeError, "is full", lambda: cache.begin_token(["a", "b"]))
    # a short pool: 3 requests of one block each, 3 blocks, all cross a boundary at once
    cache = make_cache(max_blocks=4, prefix_cache_capacity_blocks=0)
    for rid in ("a", "b", "c"):
        cache.add_request(rid)
    for seed in range(2):
        tx = cache.begin_token(["a", "b", "c"])
        _write_all(cache, tx, seed)
        cache.commit_token(tx)
    assert cache._memo is not None and cache.num_free_blocks == 1
    assert_rejected(cache, RuntimeError, "out of KV", lambda: cache.begin_token(["a", "b", "c"]))


def test_abort_of_a_repeated_step_restores_the_bytes_and_the_memo_recovers():
    cache = make_cache(max_blocks=24, prefix_cache_capacity_blocks=0)
    rids = ["a", "b"]
    for rid in rids:
        cache.add_request(rid)
    for seed in range(3):
        tx = cache.begin_token(rids)
        _write_all(cache, tx, seed)
        cache.commit_token(tx)
    before = snapshot(cache)
    tx = cache.begin_token(rids)  # the memo path, with the fixed backup buffer
    cache.write_token_layer(tx, 0, *(tokens(cache, 2, 99),) * 2)
    cache.abort_token(tx)
    after = snapshot(cache)
    assert torch.equal(before["k"], after["k"]) and torch.equal(before["v"], after["v"])
    assert after["requests"] == before["requests"]
    for seed in range(3, 7):  # crosses a boundary after the abort
        tx = cache.begin_token(rids)
        _write_all(cache, tx, seed)
        cache.commit_token(tx)
        cache.validate_invariants()
    assert [cache.seq_len(r) for r in rids] == [7, 7]


@pytest.mark.gpu
def test_pageable_upload_snapshots_the_host_bytes_when_it_is_issued():
    """The slot upload is a non_blocking copy from pageable memory with no event: CUDA stages
    the bytes before the call returns, so rewriting the staging buffer right after (as the next
    step does) must never reach the device, even with the stream still busy."""
    cache = make_cache(max_blocks=24, prefix_cache_capacity_blocks=0, device="cuda")
    rids = ["a", "b", "c"]
    for rid in rids:
        cache.add_request(rid)
    for seed in range(3):
        busy = torch.randn(4096, 4096, device="cuda")
        torch.cuda._sleep(50_000_000)  # keep the stream busy: the copy is queued behind it
        busy = busy @ busy
        tx = cache.begin_token(rids)
        buffers = cache._groups[0].slot_buffers
        expected = buffers._host.copy()
        buffers._host[:] = -7  # what the next step's packing would do
        torch.cuda.synchronize()
        assert torch.equal(buffers.device_buffer.cpu(), torch.from_numpy(expected))
        _write_all(cache, tx, seed)
        cache.commit_token(tx)
        cache.validate_invariants()
        cache._memo = None  # re-planned, so every step uploads (no on-device advance)
