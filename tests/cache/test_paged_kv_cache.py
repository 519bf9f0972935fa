"""PagedKVCache façade: construction, lifecycle, legacy append, metadata, prefixes, metrics."""

from __future__ import annotations

import itertools

import pytest
import torch

import flashdec
from flashdec.cache import PagedKVCache, PrefixState, RequestState
from flashdec.reference import dense_decode_attention_ref, paged_decode_attention_ref
from tests.cache.snapshot import assert_rejected
from tests.cache.util import commit_token, make_cache, prefix_blocks, stored, tokens


def test_public_names_resolve_from_the_package():
    for name in (
        "PagedKVCache",
        "RequestState",
        "PrefixState",
        "TokenTransaction",
        "TokenTransactionView",
    ):
        assert getattr(flashdec, name) is getattr(flashdec.cache, name)
    from flashdec.engine import layer_ops  # the engine joins the cache and the kernels

    for name in ("rope_paged_kv_append", "RopeAppendResult"):
        assert getattr(flashdec, name) is getattr(layer_ops, name)


def test_storage_geometry_and_layer_views():
    cache = make_cache(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, max_blocks=5)
    assert cache.k_cache.shape == (3, 5, 2, 4, 8) == cache.v_cache.shape
    assert cache.k_cache.dtype == torch.float32 and not cache.k_cache.any()
    assert cache.max_blocks_per_seq == 5 and cache.num_free_blocks == 5
    k1, v1 = cache.layout.layer_kv(1)
    assert k1.shape == (5, 2, 4, 8)
    assert (
        k1.data_ptr() == cache.k_cache[1].data_ptr()
        and v1.data_ptr() == cache.v_cache[1].data_ptr()
    )
    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 3\)"):
        cache.layout.layer_kv(3)


@pytest.mark.parametrize(
    ("overrides", "exc"),
    [
        ({"num_layers": 0}, ValueError),
        ({"head_dim": 4.0}, TypeError),
        ({"block_size": True}, TypeError),
        ({"dtype": torch.int32}, TypeError),
        ({"device": 3}, TypeError),
        ({"device": "nonsense"}, ValueError),
        ({"prefix_cache_capacity_blocks": -1}, ValueError),
        ({"max_blocks_per_seq": 0}, ValueError),
        ({"restore_on_abort": 1}, TypeError),
        ({"head_dim": 7}, ValueError),  # RoPE rotates pairs: caught here, not at the first step
        ({"prefix_cache_capacity_blocks": 9, "max_blocks": 8}, ValueError),
        ({"max_blocks_per_seq": 9, "max_blocks": 8}, ValueError),
        ({"device": "cuda:99"}, ValueError),  # no such device (or no CUDA at all)
    ],
)
def test_constructor_rejects_bad_arguments(overrides, exc):
    with pytest.raises(exc):
        make_cache(**overrides)


def test_lifecycle_states_and_ids_are_never_reused(cache):
    for rid in ("a", 2, "c"):
        cache.add_request(rid)
    assert cache.request_ids() == ["a", 2, "c"]
    assert cache.request_state(2) is RequestState.ACTIVE and cache.request_state(2) == "active"
    commit_token(cache, ["a", 2], seed=1)
    cache.finish_request("a")
    cache.cancel_request(2)
    assert cache.request_state("a") == "finished" and cache.request_state(2) == "cancelled"
    assert cache.request_ids(RequestState.ACTIVE) == ["c"]
    assert cache.request_ids("finished") == ["a"]
    assert cache.request_ids("cancelled") == [2]
    assert cache.request_block_ids("a") == [] and cache.num_free_blocks == cache.max_blocks
    assert cache.seq_len("a") == 1  # the final length is kept for reporting
    assert_rejected(cache, ValueError, "already exists", lambda: cache.add_request("a"))
    assert_rejected(cache, RuntimeError, "it is finished", lambda: cache.finish_request("a"))
    assert_rejected(cache, RuntimeError, "it is cancelled", lambda: cache.cancel_request(2))
    with pytest.raises(ValueError, match="state must be one of"):
        cache.request_ids("waiting")
    m = cache.metrics()
    assert (m["num_active_requests"], m["num_finished_requests"], m["num_cancelled_requests"]) == (
        1,
        1,
        1,
    )
    cache.validate_invariants()


def test_str_and_int_ids_are_distinct(cache):
    cache.add_request(1)
    cache.add_request("1")
    commit_token(cache, [1], seed=0)
    assert cache.seq_len(1) == 1 and cache.seq_len("1") == 0


