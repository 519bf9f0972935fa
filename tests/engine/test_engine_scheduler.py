"""Scheduler-managed lifecycle: submit, snapshot, plan, apply — and every rejected apply."""

import dataclasses

import pytest
import torch

from flashdec import BlockAwareScheduler, RequestSpec, SchedulerConfig, SchedulerDecision
from flashdec.engine import EngineRequestState
from flashdec.scheduler import GreedyScheduler
from tests.engine.conftest import BS, HKV, NUM_LAYERS, D, make_engine

CONFIG = SchedulerConfig(max_active_requests=4, max_batch_size=2)


def spec(rid, order, context=4, new=4, prefix=None):
    return RequestSpec(rid, context, new, order, prefix_id=prefix)


def engine_with(specs, max_blocks=8, prefix_blocks=0):
    engine = make_engine(max_blocks=max_blocks, prefix_blocks=prefix_blocks)
    for s in specs:
        engine.submit_request(s)
    return engine


def observable(engine):
    cache = engine.cache
    return (
        {rid: engine.request_state(rid) for rid in engine.request_ids()},
        cache.version,
        cache.num_free_blocks,
        cache.metrics(),
    )


def test_plan_and_apply_admits_in_fifo_within_lifetime_budget():
    # each request needs ceil((4 + 4) / 4) = 2 blocks over its lifetime; 5 blocks fit two
    engine = engine_with([spec("a", 0), spec("b", 1), spec("c", 2)], max_blocks=5)
    scheduler = BlockAwareScheduler(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    assert decision.admit == ("a", "b")
    assert engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
    assert engine.request_state("a") is EngineRequestState.ACTIVE
    assert engine.request_state("c") is EngineRequestState.WAITING
    assert engine.cache.request_state("a") == "active"
    engine.cache.validate_invariants()


def test_snapshot_counters_are_optional_and_kept():
    engine = engine_with([spec("a", 0)])
    plain = engine.scheduling_snapshot(3)
    assert plain.step == 3 and plain.waiting[0].wait_steps == 0
    counted = engine.scheduling_snapshot(
        3, waiting_wait_steps={"a": 5}, waiting_skip_counts={"a": 2}
    )
    assert counted.waiting[0].wait_steps == 5 and counted.waiting[0].skip_count == 2
    scheduler = BlockAwareScheduler(CONFIG)
    engine.apply_scheduler_decision(scheduler.plan(counted), scheduler=scheduler, snapshot=counted)


def test_stale_decision_is_rejected_and_changes_nothing():
    engine = engine_with([spec("a", 0), spec("b", 1)])
    scheduler = BlockAwareScheduler(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    engine.submit_request(spec("late", 2))  # the engine moved on
    before = observable(engine)
    with pytest.raises(RuntimeError, match="stale"):
        engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
    assert observable(engine) == before


def test_stale_after_cache_change():
    engine = engine_with([spec("a", 0, context=0), spec("b", 1)])
    scheduler = BlockAwareScheduler(CONFIG)
    first = engine.scheduling_snapshot(0)
    engine.apply_scheduler_decision(scheduler.plan(first), scheduler=scheduler, snapshot=first)
    snapshot = engine.scheduling_snapshot(1)
    decision = scheduler.plan(snapshot)
    k = torch.zeros(NUM_LAYERS, HKV, D)
    engine.prefill_request_layers("a", k, k)  # cache version moves
    before = observable(engine)
    with pytest.raises(RuntimeError, match="stale"):
        engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
    assert observable(engine) == before


@pytest.mark.parametrize("edit", ["admit", "batch", "reject"])
def test_edited_decision_is_rejected(edit):
    engine = engine_with([spec("a", 0), spec("b", 1), spec("huge", 2, context=400)])
    scheduler = BlockAwareScheduler(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    assert decision.reject == ("huge",)
    edited = {
        "admit": dataclasses.replace(decision, admit=("a",), batch=("a",)),
        "batch": dataclasses.replace(decision, batch=decision.batch[:1]),
        "reject": dataclasses.replace(decision, reject=()),
    }[edit]
    before = observable(engine)
    with pytest.raises(ValueError, match="canonical"):
        engine.apply_scheduler_decision(edited, scheduler=scheduler, snapshot=snapshot)
    assert observable(engine) == before


def test_wrong_snapshot_or_config_is_rejected():
    engine = engine_with([spec("a", 0)])
    scheduler = BlockAwareScheduler(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    other_snapshot = engine.scheduling_snapshot(1)
    before = observable(engine)
    with pytest.raises(ValueError, match="snapshot"):
        engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=other_snapshot)
    other = BlockAwareScheduler(dataclasses.replace(CONFIG, max_batch_size=1))
    with pytest.raises(ValueError, match="planned with"):
        engine.apply_scheduler_decision(decision, scheduler=other, snapshot=snapshot)
    with pytest.raises(TypeError, match="BlockAwareScheduler"):
        engine.apply_scheduler_decision(
            decision, scheduler=GreedyScheduler(CONFIG), snapshot=snapshot
        )
    with pytest.raises(TypeError, match="SchedulerDecision"):
        engine.apply_scheduler_decision("admit all", scheduler=scheduler, snapshot=snapshot)
    assert observable(engine) == before


def test_non_canonical_subclass_is_rejected():
    class Eager(BlockAwareScheduler):
        """Admits everything that is waiting (ignores lifetime commitments)."""

        def plan(self, snapshot):
            ids = snapshot.waiting_ids[: self.config.max_active_requests]
            return SchedulerDecision(
                ids, (), ids[: self.config.max_batch_size], snapshot, self.config
            )

    engine = engine_with([spec("a", 0, new=20), spec("b", 1, new=20)], max_blocks=8)
    scheduler = Eager(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    before = observable(engine)
    with pytest.raises(ValueError, match="canonical"):
        engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
    assert observable(engine) == before


def test_prefix_request_is_attached_on_admission():
    engine = make_engine(max_blocks=12, prefix_blocks=4)
    blocks = torch.randn(NUM_LAYERS, 2, HKV, BS, D)
    engine.register_prefix("sys", blocks, blocks + 1)
    engine.submit_request(spec("p", 0, context=2 * BS, prefix="sys"))
    with pytest.raises(ValueError, match="context must be its prefix"):
        engine.submit_request(spec("q", 1, context=3, prefix="sys"))
    with pytest.raises(ValueError, match="registered"):
        engine.submit_request(spec("r", 2, context=8, prefix="nope"))
    scheduler = BlockAwareScheduler(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    decision = scheduler.plan(snapshot)
    engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
    assert engine.cache.request_prefix("p") == "sys"
    assert engine.cache.seq_len("p") == 2 * BS
    with pytest.raises(RuntimeError, match="finished, cancelled"):
        engine.evict_prefix("sys")
    with pytest.raises(RuntimeError, match="register prefixes before"):
        engine.register_prefix("late", blocks, blocks)
    engine.cancel_request("p")
    engine.evict_prefix("sys")
    assert engine.cache.num_free_blocks == 12


def test_modes_do_not_mix_and_submissions_are_validated():
    engine = engine_with([spec("a", 0)])
    with pytest.raises(RuntimeError, match="scheduler-managed"):
        engine.add_request("x")
    with pytest.raises(ValueError, match="already exists"):
        engine.submit_request(spec("a", 5))
    with pytest.raises(ValueError, match="submission_order"):
        engine.submit_request(spec("b", 0))
    with pytest.raises(TypeError, match="RequestSpec"):
        engine.submit_request({"request_id": "c"})
    with pytest.raises(RuntimeError, match="apply_scheduler_decision"):
        engine.admit("a")
    unscheduled = make_engine()
    unscheduled.add_request("x")
    with pytest.raises(RuntimeError, match="unscheduled"):
        unscheduled.submit_request(spec("y", 0))


def test_no_decision_applies_while_a_step_is_open():
    engine = engine_with([spec("a", 0, context=0), spec("b", 1)])
    scheduler = BlockAwareScheduler(CONFIG)
    snapshot = engine.scheduling_snapshot(0)
    engine.apply_scheduler_decision(
        scheduler.plan(snapshot), scheduler=scheduler, snapshot=snapshot
    )
    tx = engine.begin_step(["a"])
    with pytest.raises(RuntimeError, match="open"):
        engine.scheduling_snapshot(1)
    with pytest.raises(RuntimeError, match="open"):
        engine.apply_scheduler_decision(
            scheduler.plan(snapshot), scheduler=scheduler, snapshot=snapshot
        )
    engine.abort_step(tx)
