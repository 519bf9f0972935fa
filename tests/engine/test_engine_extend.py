"""The n-token step (SPEC §8.6): ``begin_step(num_tokens=)``, packed ``step_layer``,
``commit_step(accept=)``. An n-token step is n one-token steps in one; a partial commit is the
steps it kept; a failure or a rejected call leaves the engine as it was."""

from __future__ import annotations

import pytest
import torch

from flashdec import PagedKVCache
from flashdec.engine import DecodeEngine
from flashdec.scheduler import BlockAwareScheduler, RequestSpec, SchedulerConfig
from tests.cache.snapshot import assert_same_state, snapshot
from tests.engine.conftest import HKV, HQ, NUM_LAYERS, D, make_engine
from tests.engine.test_engine_step import (
    BACKENDS,
    admitted,
    assert_same_durable_state,
    durable_state,
)


def _inputs(num_tokens: int, seed: int, num_layers: int = NUM_LAYERS, hq: int = HQ):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(num_tokens, hq, D, generator=gen),
            torch.randn(num_tokens, HKV, D, generator=gen),
            torch.randn(num_tokens, HKV, D, generator=gen),
        )
        for _ in range(num_layers)
    ]


def _rows(inputs, rows: list[int]):
    return [(q[rows], k[rows], v[rows]) for q, k, v in inputs]


def _step(engine, rids, inputs, num_tokens=None, accept=None):
    tx = engine.begin_step(rids, num_tokens=num_tokens)
    outs = [engine.step_layer(tx, i, *layer) for i, layer in enumerate(inputs)]
    result = engine.commit_step(tx, accept)
    return outs, result


def _grow(engine, rids, lengths, seed, num_layers=NUM_LAYERS):
    """Bring each request to its length with one-token steps (uneven: some mid-block)."""
    for step in range(max(lengths)):
        batch = [rid for rid, n in zip(rids, lengths, strict=True) if n > step]
        _step(engine, batch, _inputs(len(batch), seed * 1000 + step, num_layers))


