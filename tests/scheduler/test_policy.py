"""Unit tests of the lifetime policy's rules, one rule per test."""

import dataclasses

import pytest

from flashdec.scheduler import (
    BlockAwareScheduler,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    SchedulerDecision,
    lifetime_headroom,
    rejection_reason,
)
from tests.scheduler.strategies import make_snapshot

CFG = SchedulerConfig(max_active_requests=8, max_batch_size=8)


def _spec(i, ctx=4, new=4, pid=None):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i, prefix_id=pid)


def plan(snapshot, config=CFG):
    return BlockAwareScheduler(config).plan(snapshot)


def test_admits_by_lifetime_not_by_current_need():
    # each needs 1 block now but 2 over its life: a 4-block pool takes 2, not 4
    snap = make_snapshot(total_blocks=4, waiting=[(_spec(i),) for i in range(4)])
    d = plan(snap)
    assert d.admit == ("r0", "r1") and d.reject == ()
    assert d.batch == ("r0", "r1")  # admitted requests decode in the same step


def test_active_remaining_commitment_is_respected():
    # r0 holds 1 block now but will need 3 (ctx 4 + 8 new): 2 stay set aside for it
    snap = make_snapshot(total_blocks=5, active=[(_spec(0, 4, 8), 4)], waiting=[(_spec(1),)])
    assert lifetime_headroom(snap, 0) == 2
    assert plan(snap).admit == ("r1",)
    snap = make_snapshot(total_blocks=4, active=[(_spec(0, 4, 8), 4)], waiting=[(_spec(1),)])
    assert plan(snap).admit == ()


def test_headroom_takes_the_smaller_of_pool_and_free_views():
    # 2 blocks of the pool are held by something the snapshot does not list
    snap = make_snapshot(total_blocks=8, free_blocks=6, waiting=[(_spec(0, 4, 20),)])
    assert lifetime_headroom(snap, 0) == 6
    assert plan(snap).admit == ("r0",)  # needs 6: exactly fits
    snap = make_snapshot(total_blocks=8, free_blocks=5, waiting=[(_spec(0, 4, 20),)])
    assert plan(snap).admit == ()


def test_reserve_blocks_are_never_committed():
    snap = make_snapshot(total_blocks=6, waiting=[(_spec(i),) for i in range(3)])
    assert plan(snap).admit == ("r0", "r1", "r2")
    assert plan(snap, dataclasses.replace(CFG, reserve_blocks=1)).admit == ("r0", "r1")
    assert lifetime_headroom(snap, 2) == 4


def test_max_active_requests_caps_admission():
    snap = make_snapshot(
        total_blocks=64, active=[(_spec(0), 5)], waiting=[(_spec(i),) for i in range(1, 5)]
    )
    assert plan(snap, SchedulerConfig(3, 8)).admit == ("r1", "r2")
    assert plan(snap, SchedulerConfig(1, 8)).admit == ()


def test_prefix_blocks_counted_once():
    p = PrefixInfo("sys", num_blocks=4, num_tokens=16, refcount=0)
    # 16-token context on the prefix + 4 new tokens -> 1 private block each
    waiting = [(_spec(i, 16, 4, "sys"),) for i in range(6)]
    snap = make_snapshot(total_blocks=10, prefixes=(p,), waiting=waiting)
    assert plan(snap).admit == tuple(f"r{i}" for i in range(6))
    # the same requests without sharing need 5 blocks each: only one fits beside the prefix
    private = [(_spec(i, 16, 4),) for i in range(6)]
    snap = make_snapshot(total_blocks=10, prefixes=(p,), waiting=private)
    assert plan(snap).admit == ("r0",)


@pytest.mark.parametrize(
    ("spec", "max_per_seq", "why"),
    [
        (_spec(0, 8, 4, "nope"), 16, "not resident"),
        (_spec(0, 4, 4, "sys"), 16, "cover"),
        (_spec(0, 4, 56), 16, "empty pool"),  # 15 private blocks > 16 - 2 prefix blocks
        (_spec(0, 8, 24, "sys"), 7, "max_blocks_per_seq"),  # 8-block table > 7
    ],
)
def test_rejects_requests_that_can_never_run(spec, max_per_seq, why):
    p = PrefixInfo("sys", 2, 8, 0)
    snap = make_snapshot(
        total_blocks=16,
        max_blocks_per_seq=max_per_seq,
        prefixes=(p,),
        waiting=[(spec,), (_spec(1),)],
    )
    d = plan(snap)
    assert d.reject == ("r0",) and d.admit == ("r1",)
    assert why in rejection_reason(snap.waiting[0], snap, CFG)
    assert rejection_reason(snap.waiting[1], snap, CFG) is None


