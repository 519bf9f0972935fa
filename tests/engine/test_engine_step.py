"""DecodeEngine steps: outputs match the references, failures roll the whole token back."""

import pytest
import torch

from flashdec import apply_rope, paged_decode_attention_ref
from flashdec.engine import EngineRequestState
from tests.cache.helpers import decode_inputs
from tests.cache.snapshot import snapshot
from tests.engine.conftest import BS, HKV, NUM_LAYERS, D, layer_inputs, make_engine, run_step

BACKENDS = [
    ("torch", "torch"),
    ("triton", "torch"),
    ("fused", "triton"),
]


def admitted(engine, rids):
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    return list(rids)


def durable_state(cache):
    """What an automatic abort must leave as it was (the tombstone and version may move)."""
    state = snapshot(cache)
    for key in ("version", "history", "metrics"):
        state.pop(key)
    return state


def assert_same_durable_state(cache, before):
    after = durable_state(cache)
    for key, old in before.items():
        if key in ("k", "v"):
            assert torch.equal(old, after[key]), f"{key}_cache bytes changed"
        else:
            assert old == after[key], f"{key} changed"
    cache.validate_invariants()


@pytest.mark.parametrize(("append_backend", "decode_backend"), BACKENDS)
def test_step_layers_match_reference(append_backend, decode_backend, gen):
    engine = make_engine(append_backend, decode_backend, rotary_dim=8)
    rids = admitted(engine, ["a", "b", "c"])
    # uneven lengths: 'a' gets 5 tokens, 'b' 2, 'c' 0 before the checked step
    for _ in range(2):
        run_step(engine, rids[:2], gen)
    for _ in range(3):
        run_step(engine, rids[:1], gen)
    cache = engine.cache
    positions = cache.seq_lens_tensor(rids)
    tx = engine.begin_step(rids)
    for layer in range(NUM_LAYERS):
        q, k, v = layer_inputs(3, gen)
        out = engine.step_layer(tx, layer, q, k, v)
        k_layer, v_layer = cache.layout.layer_kv(layer)
        tables, lens = decode_inputs(cache, tx)
        q_rot = apply_rope(q, positions, rotary_dim=8)
        ref = paged_decode_attention_ref(q_rot, k_layer, v_layer, tables, lens)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        # the new token's K is rotated, V is stored as given
        for b in range(len(rids)):
            t = int(positions[b])
            blk = int(tables[b, t // BS])
            expect_k = apply_rope(k[b : b + 1], positions[b : b + 1], rotary_dim=8)[0]
            torch.testing.assert_close(k_layer[blk, :, t % BS], expect_k, atol=1e-6, rtol=1e-6)
            assert torch.equal(v_layer[blk, :, t % BS], v[b])
    result = engine.commit_step(tx)
    assert result.seq_lens == (6, 3, 1)
    assert result.positions == (5, 2, 0)
    cache.validate_invariants()


def test_single_layer_step(gen):
    engine = make_engine(num_layers=1)
    rids = admitted(engine, [1, 2])
    q, k, v = layer_inputs(2, gen)
    out = engine.step(rids, q, k, v)
    # one token attended: output is that token's V (GQA: head h reads KV head h // 2)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))
    assert engine.cache.seq_lens_tensor(rids).tolist() == [1, 1]


def test_step_needs_single_layer_cache(gen):
    engine = make_engine()
    rids = admitted(engine, ["a"])
    with pytest.raises(RuntimeError, match="single-layer"):
        engine.step(rids, *layer_inputs(1, gen))


@pytest.mark.parametrize("fail_layer", range(NUM_LAYERS))
@pytest.mark.parametrize("where", ["bad_input", "write", "decode"])
def test_failure_at_any_layer_rolls_back_the_whole_token(fail_layer, where, gen, monkeypatch):
    engine = make_engine()
    rids = admitted(engine, ["a", "b"])
    for _ in range(BS - 1):  # next token crosses into a new block: begin_step takes blocks
        run_step(engine, rids, gen)
    cache = engine.cache
    before = durable_state(cache)
    tx = engine.begin_step(rids)
    for layer in range(NUM_LAYERS):
        q, k, v = layer_inputs(2, gen)
        if layer == fail_layer:
            if where == "bad_input":
                k = k[:, :, :-1]  # wrong head_dim
                expected = ValueError
            elif where == "write":
                expected = OSError

                def broken_write(*args, **kwargs):
                    raise OSError("injected write failure")

                monkeypatch.setattr(cache, "write_token_layer_with", broken_write)
            else:
                expected = ArithmeticError

                def broken_decode(*args, **kwargs):
                    raise ArithmeticError("injected decode failure")

                monkeypatch.setattr(engine.attention, "_decode", broken_decode)
            with pytest.raises(expected):
                engine.step_layer(tx, layer, q, k, v)
            break
        engine.step_layer(tx, layer, q, k, v)
    monkeypatch.undo()
    assert not engine.has_open_step
    assert cache.steps.open_transaction_id is None
    assert_same_durable_state(cache, before)
    with pytest.raises(RuntimeError, match="already aborted"):
        engine.abort_step(tx)
    # the engine is usable again and the next token lands where the failed one would have
    run_step(engine, rids, gen)
    assert cache.seq_lens_tensor(rids).tolist() == [BS, BS]


def test_out_of_order_layer_aborts(gen):
    engine = make_engine()
    rids = admitted(engine, ["a"])
    before = durable_state(engine.cache)
    tx = engine.begin_step(rids)
    with pytest.raises(RuntimeError, match="out of order"):
        engine.step_layer(tx, 1, *layer_inputs(1, gen))
    assert not engine.has_open_step
    assert_same_durable_state(engine.cache, before)


def test_explicit_abort_and_incomplete_commit(gen):
    engine = make_engine()
    rids = admitted(engine, ["a"])
    tx = engine.begin_step(rids)
    engine.step_layer(tx, 0, *layer_inputs(1, gen))
    with pytest.raises(RuntimeError, match="layers written"):
        engine.commit_step(tx)
    assert engine.has_open_step  # a premature commit is refused, the step stays open
    engine.abort_step(tx)
    assert engine.cache.seq_len("a") == 0
    with pytest.raises(RuntimeError, match="already aborted"):
        engine.commit_step(tx)


def test_lifecycle_is_frozen_while_a_step_is_open(gen):
    engine = make_engine()
    rids = admitted(engine, ["a", "b"])
    engine.add_request("c")
    tx = engine.begin_step(rids[:1])
    for call in (
        lambda: engine.add_request("d"),
        lambda: engine.admit("c"),
        lambda: engine.finish_request("b"),
        lambda: engine.cancel_request("b"),
        lambda: engine.begin_step(["b"]),
        lambda: engine.prefill_request_layers("b", torch.zeros(3, HKV, D), torch.zeros(3, HKV, D)),
    ):
        with pytest.raises(RuntimeError, match="open"):
            call()
    engine.abort_step(tx)


def test_lifecycle_paths_and_errors():
    engine = make_engine()
    engine.add_request("a")
    assert engine.request_state("a") is EngineRequestState.WAITING
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request("a")
    with pytest.raises(RuntimeError, match="waiting"):
        engine.finish_request("a")
    with pytest.raises(RuntimeError, match="expected active"):
        engine.begin_step(["a"])
    engine.admit("a")
    with pytest.raises(RuntimeError, match="only a waiting"):
        engine.admit("a")
    engine.finish_request("a")
    assert engine.request_state("a") is EngineRequestState.FINISHED
    assert engine.cache.request_state("a") == "finished"
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request("a")
    engine.add_request("w")
    engine.cancel_request("w")  # a waiting request never reaches the cache
    assert engine.request_state("w") is EngineRequestState.CANCELLED
    with pytest.raises(ValueError, match="unknown request"):
        engine.request_state("nope")
    with pytest.raises(TypeError, match="str or an int"):
        engine.add_request(1.5)
    with pytest.raises(TypeError, match="list or tuple"):
        engine.begin_step("a")


def test_prefill_imports_a_token_for_every_layer_or_nothing(gen, monkeypatch):
    engine = make_engine()
    rids = admitted(engine, ["a"])
    cache = engine.cache
    k_layers = torch.randn(NUM_LAYERS, HKV, D, generator=gen)
    v_layers = torch.randn(NUM_LAYERS, HKV, D, generator=gen)
    assert engine.prefill_request_layers("a", k_layers, v_layers) == 1
    block = cache.request_block_ids("a")[0]
    assert torch.equal(cache.k_cache[:, block, :, 0], k_layers)
    assert torch.equal(cache.v_cache[:, block, :, 0], v_layers)

    before = durable_state(cache)
    real_write = cache.write_token_layer_with
    calls = []

    def flaky_write(tx, layer, *args, **kwargs):
        calls.append(layer)
        if layer == NUM_LAYERS - 1:
            raise OSError("injected")
        return real_write(tx, layer, *args, **kwargs)

    monkeypatch.setattr(cache, "write_token_layer_with", flaky_write)
    with pytest.raises(OSError, match="injected"):
        engine.prefill_request_layers("a", k_layers + 1, v_layers + 1)
    monkeypatch.undo()
    assert calls == list(range(NUM_LAYERS))
    assert_same_durable_state(cache, before)
    for bad, exc in (
        ((torch.zeros(NUM_LAYERS, HKV, D + 1),) * 2, ValueError),
        ((torch.zeros(NUM_LAYERS, HKV, D, dtype=torch.float16),) * 2, TypeError),
    ):
        with pytest.raises(exc):
            engine.prefill_request_layers("a", *bad)
    assert_same_durable_state(cache, before)
    del rids


def test_step_layer_rejects_inconsistent_q_heads(gen):
    engine = make_engine()
    rids = admitted(engine, ["a"])
    tx = engine.begin_step(rids)
    engine.step_layer(tx, 0, *layer_inputs(1, gen))
    q, k, v = layer_inputs(1, gen)
    with pytest.raises(ValueError, match="earlier layers"):
        engine.step_layer(tx, 1, q[:, :2], k, v)
    assert not engine.has_open_step


def test_constructor_validation():
    engine = make_engine()
    with pytest.raises(ValueError, match="append_backend"):
        type(engine)(engine.cache, append_backend="cuda")
    with pytest.raises(ValueError, match="decode_backend"):
        type(engine)(engine.cache, decode_backend="flash")
    with pytest.raises(ValueError, match="rotary_dim"):
        type(engine)(engine.cache, rotary_dim=3)
    with pytest.raises(TypeError, match="PagedKVCache"):
        type(engine)(object())


def test_prefix_eviction_waits_until_every_request_is_terminal():
    engine = make_engine(prefix_blocks=2)
    blocks = torch.randn(NUM_LAYERS, 1, HKV, BS, D)
    engine.register_prefix("p", blocks, blocks)
    engine.add_request("a")
    with pytest.raises(RuntimeError, match="finished, cancelled or rejected"):
        engine.evict_prefix("p")
    engine.cancel_request("a")
    engine.evict_prefix("p")
    assert engine.cache.prefix_ids() == []