@pytest.mark.parametrize(("append_backend", "decode_backend"), BACKENDS)
def test_an_n_token_step_equals_its_tokens_one_by_one(append_backend, decode_backend):
    """Each new token's output equals the one-token step that would have decoded it, and the
    stored K/V are the same: the extend attention is causal over the packed tokens."""
    counts = [3, 1, 5]
    engines = [make_engine(append_backend, decode_backend, rotary_dim=8) for _ in range(2)]
    for engine in engines:
        admitted(engine, ["a", "b", "c"])
        _grow(engine, ["a", "b", "c"], [5, 2, 0], seed=1)
    mixed, serial = engines
    inputs = _inputs(sum(counts), seed=2)
    outs, result = _step(mixed, ["a", "b", "c"], inputs, num_tokens=counts)
    assert result.positions == (5, 2, 0)
    assert result.seq_lens == (8, 3, 5)
    starts = [0, 3, 4]
    for rid, start, n in zip(["a", "b", "c"], starts, counts, strict=True):
        for j in range(n):
            want, _ = _step(serial, [rid], _rows(inputs, [start + j]))
            for layer in range(NUM_LAYERS):
                torch.testing.assert_close(
                    outs[layer][start + j : start + j + 1], want[layer], rtol=1e-5, atol=1e-5
                )
    for layer in range(NUM_LAYERS):
        for rid in ("a", "b", "c"):
            tables = [c.block_tables([rid])[0] for c in (mixed.cache, serial.cache)]
            for kv_mixed, kv_serial in zip(
                mixed.cache.layout.layer_kv(layer), serial.cache.layout.layer_kv(layer), strict=True
            ):
                n = mixed.cache.seq_len(rid)
                blocks = -(-n // mixed.cache.block_size)
                got = kv_mixed[tables[0][:blocks]].transpose(1, 2).flatten(0, 1)[:n]
                want = kv_serial[tables[1][:blocks]].transpose(1, 2).flatten(0, 1)[:n]
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    mixed.cache.validate_invariants()


@pytest.mark.parametrize(("append_backend", "decode_backend"), BACKENDS)
def test_a_partial_commit_is_the_steps_it_kept(append_backend, decode_backend):
    """Keeping ``accept`` of each request's tokens leaves the engine as if only those tokens
    had been stepped; the next step's outputs agree with that twin."""
    counts, accept = [4, 2, 3], [1, 0, 3]
    engines = [make_engine(append_backend, decode_backend, rotary_dim=8) for _ in range(2)]
    for engine in engines:
        admitted(engine, ["a", "b", "c"])
        _grow(engine, ["a", "b", "c"], [3, 4, 1], seed=1)
    partial, twin = engines
    inputs = _inputs(sum(counts), seed=3)
    free = partial.cache.num_free_blocks
    _, result = _step(partial, ["a", "b", "c"], inputs, num_tokens=counts, accept=accept)
    assert result.seq_lens == (4, 4, 4)
    assert partial.cache.num_free_blocks <= free
    kept = [0, 6, 7, 8]  # a's first token, none of b's, all of c's
    _step(twin, ["a", "c"], _rows(inputs, kept), num_tokens=[1, 3])
    assert partial.cache.num_free_blocks == twin.cache.num_free_blocks
    after = _inputs(6, seed=4)
    got, _ = _step(partial, ["a", "b", "c"], after, num_tokens=[2, 2, 2])
    want, _ = _step(twin, ["a", "b", "c"], after, num_tokens=[2, 2, 2])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    partial.cache.validate_invariants()


@pytest.mark.parametrize(("append_backend", "decode_backend"), BACKENDS)
def test_a_failure_at_any_layer_of_an_extend_step_leaves_state_bit_identical(
    append_backend, decode_backend
):
    for failing in range(NUM_LAYERS):
        engine = make_engine(append_backend, decode_backend)
        admitted(engine, ["a", "b"])
        _grow(engine, ["a", "b"], [3, 1], seed=1)
        before = durable_state(engine.cache)
        inputs = _inputs(6, seed=5)
        tx = engine.begin_step(["a", "b"], num_tokens=[4, 2])
        for layer in range(failing):
            engine.step_layer(tx, layer, *inputs[layer])
        q, k, v = inputs[failing]
        with pytest.raises(ValueError, match="k must have shape"):
            engine.step_layer(tx, failing, q, k[:5], v)
        assert not engine.has_open_step
        assert_same_durable_state(engine.cache, before)


def test_later_layers_of_an_extend_step_launch_bound_and_rebind_on_new_strides():
    """After a group's first layer (checked in full) the fused append and the extend run bound;
    a layer whose inputs come with other strides (views of a wider tensor) binds again. Every
    layer's output equals the torch backends' on the same values."""
    counts, layers = [3, 1, 4], 6
    engines = [make_engine(*backends, num_layers=layers) for backends in BACKENDS[::2]]
    for engine in engines:
        admitted(engine, ["a", "b", "c"])
        _grow(engine, ["a", "b", "c"], [5, 2, 0], seed=1, num_layers=layers)
    inputs = _inputs(sum(counts), seed=6, num_layers=layers)
    outs = []
    for engine in engines:
        tx = engine.begin_step(["a", "b", "c"], num_tokens=counts)
        got = []
        for i, (q, k, v) in enumerate(inputs):
            if i in (3, 4):  # strided views of the same values
                q = torch.cat([q, q], dim=2)[:, :, : q.shape[2]]
                k, v = (torch.stack([t, t], dim=1)[:, 0] for t in (k, v))
            got.append(engine.step_layer(tx, i, q, k, v))
        engine.commit_step(tx)
        outs.append(got)
    fused = engines[1]
    assert fused.attention.fused_triton
    for want, got in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for engine in engines:
        engine.cache.validate_invariants()


def test_n_equal_one_everywhere_is_the_decode_step():
    engine = make_engine("fused", "triton")
    admitted(engine, ["a", "b"])
    tx = engine.begin_step(["a", "b"], num_tokens=[1, 1])
    assert engine._open.kind == "decode"
    for i, layer in enumerate(_inputs(2, seed=1)):
        engine.step_layer(tx, i, *layer)
    assert engine.commit_step(tx, [1, 0]).seq_lens == (1, 0)
    engine.cache.validate_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_tokens": 3}, TypeError, "num_tokens must be a list or tuple"),
        ({"num_tokens": [1]}, ValueError, "1 entries for 2 requests"),
        ({"num_tokens": [2, 0]}, ValueError, r"num_tokens\[1\] must be >= 1"),
        ({"num_tokens": [2, 1.0]}, TypeError, r"num_tokens\[1\] must be an int"),
        ({"num_tokens": [2, 1], "pad_to": 4}, ValueError, "rows all bring the same number"),
        ({"num_tokens": [2, 1], "plan_len": 64}, ValueError, "rows all bring the same number"),
        ({"num_tokens": [3, 3], "pad_to": 1}, ValueError, r"pad_to \(1\) must be >= the batch"),
        ({"num_tokens": [3, 3], "pad_to": 2.0}, TypeError, "pad_to"),
        ({"num_tokens": [3, 3], "plan_len": 0}, ValueError, "plan_len"),
        ({"num_tokens": [3, 200], "pad_to": 4}, ValueError, "rows all bring the same number"),
        ({"num_tokens": [200, 200], "pad_to": 4}, RuntimeError, "full|out of KV blocks"),
        ({"num_tokens": [2, 200]}, RuntimeError, "full|out of KV blocks"),
    ],
)
def test_a_bad_num_tokens_changes_nothing(kwargs, error, match):
    engine = make_engine()
    admitted(engine, ["a", "b"])
    _grow(engine, ["a", "b"], [2, 1], seed=1)
    before = durable_state(engine.cache)
    with pytest.raises(error, match=match):
        engine.begin_step(["a", "b"], **kwargs)
    assert not engine.has_open_step
    assert_same_durable_state(engine.cache, before)


