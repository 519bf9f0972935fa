import pytest

from flashdec.scheduler import (
    BlockAwareScheduler,
    FairnessCounters,
    RequestSpec,
    SchedulerConfig,
    advance_fairness_counters,
    counters_of,
)
from tests.scheduler.strategies import make_snapshot


def _spec(i, ctx=4, new=4):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i)


def _step():
    # r0 r1 active (r1 waited 2 steps for service); waiting r2 (too big now), r3 (fits)
    snap = make_snapshot(
        total_blocks=6,
        active=[(_spec(0), 5, 0), (_spec(1), 5, 2)],
        waiting=[(_spec(2, 4, 8), 3, 1), (_spec(3), 1, 0)],
    )
    decision = BlockAwareScheduler(SchedulerConfig(8, 2)).plan(snap)
    return snap, decision


def test_plan_of_the_fixture():
    _, d = _step()
    assert d.admit == ("r3",) and d.batch == ("r1", "r0")


def test_advance_counters_rules():
    snap, d = _step()
    c = advance_fairness_counters(snap, d)
    assert c.waiting_wait_steps == (("r2", 4),)
    assert c.waiting_skip_counts == (("r2", 2),)  # overtaken by r3
    # r3 admitted but not in the full batch: waits 1 step for service
    assert c.active_service_wait_steps == (("r0", 0), ("r1", 0), ("r3", 1))
    assert c.as_kwargs() == {
        "waiting_wait_steps": {"r2": 4},
        "waiting_skip_counts": {"r2": 2},
        "active_service_wait_steps": {"r0": 0, "r1": 0, "r3": 1},
    }


def test_advance_counters_served_and_departed():
    snap, d = _step()
    c = advance_fairness_counters(snap, d, served_ids=["r1"], departed_ids=["r0", "r3"])
    assert c.active_service_wait_steps == (("r1", 0),)
    c = advance_fairness_counters(snap, d, served_ids=[])
    assert c.active_service_wait_steps == (("r0", 1), ("r1", 3), ("r3", 1))


def test_no_skip_without_a_later_admission():
    # r0 (earlier) is admitted, r1 does not fit: being passed by an *earlier* request is no skip
    snap = make_snapshot(
        total_blocks=4, active=[(_spec(9), 4)], waiting=[(_spec(0), 0, 0), (_spec(1, 4, 8), 2, 5)]
    )
    d = BlockAwareScheduler(SchedulerConfig(8, 8, aging_threshold=None)).plan(snap)
    assert d.admit == ("r0",)
    c = advance_fairness_counters(snap, d)
    assert c.waiting_skip_counts == (("r1", 5),) and c.waiting_wait_steps == (("r1", 3),)
    # nothing admitted at all (active cap): no skips either
    d = BlockAwareScheduler(SchedulerConfig(1, 8, aging_threshold=None)).plan(snap)
    assert d.admit == ()
    assert advance_fairness_counters(snap, d).waiting_skip_counts == (("r0", 0), ("r1", 5))


def test_counters_round_trip_and_validation():
    snap, d = _step()
    assert counters_of(snap) == FairnessCounters(
        (("r2", 3), ("r3", 1)), (("r2", 1), ("r3", 0)), (("r0", 0), ("r1", 2))
    )
    other = make_snapshot(total_blocks=6)
    with pytest.raises(ValueError):
        advance_fairness_counters(other, d)
    with pytest.raises(ValueError):
        advance_fairness_counters(snap, d, served_ids=["r2"])
    with pytest.raises(ValueError):
        advance_fairness_counters(snap, d, departed_ids=["r2"])
    with pytest.raises(TypeError):
        advance_fairness_counters(snap, None)  # type: ignore[arg-type]
