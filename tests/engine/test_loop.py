"""The serving loop: one step's bookkeeping, early finishes, early stops and clean-up."""

from collections import Counter

import pytest
import torch

from flashdec.engine.loop import ServingLoop, StepExecutor, run_loop
from flashdec.scheduler import BlockAwareScheduler, GreedyScheduler, RequestSpec, SchedulerConfig
from tests.engine.conftest import HKV, HQ, D, make_engine

CONFIG = SchedulerConfig(max_active_requests=4, max_batch_size=3)


class Recorder(StepExecutor):
    """Zero K/V; finishes the ids in ``eos`` after their first token."""

    def __init__(self, engine, eos=()):
        self.engine = engine
        self.eos = set(eos)
        self.prefills = []
        self.batches = []

    def prefill(self, requests):
        self.prefills.append(list(requests))
        total = sum(n for _, n in requests)
        tx = self.engine.begin_prefill([r for r, _ in requests], [n for _, n in requests])
        for layer in range(self.engine.cache.num_layers):
            kv = torch.zeros(total, HKV, D)
            self.engine.prefill_layer(tx, layer, kv, kv)
        self.engine.commit_step(tx)

    def decode(self, batch):
        self.batches.append(list(batch))
        tx = self.engine.begin_step(list(batch))
        for layer in range(self.engine.cache.num_layers):
            n = len(batch)
            self.engine.step_layer(tx, layer, torch.zeros(n, HQ, D), *torch.zeros(2, n, HKV, D))
        self.engine.commit_step(tx)
        return self.eos & set(batch)


def specs(*rows):
    return [RequestSpec(f"r{i}", ctx, new, i) for i, (ctx, new) in enumerate(rows)]


def test_a_step_admits_imports_decodes_and_finishes():
    engine = make_engine(max_blocks=32)
    executor = Recorder(engine)
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), executor, check_invariants=True)
    for spec in specs((5, 1), (0, 2)):
        loop.submit(spec)
    record = loop.step()
    # r0 imports its prompt (it decodes from the next step on); r1 has none and decodes now
    assert record.admitted == ("r0", "r1") and record.served == ("r1",)
    assert record.prefilled == ("r0",)
    assert executor.prefills == [[("r0", 5)]]  # a 0-token context needs no import
    assert record.finished == () and (record.waiting, record.active) == (0, 2)
    assert engine.cache.seq_len("r0") == 5 and engine.cache.seq_len("r1") == 1
    assert loop.generated == {"r0": 0, "r1": 1}
    record = loop.step()
    assert record.served == ("r0", "r1") and record.finished == ("r0", "r1") and loop.idle
    assert loop.generated == {}  # the loop keeps counts for live requests only
    assert engine.cache.metrics()["num_used_blocks"] == 0


def test_executor_can_finish_a_request_early():
    engine = make_engine(max_blocks=32)
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), Recorder(engine, eos={"r1"}))
    run = run_loop(loop, [(0, s) for s in specs((3, 4), (3, 4))], max_steps=50)
    decoded = Counter(rid for record in run.steps for rid in record.served)
    assert decoded == {"r0": 4, "r1": 1}
    assert not run.stopped_early and run.unfinished == ()
    assert engine.request_state("r1") == "finished"


def test_early_stop_reports_and_cancels_the_unfinished():
    engine = make_engine(max_blocks=5)  # room for two requests at a time
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), Recorder(engine))
    arrivals = [(0, s) for s in specs((4, 4), (4, 4), (4, 4))] + [(40, specs((1, 1))[0])]
    arrivals[-1] = (40, RequestSpec("late", 1, 1, 9))
    run = run_loop(loop, arrivals, max_steps=3)
    assert run.stopped_early and not run.deadlock
    assert run.unfinished_active == ("r0", "r1")
    assert run.unfinished_waiting == ("r2", "late")  # still queued, and not yet arrived
    assert engine.request_state("r0") == "cancelled" and engine.request_state("r2") == "cancelled"
    assert engine.cache.num_free_blocks == engine.cache.max_blocks
    engine.cache.validate_invariants()