def test_a_bad_accept_leaves_the_step_open():
    engine = make_engine()
    admitted(engine, ["a", "b"])
    inputs = _inputs(5, seed=1)
    tx = engine.begin_step(["a", "b"], num_tokens=[3, 2])
    for i, layer in enumerate(inputs):
        engine.step_layer(tx, i, *layer)
    for accept, error in (([4, 0], ValueError), ((1,), ValueError), ("x", TypeError)):
        with pytest.raises(error):
            engine.commit_step(tx, accept)
        assert engine.has_open_step
    assert engine.commit_step(tx, [3, 1]).seq_lens == (3, 1)
    engine.cache.validate_invariants()


def test_a_scheduled_request_steps_within_its_lifetime_commitment():
    engine = make_engine()
    spec = RequestSpec("a", initial_context_tokens=3, max_new_tokens=2, submission_order=0)
    engine.submit_request(spec)
    scheduler = BlockAwareScheduler(SchedulerConfig(max_active_requests=2, max_batch_size=2))
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
    assert decision.admit == ("a",)
    before = durable_state(engine.cache)
    with pytest.raises(ValueError, match="lifetime commitment has only 5 token"):
        engine.begin_step(["a"], num_tokens=[6])
    assert_same_durable_state(engine.cache, before)
    _step(engine, ["a"], _inputs(5, seed=1), num_tokens=[5])
    assert engine.cache.seq_len("a") == 5


def test_a_window_group_takes_fewer_tokens_than_its_window_per_step():
    cache = PagedKVCache(
        kv_spec=f"(2,32,4,{HKV},{D}):float32:2;(2,32,4,{HKV},{D}):float32:1:window=6",
        device="cpu",
    )
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    admitted(engine, ["a"])
    before = durable_state(cache)
    with pytest.raises(ValueError, match="at most window - 1 = 5 tokens"):
        engine.begin_step(["a"], num_tokens=[6])
    assert_same_state(cache, before)
    # 5 tokens at a time through the window: equal to one token at a time
    twin = DecodeEngine(
        PagedKVCache(
            kv_spec=f"(2,32,4,{HKV},{D}):float32:2;(2,32,4,{HKV},{D}):float32:1:window=6",
            device="cpu",
        ),
        append_backend="torch",
        decode_backend="torch",
    )
    admitted(twin, ["a"])
    for chunk in range(3):
        inputs = _inputs(5, seed=10 + chunk)
        outs, _ = _step(engine, ["a"], inputs, num_tokens=[5])
        for j in range(5):
            want, _ = _step(twin, ["a"], _rows(inputs, [j]))
            for layer in range(3):
                torch.testing.assert_close(
                    outs[layer][j : j + 1], want[layer], rtol=1e-5, atol=1e-5
                )
        cache.validate_invariants()
    assert cache.seq_len("a") == 15


def test_every_backend_writes_the_same_whole_cache_in_mixed_steps():
    """Steps mixing one-token rows and prompt-sized rows write exactly the same bytes (within
    RoPE rounding) on every backend, and nothing outside the reserved slots."""
    caches = []
    for append_backend, decode_backend in BACKENDS:
        engine = make_engine(append_backend, decode_backend, max_blocks=40)
        rids = admitted(engine, ["a", "b", "c", "d"])
        for seed, counts in enumerate(([7, 13, 1, 2], [1, 1, 1, 1], [1, 9, 1, 17])):
            _step(engine, rids, _inputs(sum(counts), seed=seed), num_tokens=counts)
        engine.cache.validate_invariants()
        caches.append(engine.cache)
    for other in caches[1:]:
        torch.testing.assert_close(other.k_cache, caches[0].k_cache, rtol=1e-5, atol=1e-5)
        assert torch.equal(other.v_cache, caches[0].v_cache)
    used = {b for rid in "abcd" for b in caches[0].request_block_ids(rid)}
    unused = [b for b in range(caches[0].max_blocks) if b not in used]
    assert not caches[0].k_cache[:, unused].any() and not caches[-1].v_cache[:, unused].any()


def test_building_every_extend_kernel_variant_leaves_the_cache_as_it_was():
    """The warm start launches each extend kernel variant on a one-token problem over the
    cache's own layers: it reads them and changes nothing."""
    from flashdec.kernels.extend_plan import extend_plan_variants

    engine = make_engine("fused", "triton")
    rids = ["a", "b"]
    for rid in rids:
        engine.cache.add_request(rid)
    _grow(engine, rids, [5, 3], seed=1)
    before = snapshot(engine.cache)
    launches = engine.attention.build_extend_kernels(HQ, max_batch=2)
    variants = extend_plan_variants(
        2,
        HQ,
        HKV,
        D,
        engine.cache.kv_groups[0].block_size,
        torch.float32,
        "cpu",
        max_blocks_per_seq=24,
    )
    assert launches == len(variants) > 4
    assert_same_state(engine.cache, before)
    assert make_engine().attention.build_extend_kernels(HQ, max_batch=2) == 0  # torch backend