def test_legacy_append_stores_bytes_and_grows_blocks():
    cache = make_cache(num_layers=1, block_size=2, max_blocks=6, dtype=torch.float16)
    cache.add_request("a")
    cache.add_request("b")
    written = {"a": [], "b": []}
    for step in range(3):
        k, v = tokens(cache, 2, 2 * step), tokens(cache, 2, 2 * step + 1)
        cache.append(["b", "a"], k, v)
        written["b"].append((k[0], v[0]))
        written["a"].append((k[1], v[1]))
    assert cache.seq_len("a") == cache.seq_len("b") == 3
    assert len(cache.request_block_ids("a")) == 2  # ceil(3 / 2)
    for rid, toks in written.items():
        for pos, (k_in, v_in) in enumerate(toks):
            k, v = stored(cache, rid, pos)
            assert torch.equal(k[0].view(torch.int16), k_in.view(torch.int16))
            assert torch.equal(v[0].view(torch.int16), v_in.view(torch.int16))
    cache.validate_invariants()


def test_legacy_append_requires_a_single_layer_cache(cache):
    cache.add_request("a")
    k = tokens(cache, 1, 0)
    assert_rejected(cache, RuntimeError, "single-layer", lambda: cache.append(["a"], k, k))


def test_append_capacity_failure_changes_nothing():
    cache = make_cache(num_layers=1, block_size=2, max_blocks=3)
    for rid in "abc":
        cache.add_request(rid)
    cache.append(["a", "b"], tokens(cache, 2, 0), tokens(cache, 2, 1))  # 2 blocks, 1 free
    cache.append(["a"], tokens(cache, 1, 2), tokens(cache, 1, 3))  # a's block now full
    k = tokens(cache, 3, 4)
    # b fits in its block, but a and c both need a new block and only one is free
    assert_rejected(
        cache, RuntimeError, "needs 2 new block", lambda: cache.append(["a", "b", "c"], k, k)
    )
    cache.append(["a", "b"], k[:2], k[:2])  # the part that fits still works


def test_request_is_full_at_max_blocks_per_seq():
    cache = make_cache(num_layers=1, block_size=2, max_blocks=8, max_blocks_per_seq=1)
    cache.add_request("a")
    for step in range(2):
        cache.append(["a"], tokens(cache, 1, step), tokens(cache, 1, step))
    k = tokens(cache, 1, 9)
    assert_rejected(cache, RuntimeError, "is full", lambda: cache.append(["a"], k, k))
    assert cache.block_tables(["a"]).shape == (1, 1)


def test_block_tables_and_seq_lens_follow_the_given_order(cache):
    for rid in ("x", "y", "z"):
        cache.add_request(rid)
    for step in range(3):
        commit_token(cache, ["x", "y"], seed=step)
    commit_token(cache, ["y"], seed=10)
    tables = cache.block_tables(["z", "y", "x"])
    lens = cache.seq_lens_tensor(["z", "y", "x"])
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32
    assert tables.device == cache.device and tables.shape == (3, cache.max_blocks_per_seq)
    assert lens.tolist() == [0, 4, 3]
    assert tables[0].tolist() == [0] * 8  # padding is 0
    assert tables[1, :2].tolist() == cache.request_block_ids("y") and not tables[1, 2:].any()
    assert tables[2, :2].tolist() == cache.request_block_ids("x")
    assert cache.block_tables([]).shape == (0, 8)
    cache.finish_request("z")
    with pytest.raises(RuntimeError, match="it is finished"):
        cache.block_tables(["z"])