def test_greedy_deadlock_is_detected_and_cleaned_up():
    engine = make_engine(max_blocks=2)  # block size 4: both contexts fit, neither can grow
    loop = ServingLoop(engine, GreedyScheduler(CONFIG), Recorder(engine))
    run = run_loop(loop, [(0, s) for s in specs((4, 2), (4, 2))], max_steps=100, patience=3)
    assert run.deadlock and not run.stopped_early
    assert run.unfinished_active == ("r0", "r1")
    assert run.steps[0].prefilled == ("r0", "r1")  # the prompts go in, then nothing moves
    assert all(r.stuck == ("r0", "r1") for r in run.steps[1:])
    assert engine.cache.num_free_blocks == 2


def test_plan_hook_sees_every_snapshot_and_decision():
    engine = make_engine(max_blocks=32)
    seen = []
    loop = ServingLoop(
        engine,
        BlockAwareScheduler(CONFIG),
        Recorder(engine),
        on_plan=lambda snap, decision: seen.append((snap.step, decision.admit)),
    )
    run_loop(loop, [(0, s) for s in specs((1, 2))], max_steps=10)
    assert seen == [(0, ("r0",)), (1, ()), (2, ())]  # import, then two decodes


def test_constructor_checks_its_arguments():
    engine = make_engine()
    with pytest.raises(TypeError, match="DecodeEngine"):
        ServingLoop(object(), BlockAwareScheduler(CONFIG), Recorder(engine))
    with pytest.raises(TypeError, match="scheduler"):
        ServingLoop(engine, object(), Recorder(engine))


class Failing(Recorder):
    """A Recorder whose prefill fails on the ``n``-th prompt of a call (after importing the
    ones before it, each in its own transaction), or whose decode fails before its commit."""

    def __init__(self, engine, prefill_fails_at=None, decode_fails=False):
        super().__init__(engine)
        self.prefill_fails_at = prefill_fails_at
        self.decode_fails = decode_fails
        self.forgotten = []

    def prefill(self, requests):
        for i, request in enumerate(requests):
            if i == self.prefill_fails_at:
                raise KeyboardInterrupt
            super().prefill([request])

    def decode(self, batch):
        if self.decode_fails:
            tx = self.engine.begin_step(list(batch))
            self.engine.abort_step(tx)
            raise RuntimeError("the model failed")
        return super().decode(batch)

    def revert_admission(self, request_ids):
        self.forgotten.append(tuple(request_ids))


def _observed(engine, loop):
    """Everything a step may change: states, lengths, counters, the pool, the loop's books."""
    snap = engine.scheduling_snapshot(loop.step_index)
    states = {rid: str(engine.request_state(rid)) for rid in loop.generated}
    return states, snap.active, tuple(snap.waiting), engine.cache.num_free_blocks, loop.live_ids


def _scenario(executor, fail):
    """r0 runs; then one step admits r1 and r2 (two imports), rejects r3 (it can never fit)
    and decodes all three. ``fail`` (if given) arms the executor for that step's first try."""
    engine = executor.engine
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), executor, check_invariants=True)
    r0, r1, r2, r3 = specs((4, 3), (5, 2), (3, 2), (40, 2))
    loop.submit(r0)
    records = [loop.step()]
    for spec in (r1, r2, r3):
        loop.submit(spec)
    before = _observed(engine, loop)
    if fail is not None:
        fail(executor)
        with pytest.raises((KeyboardInterrupt, RuntimeError)):
            loop.step()
        assert _observed(engine, loop) == before
        assert loop.generated == {"r0": 0, "r1": 0, "r2": 0, "r3": 0} and loop.step_index == 1
        assert executor.forgotten == [("r1", "r2")]
        executor.prefill_fails_at, executor.decode_fails = None, False
    while not loop.idle:
        records.append(loop.step())
    assert engine.cache.num_free_blocks == engine.cache.max_blocks
    return [(r.admitted, r.rejected, r.batch, r.served, r.finished) for r in records], loop


