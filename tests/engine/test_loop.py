"""The serving loop: one step's bookkeeping, early finishes, early stops and clean-up."""

from collections import Counter

import pytest
import torch

from flashdec.engine.loop import ServingLoop, run_loop
from flashdec.scheduler import BlockAwareScheduler, GreedyScheduler, RequestSpec, SchedulerConfig
from tests.engine.conftest import HKV, HQ, D, make_engine

CONFIG = SchedulerConfig(max_active_requests=4, max_batch_size=3)


class Recorder:
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
    assert record.admitted == ("r0", "r1") and record.served == ("r0", "r1")
    assert executor.prefills == [[("r0", 5)]]  # a 0-token context needs no import
    assert record.finished == ("r0",) and engine.request_state("r0") == "finished"
    assert (record.waiting, record.active) == (0, 1)
    # the loop keeps counts for live requests only: r0's left with it
    assert engine.cache.seq_len("r1") == 1 and loop.generated == {"r1": 1}
    assert not loop.idle
    record = loop.step()
    assert record.finished == ("r1",) and loop.idle and loop.generated == {}
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
    assert all(r.stuck == ("r0", "r1") for r in run.steps)
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
    assert seen == [(0, ("r0",)), (1, ())]


def test_constructor_checks_its_arguments():
    engine = make_engine()
    with pytest.raises(TypeError, match="DecodeEngine"):
        ServingLoop(object(), BlockAwareScheduler(CONFIG), Recorder(engine))
    with pytest.raises(TypeError, match="scheduler"):
        ServingLoop(engine, object(), Recorder(engine))
