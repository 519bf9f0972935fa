import pytest

from flashdec.scheduler import (
    POLICIES,
    BlockAwareScheduler,
    CancelScheduler,
    GreedyScheduler,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    make_scheduler,
)
from tests.scheduler.strategies import make_snapshot

CFG = SchedulerConfig(max_active_requests=8, max_batch_size=8)


def _spec(i, ctx=4, new=4, pid=None):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i, prefix_id=pid)


def test_policy_registry():
    assert {name: cls.name for name, cls in POLICIES.items()} == {
        "lifetime": "lifetime",
        "cancel": "cancel",
        "greedy": "greedy",
    }
    assert isinstance(make_scheduler("lifetime", CFG), BlockAwareScheduler)
    assert make_scheduler("greedy", CFG).config == CFG
    with pytest.raises(ValueError):
        make_scheduler("fifo", CFG)


def test_greedy_admits_while_the_context_fits_now():
    # 4 blocks, each request's context takes 1: greedy takes all 4 (lifetime would take 2)
    snap = make_snapshot(total_blocks=4, waiting=[(_spec(i),) for i in range(5)])
    d = GreedyScheduler(CFG).plan(snap)
    assert d.admit == ("r0", "r1", "r2", "r3")
    assert CancelScheduler(CFG).plan(snap) == d


def test_greedy_is_strict_fifo_and_honours_caps():
    snap = make_snapshot(
        total_blocks=5, waiting=[(_spec(0),), (_spec(1, 17, 1),), (_spec(2),), (_spec(3),)]
    )
    assert GreedyScheduler(CFG).plan(snap).admit == ("r0",)  # r1 needs 5 > 4 free: stop
    snap = make_snapshot(total_blocks=8, waiting=[(_spec(i),) for i in range(5)])
    assert GreedyScheduler(SchedulerConfig(3, 8)).plan(snap).admit == ("r0", "r1", "r2")
    cfg = SchedulerConfig(8, 2, reserve_blocks=5)
    d = GreedyScheduler(cfg).plan(snap)
    assert d.admit == ("r0", "r1", "r2") and len(d.batch) == 2


def test_greedy_counts_a_shared_prefix_as_free_now():
    p = PrefixInfo("sys", 2, 8, 0)
    snap = make_snapshot(
        total_blocks=3, prefixes=(p,), waiting=[(_spec(i, 8, 4, "sys"),) for i in range(3)]
    )
    # contexts are all on the prefix: nothing needed now, greedy admits every one
    assert GreedyScheduler(CFG).plan(snap).admit == ("r0", "r1", "r2")
    assert BlockAwareScheduler(CFG).plan(snap).admit == ("r0",)


def test_greedy_rejects_what_can_never_run():
    snap = make_snapshot(total_blocks=4, waiting=[(_spec(0, 4, 40),), (_spec(1),)])
    d = GreedyScheduler(CFG).plan(snap)
    assert d.reject == ("r0",) and d.admit == ("r1",)


def test_cancel_victims_are_the_newest_until_the_rest_fit():
    # 4 requests at a block boundary on a full pool: cancelling r3 and r2 frees 2 blocks for
    # r0 and r1
    active = [(_spec(i), 4) for i in range(4)]
    snap = make_snapshot(total_blocks=4, active=active)
    assert snap.free_blocks == 0
    needing = ["r0", "r1", "r2", "r3"]
    assert CancelScheduler(CFG).select_victims(snap, needing) == ("r3", "r2")
    # victims need not be in the batch: r3 (not needing) still frees its block first
    assert CancelScheduler(CFG).select_victims(snap, ["r0"]) == ("r3",)
    assert CancelScheduler(CFG).select_victims(snap, []) == ()
    assert GreedyScheduler(CFG).select_victims(snap, needing) == ()
    assert BlockAwareScheduler(CFG).select_victims(snap, needing) == ()
    with pytest.raises(ValueError):
        CancelScheduler(CFG).select_victims(snap, ["zz"])
