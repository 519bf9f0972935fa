"""Multi-layer token transactions: reservation, ordering, commit/abort, tombstones, views."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import TokenTransactionView, TransactionState
from flashdec.cache.transaction import HISTORY_LIMIT, TransactionLog
from tests.cache.helpers import decode_inputs
from tests.cache.snapshot import assert_rejected, assert_same_state, snapshot
from tests.cache.util import commit_token, make_cache, prefix_blocks, stored, tokens


def test_begin_reserves_one_slot_per_request(cache):
    cache.add_request("a")
    cache.add_request("b")
    commit_token(cache, ["a"], seed=1)  # a: 1 token in a 2-slot block; b: empty
    free = cache.num_free_blocks
    tx = cache.begin_token(["b", "a"])
    assert isinstance(tx, TokenTransactionView)
    assert tx.state == TransactionState.OPEN == "open"
    assert tx.request_ids == ("b", "a")
    assert tx.positions.tolist() == [0, 1]
    assert tx.seq_lens.tolist() == [0, 1]
    assert tx.offsets.tolist() == [0, 1]
    assert cache.num_free_blocks == free - 1  # only b needed a block
    a_block = cache.request_block_ids("a")[0]
    assert tx.block_ids[1] == a_block
    assert tx.block_tables[:, 0].tolist() == tx.block_ids.tolist()
    assert tx.block_tables.dtype == torch.int32 and tx.block_tables.shape == (2, 8)
    assert cache.request_block_ids("b") == []  # not published before commit
    m = cache.metrics()
    assert m["retained_transaction_state_count"] == 1 and m["num_reserved_blocks"] == 1
    cache.validate_invariants()


def test_commit_publishes_every_request_exactly_once(cache):
    cache.add_request("a")
    cache.add_request("b")
    written = commit_token(cache, ["a", "b"], seed=3)
    assert cache.seq_len("a") == cache.seq_len("b") == 1
    for row, rid in enumerate(["a", "b"]):
        k, v = stored(cache, rid, 0)
        for layer, (k_in, v_in) in enumerate(written):
            assert torch.equal(k[layer], k_in[row]) and torch.equal(v[layer], v_in[row])
    tx = cache.begin_token(["a"])
    for layer in range(cache.num_layers):
        cache.write_token_layer(tx.transaction_id, layer, *(tokens(cache, 1, 9),) * 2)
    view = cache.commit_token(tx)
    assert view.state == "committed"
    assert view.seq_lens.tolist() == [2] and cache.seq_len("a") == 2
    assert view.cache_version == cache.version
    with pytest.raises(RuntimeError, match="already committed"):
        cache.commit_token(tx)
    assert cache.seq_len("a") == 2
    cache.validate_invariants()


def test_commit_before_all_layers_is_rejected(cache):
    cache.add_request("a")
    tx = cache.begin_token(["a"])
    cache.write_token_layer(tx, 0, tokens(cache, 1, 0), tokens(cache, 1, 1))
    assert_rejected(cache, RuntimeError, "1 of 2 layers written", lambda: cache.commit_token(tx))
    cache.write_token_layer(tx, 1, tokens(cache, 1, 2), tokens(cache, 1, 3))
    cache.commit_token(tx)


@pytest.mark.parametrize(("done", "layer"), [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])
def test_out_of_order_or_repeated_layer_leaves_transaction_unchanged(done, layer):
    cache = make_cache(num_layers=3)
    cache.add_request("a")
    tx = cache.begin_token(["a"])
    for i in range(done):
        cache.write_token_layer(tx, i, tokens(cache, 1, i), tokens(cache, 1, i))
    k = tokens(cache, 1, 99)
    if layer == done:
        layer = done + 1  # skip ahead instead
    assert_rejected(
        cache, RuntimeError, "out of order", lambda: cache.write_token_layer(tx, layer, k, k)
    )
    cache.write_token_layer(tx, done, k, k)  # the expected layer still works


def test_abort_releases_what_begin_took_and_restores_bytes(cache):
    cache.add_request("a")
    cache.add_request("b")
    commit_token(cache, ["a", "b"], seed=5)
    commit_token(cache, ["a"], seed=6)  # a fills its block; b has one free slot
    before = snapshot(cache)
    tx = cache.begin_token(["a", "b"])
    assert cache.num_free_blocks == before["num_free_blocks"] - 1
    for layer in range(cache.num_layers):
        cache.write_token_layer(tx, layer, tokens(cache, 2, 40 + layer), tokens(cache, 2, 50))
    view = cache.abort_token(tx)
    assert view.state == "aborted" and view.seq_lens.tolist() == [2, 1]
    after = snapshot(cache)
    # everything but the version and the transaction history is as before, K/V bytes included
    for key in ("requests", "prefixes", "num_free_blocks", "k", "v"):
        if key in ("k", "v"):
            assert torch.equal(before[key], after[key])
        else:
            assert before[key] == after[key]
    assert after["version"] == before["version"] + 2
    assert cache.metrics()["num_aborted_transactions"] == 1
    with pytest.raises(RuntimeError, match="already aborted"):
        cache.abort_token(tx)
    with pytest.raises(RuntimeError, match="already aborted"):
        cache.commit_token(tx)
    cache.validate_invariants()


def test_abort_without_restore_still_releases_blocks():
    cache = make_cache(restore_on_abort=False)
    cache.add_request("a")
    tx = cache.begin_token(["a"])
    cache.write_token_layer(tx, 0, tokens(cache, 1, 0), tokens(cache, 1, 0))
    cache.abort_token(tx)
    assert cache.num_free_blocks == cache.max_blocks and cache.seq_len("a") == 0
    cache.validate_invariants()


def test_failing_write_leaves_transaction_open_and_abort_restores(cache, monkeypatch):
    """Fault injection at every layer: the failing write changes nothing, abort undoes the rest."""
    import flashdec.cache.token_steps as facade

    cache.add_request("a")
    commit_token(cache, ["a"], seed=1)
    for fail_at in range(cache.num_layers):
        before = snapshot(cache)
        tx = cache.begin_token(["a"])
        for layer in range(fail_at):
            cache.write_token_layer(tx, layer, tokens(cache, 1, layer), tokens(cache, 1, 7))
        mid = snapshot(cache)

        def boom(*args, **kwargs):
            raise OSError("injected")

        with monkeypatch.context() as patch:
            patch.setattr(facade, "torch_scatter", boom)
            with pytest.raises(OSError, match="injected"):
                cache.write_token_layer(tx, fail_at, tokens(cache, 1, 3), tokens(cache, 1, 4))
        assert_same_state(cache, mid)
        cache.abort_token(tx)
        after = snapshot(cache)
        assert after["requests"] == before["requests"]
        assert after["num_free_blocks"] == before["num_free_blocks"]
        assert torch.equal(after["k"], before["k"]) and torch.equal(after["v"], before["v"])


def test_view_is_detached(cache):
    cache.add_request("a")
    cache.add_request("b")
    tx = cache.begin_token(["a", "b"])
    real_ids = tx.block_ids.clone()
    tx.block_ids.fill_(7)  # an attempt to redirect the write
    tx.offsets.fill_(1)
    tx.positions.fill_(5)
    ks = [tokens(cache, 2, s) for s in range(2)]
    for layer in range(2):
        cache.write_token_layer(tx, layer, ks[layer], ks[layer])
    fresh = cache.transaction_view(tx)
    assert torch.equal(fresh.block_ids, real_ids) and fresh.positions.tolist() == [0, 0]
    cache.commit_token(tx)
    for row, rid in enumerate(["a", "b"]):
        k, _ = stored(cache, rid, 0)
        assert torch.equal(k[0], ks[0][row])
    assert not cache.k_cache[:, 7].any()  # block 7 was never touched
    with pytest.raises(AttributeError):
        tx.state = "committed"  # frozen


def test_transaction_view_accepts_open_handles_only(cache):
    cache.add_request("a")
    tx = cache.begin_token(["a"])
    assert cache.transaction_view(tx.transaction_id).transaction_id == tx.transaction_id
    assert cache.steps.open_transaction_id == tx.transaction_id
    cache.abort_token(tx)
    with pytest.raises(RuntimeError, match="already aborted"):
        cache.transaction_view(tx)
    with pytest.raises(RuntimeError, match="unknown token transaction 999"):
        cache.transaction_view(999)
    with pytest.raises(TypeError, match="TokenTransactionView or an int"):
        cache.transaction_view("1")
    with pytest.raises(TypeError):
        cache.transaction_view(True)


def test_history_is_bounded_and_old_handles_become_unknown():
    cache = make_cache(num_layers=1, max_blocks=2, block_size=4)
    cache.add_request("a")
    first = cache.begin_token(["a"])
    cache.abort_token(first)
    handles = [first]
    for _ in range(HISTORY_LIMIT + 3):
        tx = cache.begin_token(["a"])
        cache.abort_token(tx)
        handles.append(tx)
    m = cache.metrics()
    assert m["terminal_transaction_history_count"] == HISTORY_LIMIT
    assert m["terminal_transaction_history_limit"] == HISTORY_LIMIT == 256
    assert m["retained_transaction_state_count"] == 0
    for old in handles[:4]:
        with pytest.raises(RuntimeError, match="unknown token transaction"):
            cache.abort_token(old)
    with pytest.raises(RuntimeError, match="already aborted"):
        cache.commit_token(handles[4])
    cache.validate_invariants()


def test_mutations_while_open_are_rejected():
    cache = make_cache(num_layers=1)
    cache.register_prefix("p", prefix_blocks(cache, 1, 0), prefix_blocks(cache, 1, 1))
    for rid in ("a", "b", "e"):
        cache.add_request(rid)
    cache.add_request("q")
    cache.attach_prefix("q", "p")
    tx = cache.begin_token(["a"])
    k = tokens(cache, 1, 0)
    blocks = prefix_blocks(cache, 1, 2)
    calls = {
        "add a request": lambda: cache.add_request("new"),
        "finish a request": lambda: cache.finish_request("b"),
        "cancel a request": lambda: cache.cancel_request("b"),
        "append": lambda: cache.append(["b"], k, k),
        "begin a token": lambda: cache.begin_token(["b"]),
        "register a prefix": lambda: cache.register_prefix("p2", blocks, blocks),
        "attach a prefix": lambda: cache.attach_prefix("e", "p"),
        "evict a prefix": lambda: cache.evict_prefix("p"),
    }
    for what, call in calls.items():
        assert_rejected(cache, RuntimeError, f"cannot {what}.*is open", call)
    cache.write_token_layer(tx, 0, k, k)
    cache.commit_token(tx)
    cache.finish_request("b")  # fine once closed


def test_transaction_slots_cover_the_new_token(cache):
    cache.add_request("a")
    commit_token(cache, ["a"], seed=1)
    commit_token(cache, ["a"], seed=2)
    tx = cache.begin_token(["a"])
    tables, lens = decode_inputs(cache, tx)
    assert lens.tolist() == [3]
    assert tables[0, 1].item() == tx.block_ids[0].item()
    cache.abort_token(tx)


def test_write_path_does_no_host_sync(cache, monkeypatch):
    cache.add_request("a")
    cache.add_request("b")
    tx = cache.begin_token(["a", "b"])
    k = tokens(cache, 2, 1)

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync on the write path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    cache.write_token_layer(tx, 0, k, k)
    cache.write_token_layer_with(tx, 1, lambda k_layer, v_layer, slots: None)
    decode_inputs(cache, tx)
    monkeypatch.undo()
    cache.commit_token(tx)


def test_transaction_log_unit():
    log = TransactionLog(history_limit=2)
    with pytest.raises(RuntimeError, match="no token transaction is open"):
        log.close(TransactionState.ABORTED, 0)
    with pytest.raises(RuntimeError, match="unknown token transaction 1"):
        log.resolve(1)
    with pytest.raises(TypeError):
        log.resolve(1.0)


@pytest.mark.parametrize("counts", [[3], [1, 2], [3, 1, 5]])
def test_a_multi_token_steps_metadata_starts_16_byte_aligned(counts):
    """Triton specialises a kernel on each pointer's 16-byte alignment: metadata parts that
    followed odd-length ones would build new kernel variants in the middle of serving."""
    cache = make_cache(max_blocks=16)
    rids = [f"r{i}" for i in range(len(counts))]
    for rid in rids:
        cache.add_request(rid)
    tx = cache.begin_tokens(rids, counts)
    seen = []
    cache.write_token_layer_with(tx.transaction_id, 0, lambda k, v, slots: seen.append(slots))
    slots = seen[0]
    for name in ("positions", "block_ids", "offsets", "seq_lens", "seq_lens_after"):
        assert getattr(slots, name).data_ptr() % 16 == 0, name
    for name in ("block_tables", "request_slots", "slot_rows"):
        assert getattr(slots, name).data_ptr() % 16 == 0, name
    assert slots.seq_lens_after.tolist() == counts
    cache.abort_token(tx.transaction_id)