@pytest.mark.parametrize(
    "fail",
    [
        lambda e: setattr(e, "prefill_fails_at", 0),
        lambda e: setattr(e, "prefill_fails_at", 1),  # after r1's import was committed
        lambda e: setattr(e, "decode_fails", True),  # after both imports
    ],
    ids=["first-import", "second-import", "decode"],
)
def test_a_failed_step_is_taken_back_whole(fail):
    expected, _ = _scenario(Failing(make_engine(max_blocks=8)), None)
    assert expected[1] == (("r1", "r2"), ("r3",), ("r0", "r1", "r2"), ("r0",), ())
    records, loop = _scenario(Failing(make_engine(max_blocks=8)), fail)
    assert records == expected
    assert loop.generated == {}  # counts are kept while a request is live


def test_revert_decision_takes_back_only_the_last_step_before_it_ends():
    engine = make_engine(max_blocks=8)
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), Recorder(engine))
    loop.submit(specs((4, 2))[0])
    snapshot = engine.scheduling_snapshot(0)
    decision = loop.scheduler.plan(snapshot)
    with pytest.raises(RuntimeError, match="applied last"):
        engine.submissions.revert_decision(decision)  # not applied yet
    loop.step()  # applied, then the step ended (the fairness counters moved)
    with pytest.raises(RuntimeError, match="applied last"):
        engine.submissions.revert_decision(decision)
    assert engine.request_state("r0") == "active" and engine.cache.seq_len("r0") == 4


def test_rejections_say_why():
    engine = make_engine(max_blocks=8)
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), Recorder(engine))
    big, small = RequestSpec("big", 40, 2, 0), RequestSpec("small", 4, 2, 1)
    assert loop.rejection_reason(big) == "needs a 11-block table, more than max_blocks_per_seq 8"
    assert loop.rejection_reason(small) is None
    with pytest.raises(TypeError, match="RequestSpec"):
        loop.rejection_reason("big")
    for spec in (big, small):
        loop.submit(spec)
    record = loop.step()
    assert record.rejected == ("big",)
    assert record.rejection_reasons == (loop.rejection_reason(big),)


def test_a_step_budget_splits_prompts_and_decodes_first():
    """With ``max_step_tokens`` a step brings the running requests' decode tokens first, then
    prompt chunks in admission order; a long prompt spans several steps and every step takes
    at least one prompt token."""
    engine = make_engine(max_blocks=32)
    executor = Recorder(engine)
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), executor, max_step_tokens=6)
    loop.submit(RequestSpec("r0", 4, 5, 0))
    assert loop.step().prefilled == ("r0",)  # 4 tokens
    loop.submit(RequestSpec("r1", 9, 1, 1))
    loop.submit(RequestSpec("r2", 3, 1, 2))
    record = loop.step()
    assert record.served == ("r0",) and record.prefilled == ("r1",)
    assert executor.prefills[-1] == [("r1", 5)]  # 6 - one decode token
    record = loop.step()
    assert record.served == ("r0",) and executor.prefills[-1] == [("r1", 4), ("r2", 1)]
    record = loop.step()
    assert record.served == ("r0", "r1") and executor.prefills[-1] == [("r2", 2)]
    assert engine.cache.seq_len("r1") == 10 and engine.cache.seq_len("r2") == 3
    run = run_loop(loop, [], max_steps=20)
    assert run.unfinished == () and engine.cache.num_free_blocks == engine.cache.max_blocks
    with pytest.raises(ValueError, match="max_step_tokens"):
        ServingLoop(engine, BlockAwareScheduler(CONFIG), executor, max_step_tokens=0)


def test_cancel_mid_prompt_frees_the_blocks():
    engine = make_engine(max_blocks=32)
    loop = ServingLoop(engine, BlockAwareScheduler(CONFIG), Recorder(engine), max_step_tokens=4)
    loop.submit(RequestSpec("r0", 10, 2, 0))
    loop.step()
    assert engine.cache.seq_len("r0") == 4
    loop.cancel("r0")
    assert engine.request_state("r0") == "cancelled" and loop.idle
    assert engine.cache.num_free_blocks == engine.cache.max_blocks
    with pytest.raises(ValueError, match="not live"):
        loop.cancel("r0")
    assert loop.step().prefilled == ()
