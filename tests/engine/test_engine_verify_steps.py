"""Fixed-shape verification steps (every row the same n tokens, padded to a batch bucket): the
same attention and cache as the packed step, padding neither stored nor attended, capture and
replay refused without changing anything (CPU); capture/replay equal to eager (GPU)."""

import pytest
import torch

from flashdec.cache.slots import PAD_BLOCK_ID
from flashdec.engine.step import CapturedStep
from flashdec.engine.verify_state import VerifySlots, extend_launch_key, verify_plan
from flashdec.kernels import plan_extend
from tests.cache.snapshot import assert_same_state, snapshot
from tests.engine.conftest import HKV, HQ, D, make_engine


def _admitted(engine, rids, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    tx = engine.begin_prefill(rids, lengths)
    for layer in range(engine.cache.num_layers):
        kv = torch.randn(2, sum(lengths), HKV, D, generator=gen)
        engine.prefill_layer(tx, layer, kv[0], kv[1])
    engine.commit_step(tx)


def _layers(engine, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(rows, h, D, generator=gen) for h in (HQ, HKV, HKV))
        for _ in range(engine.cache.num_layers)
    ]


def _pad(x, rows):
    return torch.cat([x, torch.randn(rows - x.shape[0], *x.shape[1:])])


@pytest.mark.parametrize("backends", [("torch", "torch"), ("triton", "triton")])
def test_a_padded_fixed_step_equals_the_packed_step(backends):
    """Rows of n tokens padded to a bigger bucket: the live rows' attention and the committed
    cache (accept < n included: the rest rolls back) are the packed step's, padding rows'
    inputs are garbage that nobody stores or attends."""
    n, rids, lengths = 3, ["a", "b", "c"], [5, 1, 9]
    packed, fixed = make_engine(*backends), make_engine(*backends)
    for engine in (packed, fixed):
        _admitted(engine, rids, lengths)
    inputs = _layers(packed, n * len(rids), seed=1)
    tx = packed.begin_step(rids, num_tokens=[n] * 3)
    want = [packed.step_layer(tx, i, *layer) for i, layer in enumerate(inputs)]
    packed.commit_step(tx, accept=[3, 1, 2])

    tx = fixed.begin_step(rids, num_tokens=[n] * 3, pad_to=4)
    assert fixed.step_slots(tx).num_rows == 4
    padded = [[_pad(x, 4 * n) for x in layer] for layer in inputs]
    got = [fixed.step_layer(tx, i, *layer) for i, layer in enumerate(padded)]
    fixed.commit_step(tx, accept=[3, 1, 2])
    for w, g in zip(want, got, strict=True):
        assert g.shape[0] == 4 * n
        torch.testing.assert_close(g[: 3 * n], w, atol=1e-5, rtol=1e-5)
    a, b = snapshot(packed.cache), snapshot(fixed.cache)
    for name in ("k", "v"):
        assert a.pop(name).equal(b.pop(name))
    assert [packed.cache.seq_len(r) for r in rids] == [fixed.cache.seq_len(r) for r in rids]
    fixed.cache.validate_invariants()


def test_fixed_slots_pad_the_rows_past_the_live_ones_when_their_count_changes():
    engine = make_engine()
    _admitted(engine, ["a", "b"], [2, 6])
    fixed = VerifySlots(engine.cache, 0, 4, 2)
    for live in (["a", "b"], ["b"], ["a", "b"]):
        tx = engine.begin_step(live, num_tokens=[2] * len(live))
        slots = fixed.fill(engine.cache.steps.transaction_slots(tx))
        engine.abort_step(tx)
        count = len(live)
        assert (slots.batch, slots.num_rows, slots.num_tokens) == (count, 4, 2 * count)
        assert fixed.query_lens.tolist() == [2] * count + [0] * (4 - count)
        assert fixed.block_ids[2 * count :].tolist() == [PAD_BLOCK_ID] * (8 - 2 * count)
        assert fixed.seq_lens_after[count:].tolist() == [0] * (4 - count)
        after = [engine.cache.seq_len(r) + 2 for r in live]
        assert fixed.seq_lens_after[:count].tolist() == after
        assert fixed.positions[: 2 * count].tolist() == [
            p for r in live for p in range(engine.cache.seq_len(r), engine.cache.seq_len(r) + 2)
        ]
    tx = engine.begin_step(["a", "b"], num_tokens=[3, 3])
    with pytest.raises(ValueError, match="does not fit 4 rows of 2 tokens"):
        fixed.fill(engine.cache.steps.transaction_slots(tx))
    engine.abort_step(tx)


def test_capture_and_replay_refuse_steps_they_cannot_take_and_change_nothing():
    engine = make_engine()
    _admitted(engine, ["a", "b"], [3, 4])
    tx = engine.begin_step(["a", "b"], num_tokens=[2, 3])  # not fixed: fresh metadata
    with pytest.raises(RuntimeError, match="without fixed metadata"):
        engine.capture_step(tx, lambda: None)
    with pytest.raises(RuntimeError, match="without fixed metadata"):
        engine.replay_step(tx, object())
    assert engine.has_open_step and engine.cache.steps.layers_written(tx) == 0
    engine.abort_step(tx)

    tx = engine.begin_step(["a", "b"], num_tokens=[3, 3], pad_to=2)
    with pytest.raises(RuntimeError, match=r"decode_backend=.triton."):  # torch backends (CPU)
        engine.capture_step(tx, lambda: None)
    generations = engine._open.generations
    same = CapturedStep(engine, None, None, 2, generations, (), tokens_per_row=3)
    other_n = CapturedStep(engine, None, None, 2, generations, (), tokens_per_row=2)
    other_rows = CapturedStep(engine, None, None, 4, generations, (), tokens_per_row=3)
    assert same.fits(tx) and not other_n.fits(tx) and not other_rows.fits(tx)
    before = snapshot(engine.cache)
    for captured in (other_n, other_rows):
        with pytest.raises(ValueError, match="capture again"):
            engine.replay_step(tx, captured)
    assert engine.has_open_step and engine.cache.steps.layers_written(tx) == 0
    assert_same_state(engine.cache, before)
    engine.abort_step(tx)

    tx = engine.begin_step(["a", "b"], pad_to=2)  # a decode graph never fits a verify step
    decode = CapturedStep(engine, None, None, 2, engine._open.generations, ())
    engine.abort_step(tx)
    tx = engine.begin_step(["a", "b"], num_tokens=[3, 3], pad_to=2)
    assert not decode.fits(tx)
    engine.abort_step(tx)


def test_an_extend_launch_key_drops_the_length_only_where_the_launch_ignores_it():
    fixed = {"max_query_len": 5, "num_splits": 1}
    one = [
        plan_extend(8, 40, HQ, HKV, D, 16, n, torch.float32, "cpu", "token_major", 64, **fixed)
        for n in (100, 900)
    ]
    assert one[0].tokens_per_split != one[1].tokens_per_split
    assert extend_launch_key(one[0]) == extend_launch_key(one[1])
    two, four = (
        plan_extend(1, 5, HQ, HKV, D, 16, 4096, torch.float32, "cpu", num_splits=s) for s in (2, 4)
    )
    assert extend_launch_key(two) != extend_launch_key(four)


def test_a_fixed_step_plan_is_sized_for_its_rows_and_tokens():
    engine = make_engine()
    plan = verify_plan(engine.cache, 0, 4, 5, HQ, 64, torch.float32)
    assert (plan.batch, plan.total_q, plan.max_query_len, plan.max_seq_len) == (4, 20, 5, 64)