def test_paged_reference_decodes_what_was_appended():
    """Tokens written through the cache read back through block_tables/seq_lens exactly."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, max_blocks=8)
    rids = ["a", "b", "c"]
    lengths = {"a": 5, "b": 9, "c": 1}
    dense_k = torch.zeros(3, 9, 2, 8)
    dense_v = torch.zeros(3, 9, 2, 8)
    for rid in rids:
        cache.add_request(rid)
    for step in range(9):
        batch = [r for r in rids if lengths[r] > step]
        k, v = tokens(cache, len(batch), 2 * step), tokens(cache, len(batch), 2 * step + 1)
        cache.append(batch, k, v)
        for row, rid in enumerate(batch):
            dense_k[rids.index(rid), step] = k[row]
            dense_v[rids.index(rid), step] = v[row]
    q = tokens(cache, 3, 77, heads=4)
    k_layer, v_layer = cache.layout.layer_kv(0)
    out = paged_decode_attention_ref(
        q, k_layer, v_layer, cache.block_tables(rids), cache.seq_lens_tensor(rids)
    )
    expected = dense_decode_attention_ref(q, dense_k, dense_v, cache.seq_lens_tensor(rids))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefix_attach_shares_blocks_and_the_tail_is_private():
    cache = make_cache(num_layers=2, block_size=2, max_blocks=10, prefix_cache_capacity_blocks=4)
    kb, vb = prefix_blocks(cache, 2, 0), prefix_blocks(cache, 2, 1)
    state = cache.register_prefix("sys", kb, vb)
    assert isinstance(state, PrefixState)
    assert (state.num_blocks, state.num_tokens, state.refcount) == (2, 4, 0)
    kb.zero_()  # the cache holds its own copy
    for rid in ("a", "b"):
        cache.add_request(rid)
        cache.attach_prefix(rid, "sys")
    assert cache.prefix_state("sys").refcount == 2
    assert cache.request_prefix("a") == "sys" and cache.seq_len("a") == 4
    assert cache.request_block_ids("a") == list(state.block_ids)
    assert cache.block_tables(["a"])[0, :2].tolist() == list(state.block_ids)
    commit_token(cache, ["a", "b"], seed=3)
    a_tail = cache.request_block_ids("a")[2]
    b_tail = cache.request_block_ids("b")[2]
    assert a_tail != b_tail and a_tail not in state.block_ids
    for pos in range(4):  # prefix tokens read back through the request's table
        k, v = stored(cache, "a", pos)
        assert torch.equal(k, prefix_blocks(cache, 2, 0)[:, pos // 2, :, pos % 2])
        assert torch.equal(v, vb[:, pos // 2, :, pos % 2])
    m = cache.metrics()
    assert (m["num_prefixes"], m["num_prefix_blocks"], m["prefix_refcount_total"]) == (1, 2, 2)
    assert m["num_private_blocks"] == 2
    assert_rejected(cache, RuntimeError, "used by 2 active", lambda: cache.evict_prefix("sys"))
    cache.finish_request("a")
    cache.cancel_request("b")
    assert cache.prefix_state("sys").refcount == 0
    assert cache.num_free_blocks == 8
    cache.evict_prefix("sys")
    assert cache.prefix_ids() == [] and cache.num_free_blocks == 10
    cache.register_prefix("sys", vb, vb)  # a prefix id may come back after eviction
    cache.validate_invariants()


def test_register_prefix_evicts_lru_through_the_facade():
    cache = make_cache(block_size=2, max_blocks=8, prefix_cache_capacity_blocks=3)
    blocks = prefix_blocks(cache, 1, 0)
    for pid in ("p0", "p1", "p2"):
        cache.register_prefix(pid, blocks, blocks)
    cache.add_request("r")
    cache.attach_prefix("r", "p0")  # p0 active; p1 is the least recently used inactive one
    two = prefix_blocks(cache, 2, 1)
    cache.register_prefix("p3", two, two)
    assert cache.prefix_ids() == ["p0", "p3"]
    assert cache.metrics()["num_prefix_evictions"] == 2
    cache.add_request("r3")
    cache.attach_prefix("r3", "p3")  # now nothing is evictable
    assert_rejected(
        cache, RuntimeError, "even after evicting", lambda: cache.register_prefix("p4", two, two)
    )
    cache.validate_invariants()


def test_attach_rules(cache):
    blocks = prefix_blocks(cache, 1, 0)
    cache.register_prefix("p", blocks, blocks)
    cache.add_request("busy")
    commit_token(cache, ["busy"], seed=0)
    cache.add_request("done")
    cache.finish_request("done")
    cache.add_request("twice")
    cache.attach_prefix("twice", "p")
    assert_rejected(cache, RuntimeError, "empty request", lambda: cache.attach_prefix("busy", "p"))
    assert_rejected(cache, RuntimeError, "it is finished", lambda: cache.attach_prefix("done", "p"))
    assert_rejected(cache, RuntimeError, "empty request", lambda: cache.attach_prefix("twice", "p"))
    assert_rejected(cache, ValueError, "unknown prefix", lambda: cache.attach_prefix("busy", "q"))


def test_prefix_feature_off_by_default():
    cache = PagedKVCache(1, 1, 4, 2, 4, dtype=torch.float32, device="cpu")
    blocks = prefix_blocks(cache, 1, 0)
    assert_rejected(
        cache,
        RuntimeError,
        "prefix_cache_capacity_blocks=0",
        lambda: cache.register_prefix("p", blocks, blocks),
    )


def test_version_bumps_on_each_successful_mutation_only(cache):
    seen = [cache.version]

    def step(call):
        call()
        seen.append(cache.version)

    blocks = prefix_blocks(cache, 1, 0)
    step(lambda: cache.add_request("a"))
    step(lambda: cache.add_request("b"))
    step(lambda: cache.register_prefix("p", blocks, blocks))
    step(lambda: cache.attach_prefix("b", "p"))
    step(lambda: commit_token(cache, ["a"], seed=0))
    step(lambda: cache.abort_token(cache.begin_token(["a", "b"])))
    step(lambda: cache.finish_request("b"))
    step(lambda: cache.evict_prefix("p"))
    step(lambda: cache.cancel_request("a"))
    diffs = [b - a for a, b in itertools.pairwise(seen)]
    assert diffs == [1, 1, 1, 1, 2, 2, 1, 1, 1]  # begin+commit and begin+abort are two each


def test_metrics_report_the_agreed_keys(cache):
    keys = {
        "retained_transaction_state_count",
        "terminal_transaction_history_count",
        "terminal_transaction_history_limit",
        "num_free_blocks",
        "num_used_blocks",
        "num_private_blocks",
        "num_prefix_blocks",
        "num_active_requests",
        "num_prefixes",
        "prefix_refcount_total",
    }
    m = cache.metrics()
    assert keys <= set(m)
    groups = m.pop("groups")  # one dict per KV group, the counters are the groups' sums
    assert all(isinstance(val, int) for val in m.values())
    assert m["num_free_blocks"] + m["num_used_blocks"] == cache.max_blocks
    assert len(groups) == 1 and groups[0]["num_free_blocks"] == m["num_free_blocks"]


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda c: setattr(c._requests.records["a"], "seq_len", 5), "needs 3 blocks, holds 2"),
        (lambda c: c._requests.records["a"].table.__setitem__(1, 7), "private blocks"),
        (lambda c: c._requests.records["a"].table.__setitem__(5, 1), "padding"),
        (lambda c: c._allocator.allocate(1, ("request", "b")), "private blocks"),
        (lambda c: c._allocator.allocate(1, "stray"), "not an active request nor a prefix"),
        (lambda c: setattr(c._prefixes._prefixes["p"], "refcount", 2), "refcount 2 but 1"),
        (lambda c: setattr(c._requests.records["b"], "num_prefix_blocks", 0), "prefix"),
        (
            lambda c: c._allocator.release([c._requests.records["a"].table[0].item()]),
            "private blocks",
        ),
    ],
)
def test_validate_invariants_detects_corruption(cache, corrupt, match):
    blocks = prefix_blocks(cache, 1, 0)
    cache.register_prefix("p", blocks, blocks)
    cache.add_request("a")
    cache.add_request("b")
    cache.attach_prefix("b", "p")
    for step in range(3):
        commit_token(cache, ["a"], seed=step)
    cache.validate_invariants()
    corrupt(cache)
    with pytest.raises(RuntimeError, match=match):
        cache.validate_invariants()


def test_discard_request_undoes_add_request(cache):
    cache.add_request("kept")
    cache.register_prefix("sys", prefix_blocks(cache, 1, 0), prefix_blocks(cache, 1, 1))
    free = cache.num_free_blocks
    for rid in ("a", "b"):
        cache.add_request(rid)
    cache.attach_prefix("a", "sys")
    commit_token(cache, ["a", "b", "kept"], seed=2)  # each holds a private block now
    version = cache.version
    cache.discard_request("a")
    cache.discard_request("b")
    assert cache.version == version + 2
    assert cache.request_ids() == ["kept"] and cache.prefix_state("sys").refcount == 0
    assert cache.num_free_blocks == free - 1  # "kept"'s block only
    with pytest.raises(ValueError, match="unknown request"):
        cache.request_state("a")
    cache.add_request("a")  # the id is free again, the request empty
    assert cache.seq_len("a") == 0 and cache.request_block_ids("a") == []
    cache.validate_invariants()
    cache.finish_request("a")
    assert_rejected(cache, RuntimeError, "it is finished", lambda: cache.discard_request("a"))
    assert_rejected(cache, ValueError, "unknown", lambda: cache.discard_request("b"))