def test_reject_counts_the_reserve():
    snap = make_snapshot(total_blocks=8, waiting=[(_spec(0, 4, 28),)])  # 8 blocks
    assert plan(snap).reject == ()
    assert plan(snap, dataclasses.replace(CFG, reserve_blocks=1)).reject == ("r0",)


def test_backfills_past_a_request_that_does_not_fit_yet():
    # r0 holds 2 of 4 blocks; r1 needs 3 (waits), r2 needs 2 (overtakes it)
    snap = make_snapshot(
        total_blocks=4, active=[(_spec(0), 4)], waiting=[(_spec(1, 4, 8), 0, 0), (_spec(2), 0, 0)]
    )
    assert plan(snap).admit == ("r2",)


def test_aged_request_blocks_later_arrivals():
    def snap_with(skips):
        return make_snapshot(
            total_blocks=4,
            active=[(_spec(0), 4)],
            waiting=[(_spec(1, 4, 8), 5, skips), (_spec(2), 0, 0)],
        )

    cfg = SchedulerConfig(8, 8, aging_threshold=3)
    assert plan(snap_with(2), cfg).admit == ("r2",)
    assert plan(snap_with(3), cfg).admit == ()  # aged: r2 may not overtake r1
    assert plan(snap_with(99), SchedulerConfig(8, 8, aging_threshold=None)).admit == ("r2",)
    assert plan(snap_with(0), SchedulerConfig(8, 8, aging_threshold=0)).admit == ()  # strict FIFO


def test_aged_request_does_not_block_earlier_ones():
    cfg = SchedulerConfig(8, 8, aging_threshold=1)
    snap = make_snapshot(
        total_blocks=4,
        active=[(_spec(0), 4)],
        waiting=[(_spec(1), 0, 0), (_spec(2, 4, 8), 4, 1), (_spec(3), 0, 0)],
    )
    assert plan(snap, cfg).admit == ("r1",)


def test_batch_prefers_longest_service_wait_then_submission_order():
    active = [(_spec(i), 5, wait) for i, wait in enumerate([0, 3, 1, 3, 0])]
    snap = make_snapshot(total_blocks=32, active=active, waiting=[(_spec(5),)])
    d = plan(snap, SchedulerConfig(8, 4))
    assert d.admit == ("r5",)
    assert d.batch == ("r1", "r3", "r2", "r0")
    assert plan(snap, SchedulerConfig(8, 8)).batch == ("r1", "r3", "r2", "r0", "r4", "r5")


def test_finished_length_is_not_runnable():
    snap = make_snapshot(total_blocks=8, active=[(_spec(0), 8), (_spec(1), 7)])
    assert plan(snap).batch == ("r1",)


def test_decision_is_value_equal_and_carries_its_inputs():
    snap = make_snapshot(total_blocks=4, waiting=[(_spec(i),) for i in range(3)])
    a, b = plan(snap), BlockAwareScheduler(SchedulerConfig(8, 8)).plan(snap)
    assert a == b and hash(a) == hash(b)
    assert a.snapshot is snap and a.config == CFG
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.admit = ()  # type: ignore[misc]
    assert a != dataclasses.replace(a, batch=("r0",))


def test_plan_rejects_non_snapshots():
    with pytest.raises(TypeError):
        BlockAwareScheduler(CFG).plan({"free_blocks": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockAwareScheduler({"max_batch_size": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"admit": ["r0"]}, TypeError),
        ({"admit": ("r0", "r0")}, ValueError),
        ({"admit": ("zz",)}, ValueError),
        ({"reject": ("r0",)}, ValueError),  # both admitted and rejected
        ({"batch": ("r2",)}, ValueError),  # neither active nor admitted
        ({"batch": ("r0", "r1"), "config": SchedulerConfig(8, 1)}, ValueError),
        ({"admit": ("r0", "r1"), "config": SchedulerConfig(1, 8)}, ValueError),
        ({"snapshot": None}, TypeError),
        ({"config": None}, TypeError),
    ],
)
def test_decision_validation(over, error):
    snap = make_snapshot(total_blocks=4, waiting=[(_spec(i),) for i in range(3)])
    args = {"admit": ("r0",), "reject": (), "batch": ("r0",), "snapshot": snap, "config": CFG}
    args.update(over)
    with pytest.raises(error):
        SchedulerDecision(**args)
