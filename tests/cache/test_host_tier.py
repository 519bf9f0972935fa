"""The host tier of automatic prefix caching (``PagedKVCache(host_kv_cache_bytes=)``): a cached
block the GPU pool evicts is copied down, keyed by its hash; a later hit copies it up into a new
block with the same bytes; the host pool drops its least recently used entries when full; a
copy that fails falls back to recomputing, never to wrong bytes; a rejected constructor
argument is a clear error."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache
from flashdec.cache.block_transfer import BlockTransfer, slot_runs
from flashdec.cache.host_tier import HostBlockPool
from tests.cache.helpers import cached_prefix_tokens

BS, LAYERS, HEADS, DIM = 2, 2, 2, 4
BLOCK_BYTES = 2 * LAYERS * HEADS * BS * DIM * 4  # float32, K and V


def _cache(num_blocks: int = 4, host_blocks: int = 8, **kw) -> PagedKVCache:
    return PagedKVCache(
        LAYERS,
        HEADS,
        DIM,
        BS,
        num_blocks,
        dtype=kw.pop("dtype", torch.float32),
        device="cpu",
        enable_prefix_caching=True,
        host_kv_cache_bytes=host_blocks * BLOCK_BYTES,
        **kw,
    )


def _import(cache: PagedKVCache, rid: str, tokens: list[int], seed: int) -> list[bytes]:
    """Request ``rid`` with prompt ``tokens`` (full blocks) starting from what is cached, its
    other tokens written with random K/V, then finished: all its blocks cached, evictable."""
    hashes = cache.prefix_cache.block_hashes(tokens)
    cache.add_request(rid)
    hit = cache.prefix_cache.attach_cached_prefix(rid, hashes, len(tokens))
    n = len(tokens) - hit
    if n:
        tx = cache.begin_tokens([rid], [n])
        gen = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            k, v = (torch.randn(n, HEADS, DIM, generator=gen) for _ in range(2))
            cache.write_token_layer(tx, layer, k, v)
        cache.commit_token(tx)
    cache.prefix_cache.cache_request_blocks(rid)
    cache.finish_request(rid)
    return hashes


def _block_bytes(cache: PagedKVCache, block_ids: list[int]) -> list[torch.Tensor]:
    """K and V of ``block_ids`` in every layer (copies)."""
    return [t[:, block_ids].clone() for t in (cache.layout._group(0).k, cache.layout._group(0).v)]


def test_an_evicted_block_comes_back_from_the_host_with_its_bytes():
    cache = _cache()
    a = list(range(8))  # 4 blocks: the whole pool
    hashes = _import(cache, "a", a, seed=1)
    request_blocks = [cache.layout._group(0).block_cache.block(h) for h in hashes]
    before = _block_bytes(cache, request_blocks)
    _import(cache, "b", list(range(100, 108)), seed=2)  # evicts every block of a
    stats = cache.prefix_cache.stats()
    assert stats["evicted_blocks"] == 4
    assert stats["host"]["blocks_down"] == 4
    assert stats["host"]["bytes_down"] == 4 * BLOCK_BYTES
    assert stats["host"]["cached_blocks"] == 4
    # a again (one more token): 4 blocks hit, every one copied up from the host
    assert cached_prefix_tokens(cache, hashes, 9) == 8
    cache.add_request("a2")
    assert cache.prefix_cache.attach_cached_prefix("a2", hashes, 9) == 8
    after = _block_bytes(cache, cache.request_block_ids("a2"))
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    stats = cache.prefix_cache.stats()
    assert stats["host_hit_tokens"] == 8 and stats["gpu_hit_tokens"] == 0
    assert stats["hit_tokens"] == 8
    assert stats["host"]["blocks_up"] == 4
    assert stats["host"]["bytes_up"] == 4 * BLOCK_BYTES
    assert stats["host"]["copy_up_s"] > 0 and stats["host"]["copy_down_s"] > 0
    cache.validate_invariants()
    # the loaded blocks are cached again (held by a2): a third request shares them on the GPU
    cache.add_request("a3")
    assert cache.prefix_cache.attach_cached_prefix("a3", hashes, 9) == 8
    assert cache.request_block_ids("a3") == cache.request_block_ids("a2")
    assert cache.prefix_cache.stats()["gpu_hit_tokens"] == 8
    cache.validate_invariants()


def test_a_hit_mixes_gpu_and_host_blocks():
    cache = _cache(num_blocks=6)
    a = list(range(8))
    hashes = _import(cache, "a", a, seed=1)
    _import(cache, "b", list(range(100, 106)), seed=2)  # 3 blocks: evicts a's first one
    assert cache.prefix_cache.stats()["host"]["blocks_down"] == 1
    cache.add_request("a2")
    assert cache.prefix_cache.attach_cached_prefix("a2", hashes, 9) == 8
    stats = cache.prefix_cache.stats()
    assert stats["host_hit_tokens"] == BS and stats["gpu_hit_tokens"] == 8 - BS
    cache.validate_invariants()


def test_without_the_tier_an_evicted_block_is_recomputed():
    cache = PagedKVCache(
        LAYERS, HEADS, DIM, BS, 4, dtype=torch.float32, device="cpu", enable_prefix_caching=True
    )
    hashes = _import(cache, "a", list(range(8)), seed=1)
    _import(cache, "b", list(range(100, 108)), seed=2)
    assert cached_prefix_tokens(cache, hashes, 9) == 0
    assert cache.prefix_cache.stats()["host"] is None


def test_a_full_host_pool_drops_its_least_recently_used_blocks():
    cache = _cache(host_blocks=4)
    a = _import(cache, "a", list(range(8)), seed=1)
    b = _import(cache, "b", list(range(100, 108)), seed=2)  # a -> host (4 blocks: full)
    _import(cache, "c", list(range(200, 204)), seed=3)  # evicts 2 of b: drops a's oldest 2
    host = cache.prefix_cache.stats()["host"]
    assert host["dropped_blocks"] == 2 and host["cached_blocks"] == 4
    # a's first blocks are gone from both tiers: its run is cut at the first one
    assert cached_prefix_tokens(cache, a, 9) == 0
    assert cached_prefix_tokens(cache, b, 9) == 8  # 2 blocks on the host, 2 on the GPU
    cache.validate_invariants()


def test_a_block_already_on_the_host_is_not_copied_again():
    cache = _cache(num_blocks=5, host_blocks=16)
    a = list(range(8))
    hashes = _import(cache, "a", a, seed=1)
    _import(cache, "b", list(range(100, 108)), seed=2)  # 3 of a's 4 blocks -> host
    _import(cache, "a2", [*a, 1, 2], seed=3)  # those 3 copied up, one more block computed
    _import(cache, "c", list(range(300, 308)), seed=4)  # evicts 4 of a2's blocks
    stats = cache.prefix_cache.stats()
    host = stats["host"]
    assert host["blocks_up"] == 3 and host["dropped_blocks"] == 0
    # every hash went down once, however often its block was evicted
    assert host["blocks_down"] == host["cached_blocks"] < stats["evicted_blocks"]
    assert cached_prefix_tokens(cache, hashes, 9) == 8
    cache.validate_invariants()


def test_a_failed_copy_up_recomputes_and_changes_nothing_else(monkeypatch):
    cache = _cache()
    hashes = _import(cache, "a", list(range(8)), seed=1)
    _import(cache, "b", list(range(100, 108)), seed=2)
    pool = cache.layout._group(0).block_cache.host

    def broken(slots, block_ids):
        raise RuntimeError("injected: copy up failed")

    monkeypatch.setattr(pool.transfer, "up", broken)
    free = cache.num_free_blocks
    cache.add_request("a2")
    # b's blocks are on the GPU; a's only on the host, and its copy fails: no hit at all
    assert cache.prefix_cache.attach_cached_prefix("a2", hashes, 9) == 0
    stats = cache.prefix_cache.stats()
    assert stats["host"]["failed_up"] == 4
    assert not any(h in pool for h in hashes)  # their bytes are in doubt: dropped
    assert stats["host_hit_tokens"] == 0
    assert cache.num_free_blocks == free  # nothing taken for the failed copy
    assert cache.request_block_ids("a2") == []
    cache.validate_invariants()


def test_an_interrupted_copy_up_leaves_the_cache_as_it_was(monkeypatch):
    cache = _cache()
    hashes = _import(cache, "a", list(range(8)), seed=1)
    _import(cache, "b", list(range(100, 108)), seed=2)
    pool = cache.layout._group(0).block_cache.host

    def interrupted(slots, block_ids):
        raise KeyboardInterrupt

    monkeypatch.setattr(pool.transfer, "up", interrupted)
    cache.add_request("a2")
    version, free = cache.version, cache.num_free_blocks
    stats = cache.prefix_cache.stats()
    with pytest.raises(KeyboardInterrupt):
        cache.prefix_cache.attach_cached_prefix("a2", hashes, 9)
    assert cache.version == version and cache.num_free_blocks == free
    assert cache.request_block_ids("a2") == [] and cache.seq_len("a2") == 0
    after = cache.prefix_cache.stats()
    # b's blocks were evicted to make room before the copy: they moved to the host tier
    assert after["hit_tokens"] == stats["hit_tokens"]
    assert after["host"]["cached_blocks"] == 8
    cache.validate_invariants()
    monkeypatch.undo()
    assert cache.prefix_cache.attach_cached_prefix("a2", hashes, 9) == 8  # whole again


def test_a_failed_copy_down_only_loses_the_host_copy(monkeypatch):
    cache = _cache()
    hashes = _import(cache, "a", list(range(8)), seed=1)
    pool = cache.layout._group(0).block_cache.host

    def broken(block_ids, slots):
        raise RuntimeError("injected: copy down failed")

    monkeypatch.setattr(pool.transfer, "down", broken)
    _import(cache, "b", list(range(100, 108)), seed=2)  # evicts a: its copy fails
    stats = cache.prefix_cache.stats()["host"]
    assert stats["failed_down"] == 4 and stats["cached_blocks"] == 0
    assert cached_prefix_tokens(cache, hashes, 9) == 0  # recomputed, never wrong
    cache.validate_invariants()


def test_the_tier_works_for_fp8_and_window_groups():
    spec = "(2,6,2,2,4):float8_e4m3fn:1;(2,6,2,2,4):float8_e4m3fn:1:window=4"
    cache = PagedKVCache(
        kv_spec=spec,
        device="cpu",
        enable_prefix_caching=True,
        host_kv_cache_bytes=2 * 12 * 2 * 2 * 2 * 4,
    )
    g0, g1 = (cache.layout._group(g) for g in (0, 1))
    assert g0.block_cache.host.capacity_blocks == g1.block_cache.host.capacity_blocks == 12
    tokens = list(range(12))
    hashes = cache.prefix_cache.block_hashes(tokens)
    cache.add_request("a")
    cache.prefix_cache.attach_cached_prefix("a", hashes, 12)
    tx = cache.begin_tokens(["a"], [12])
    for layer in range(2):
        k = torch.randn(12, 2, 4, dtype=torch.bfloat16)
        cache.write_token_layer(tx, layer, k, k)
    cache.commit_token(tx)
    cache.prefix_cache.cache_request_blocks("a")
    before = g0.k[:, cache.request_block_ids("a")].view(torch.uint8).clone()
    cache.finish_request("a")
    cache.add_request("b")
    tx = cache.begin_tokens(["b"], [12])  # the whole pool of both groups: a is evicted
    cache.abort_token(tx)
    cache.cancel_request("b")
    cache.validate_invariants()
    cache.add_request("a2")
    assert cache.prefix_cache.attach_cached_prefix("a2", hashes, 13) == 12
    after = g0.k[:, cache.request_block_ids("a2")].view(torch.uint8)
    assert torch.equal(before, after)
    cache.validate_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"host_kv_cache_bytes": -1}, ValueError, ">= 0"),
        ({"host_kv_cache_bytes": 1.5}, TypeError, "must be an int"),
        ({"host_kv_cache_bytes": True}, TypeError, "must be an int"),
        ({"host_kv_cache_bytes": 10}, ValueError, "no whole KV block"),
        (
            {"host_kv_cache_bytes": 4096, "enable_prefix_caching": False},
            ValueError,
            "needs automatic prefix caching",
        ),
    ],
)
def test_bad_host_sizes_are_clear_errors(kwargs, error, match):
    kwargs.setdefault("enable_prefix_caching", True)
    with pytest.raises(error, match=match):
        PagedKVCache(LAYERS, HEADS, DIM, BS, 4, dtype=torch.float32, device="cpu", **kwargs)


def test_slot_runs_merge_consecutive_slots():
    assert slot_runs([]) == []
    assert slot_runs([3]) == [(0, 3, 1)]
    assert slot_runs([1, 2, 3, 7, 8, 10]) == [(0, 1, 3), (3, 7, 2), (5, 10, 1)]


def test_transfer_round_trips_blocks_in_any_order():
    kv = torch.randn(2, LAYERS, 6, HEADS, BS, DIM)
    host = HostBlockPool(kv, 5)
    assert isinstance(host.transfer, BlockTransfer) and host.block_bytes == BLOCK_BYTES
    hashes = [bytes([i]) for i in range(4)]
    assert host.store([5, 0, 3, 2], hashes) == 4
    original = kv.clone()
    kv.zero_()
    assert host.load([hashes[2], hashes[0]], [1, 4])  # block 3 -> 1, block 5 -> 4
    assert torch.equal(kv[:, :, 1], original[:, :, 3])
    assert torch.equal(kv[:, :, 4], original[:, :, 5])
    assert not host.load([b"missing"], [0])
    host.check_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["down", "up"])
def test_a_copy_never_makes_the_host_wait_for_the_stream(direction):
    """The block ids go up through pinned memory: with the current stream busy (a sleep), a
    copy either way is enqueued and returns before the stream is past the sleep; the bytes
    arrive."""
    kv = torch.randn(2, LAYERS, 6, HEADS, BS, DIM, device="cuda")
    transfer = HostBlockPool(kv, 4).transfer
    transfer.down([0, 1], [0, 1])  # warm: the pinned allocator holds a buffer to reuse
    transfer.synchronize()
    original = kv.clone()
    torch.cuda._sleep(200_000_000)  # about 0.1 s at GPU clocks
    slept = torch.cuda.Event()
    slept.record()
    if direction == "down":
        transfer.down([4, 5], [2, 3])
    else:
        transfer.up([0, 1], [2, 3])
    assert not slept.query()  # the host did not wait for the stream
    transfer.synchronize()
    torch.cuda.synchronize()
    if direction == "down":
        kv.zero_()
        transfer.up([2, 3], [0, 1])
        torch.cuda.synchronize()
        assert torch.equal(kv[:, :, :2], original[:, :, 4:])
    else:
        assert torch.equal(kv[:, :, 2:4], original[:, :, :2])


def test_a_preempted_request_leaves_its_blocks_cached_and_may_be_added_again():
    cache = _cache(num_blocks=6)
    tokens = list(range(7))  # 3 full blocks and one token
    hashes = cache.prefix_cache.block_hashes(tokens)
    cache.add_request("a")
    cache.prefix_cache.attach_cached_prefix("a", hashes, 7)
    tx = cache.begin_tokens(["a"], [7])
    for layer in range(LAYERS):
        kv = torch.randn(7, HEADS, DIM)
        cache.write_token_layer(tx, layer, kv, kv)
    cache.commit_token(tx)
    with pytest.raises(ValueError, match="unknown"):
        cache.prefix_cache.preempt_request("nope")
    version = cache.version
    cache.prefix_cache.preempt_request("a")
    assert cache.version == version + 1
    assert cache.num_free_blocks == 6 and cache.prefix_cache.stats()["evictable_blocks"] == 3
    with pytest.raises(ValueError, match="unknown"):
        cache.seq_len("a")
    cache.add_request("a")  # the same id resumes from its cached blocks
    assert cache.prefix_cache.attach_cached_prefix("a", hashes, 7) == 6
    cache.validate_invariants()
    cache.finish_request("a")
    with pytest.raises(RuntimeError, match="preempt"):
        cache.prefix_cache.preempt_request("a")  # terminal now


def test_an_interrupted_copy_down_leaves_the_step_untaken_and_the_blocks_cached(monkeypatch):
    cache = _cache()
    hashes = _import(cache, "a", list(range(8)), seed=1)
    pool = cache.layout._group(0).block_cache.host

    def interrupted(block_ids, slots):
        raise KeyboardInterrupt

    monkeypatch.setattr(pool.transfer, "down", interrupted)
    cache.add_request("b")
    free, stats = cache.num_free_blocks, cache.prefix_cache.stats()
    with pytest.raises(KeyboardInterrupt):
        cache.begin_tokens(["b"], [8])  # its allocation evicts a's blocks: the copy is cut
    cache.validate_invariants()
    assert cache.num_free_blocks == free and cache.seq_len("b") == 0
    after = cache.prefix_cache.stats()
    assert after["cached_blocks"] == stats["cached_blocks"] == 4  # a's blocks cached again
    assert after["host"]["cached_blocks"] == 0  # nothing half-copied is kept
    assert cached_prefix_tokens(cache, hashes, 9) == 8
    monkeypatch.undo()
    tx = cache.begin_tokens(["b"], [8])  # now the copy goes through
    cache.abort_token(tx)
    cache.validate_invariants()


def test_a_hit_interrupted_in_its_copies_takes_nothing_and_loses_no_block(monkeypatch):
    """A hit on a's blocks (in the host tier) allocates four blocks, evicting b's: an interrupt
    in that copy down, or in the copy up after it, leaves a2 empty and every block of a and b
    still cached in one tier or the other; then the hit goes through."""
    cache = _cache()
    a = _import(cache, "a", list(range(8)), seed=1)
    b = _import(cache, "b", list(range(100, 108)), seed=2)  # a -> host, b on the GPU
    pool = cache.layout._group(0).block_cache.host
    cache.add_request("a2")

    def interrupted(*args):
        raise KeyboardInterrupt

    def interrupt(direction: str) -> dict:
        with monkeypatch.context() as patch:
            patch.setattr(pool.transfer, direction, interrupted)
            with pytest.raises(KeyboardInterrupt):
                cache.prefix_cache.attach_cached_prefix("a2", a, 9)
        cache.validate_invariants()
        assert cache.seq_len("a2") == 0 and cache.request_block_ids("a2") == []
        assert cached_prefix_tokens(cache, a, 9) == cached_prefix_tokens(cache, b, 9) == 8
        return cache.prefix_cache.stats()

    stats = cache.prefix_cache.stats()
    # the copy down is cut: nothing changed, b stays cached on the GPU
    assert interrupt("down") == stats and stats["cached_blocks"] == 4
    # the copy up is cut after b went down: b is in the host tier beside a, the GPU pool free
    after = interrupt("up")
    assert after["host"]["cached_blocks"] == 8 and after["host"]["blocks_up"] == 0
    assert after["cached_blocks"] == 0 and after["hit_tokens"] == 0
    assert cache.prefix_cache.attach_cached_prefix("a2", a, 9) == 8
    assert cache.prefix_cache.stats()["host_hit_tokens"] == 8
    cache.validate_invariants()
