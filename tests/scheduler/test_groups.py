"""Scheduling with KV layer groups: per-group pools, window bounds, and the lifetime guarantee in
every group."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdec._blocks import blocks_for_tokens, lifetime_blocks
from flashdec.scheduler import (
    POLICIES,
    ActiveRequest,
    BlockAwareScheduler,
    GroupBlocks,
    GroupPool,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
    WaitingQueue,
    WaitingRequest,
    blocks_needed_now,
    blocks_needed_now_by_group,
    empty_pool_capacities,
    lifetime_headroom,
    lifetime_headrooms,
    make_scheduler,
    rejection_reason,
)
from flashdec.scheduler.groups import needs_new_block
from tests.scheduler.group_sim import simulate_groups
from tests.scheduler.group_strategies import (
    group_active_row,
    group_prefix,
    group_shapes,
    group_snapshots,
    make_group_snapshot,
)
from tests.scheduler.reference_policy import reference_plan
from tests.scheduler.strategies import configs

SETTINGS = settings(max_examples=150, deadline=None)
FULL_AND_WINDOW = ((4, None), (4, 8))  # a full-attention group and an 8-token window group


def _spec(i, ctx=4, new=4, pid=None):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i, prefix_id=pid)


# ---------------------------------------------------------------- block accounting
def _held_sets(total, bs, window):
    """Brute force: the blocks held after each commit, and while each token is appended."""
    after, during = [set()], []
    for n in range(total):  # appending position n
        keep = after[-1]
        during.append(keep | {n // bs})
        low = 0 if window is None else max(0, n + 2 - window)
        after.append({p // bs for p in range(low, n + 1)})
    return after, during


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 80),
    st.sampled_from([1, 2, 3, 4, 8, 16]),
    st.one_of(st.none(), st.integers(1, 40)),
)
def test_block_formulas_match_a_token_by_token_count(total, bs, window):
    after, during = _held_sets(total, bs, window)
    for n in range(total + 1):
        assert blocks_for_tokens(n, bs, window) == len(after[n])
    for n in range(total):
        assert needs_new_block(n, bs, window) == (n // bs not in after[n])
    assert lifetime_blocks(total, bs, window) == max(map(len, during), default=0)
    if window is not None:
        assert lifetime_blocks(total, bs, window) <= -(-window // bs) + 1


def test_window_bound_is_flat_and_full_grows():
    assert [lifetime_blocks(t, 16, 64) for t in (64, 65, 1000, 10**6)] == [4, 5, 5, 5]
    assert lifetime_blocks(10**6, 16, None) == 62_500
    assert lifetime_blocks(100, 16, 64) == 5  # 64 positions straddling five 16-token blocks
    assert lifetime_blocks(100, 16, 1) == 1


# ---------------------------------------------------------------- validation
def test_group_pool_validation():
    assert GroupPool(16, 8, 8, 8, 64).shape == (16, 64)
    assert GroupPool(16, 8, 8, 4).max_tokens == 64
    for args, error in (
        ((16, 8, 9, 8), ValueError),  # more free than total
        ((16, 8, 8, 8, 0), ValueError),  # window < 1
        ((16, 8, 8, 8, 2.0), TypeError),
        ((0, 8, 8, 8), ValueError),
    ):
        with pytest.raises(error):
            GroupPool(*args)


def _group_base(**over):
    shapes = over.pop("shapes", FULL_AND_WINDOW)
    args = {"shapes": shapes, "total_blocks": [20, 10]}
    args.update(over)
    return make_group_snapshot(**args)


def test_group_snapshot_rows_and_derived_fields():
    p = group_prefix("sys", 8, FULL_AND_WINDOW)
    snap = _group_base(
        prefixes=(p,),
        active=[(_spec(0, 8, 20, "sys"), 14), (_spec(1, 4, 30), 20)],
        waiting=[(_spec(2, 10, 30),)],
    )
    r0, r1 = snap.active
    # r0: 6 own tokens: 2 private blocks in the full group; in the window group positions
    # [7, 14) minus the prefix's [0, 8): 6 tokens in 2 blocks, plus 2 shared blocks each
    assert r0.blocks_by_group == (GroupBlocks(4, 2, 5), GroupBlocks(4, 2, 3))
    assert r1.blocks_by_group == (GroupBlocks(5, 5, 9), GroupBlocks(2, 2, 3))
    assert snap.waiting[0].lifetime_private_blocks_by_group == (10, 3)
    assert snap.resident_prefix_blocks_by_group == (2, 2)
    assert snap.group_shapes == FULL_AND_WINDOW and snap.pools == snap.groups
    assert [g.free_blocks for g in snap.groups] == [20 - 2 - 7, 10 - 2 - 4]
    # full: 20 - 2 - (5 + 9) by the pool, 11 - (3 + 4) by what is free; window: 10 - 2 - 6, 4 - 2
    assert lifetime_headrooms(snap, 0) == (4, 2)
    assert lifetime_headroom(snap, 0) == 4
    assert empty_pool_capacities(snap, SchedulerConfig(4, 4, reserve_blocks=1)) == (17, 7)


def test_a_plain_snapshot_is_one_full_group():
    snap = SchedulingSnapshot(0, 0, 4, 8, 8, 8)
    assert snap.group_shapes == () and snap.pools == (GroupPool(4, 8, 8, 8),)
    assert snap.resident_prefix_blocks_by_group == (0,)


def _with_free(pool, free):
    return dataclasses.replace(pool, free_blocks=free)


def _with_row(row, **change):
    return dataclasses.replace(row, **change)


def _with_free(pool, free):
    return dataclasses.replace(pool, free_blocks=free)


def _with_row(row, **change):
    return dataclasses.replace(row, **change)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: {"groups": [*s.groups]}, TypeError),
        (lambda s: {"groups": (s.groups[0], "x")}, TypeError),
        (lambda s: {"groups": (GroupPool(4, 8, 0, 8),)}, ValueError),  # one full group
        (lambda s: {"free_blocks": s.free_blocks - 1}, ValueError),  # top-level != group 0
        (lambda s: {"block_size": 2}, ValueError),
        # more in use than the pool holds
        (lambda s: {"groups": (s.groups[0], _with_free(s.groups[1], 9))}, ValueError),
        (lambda s: {"prefixes": (PrefixInfo("q", 2, 8, 0),)}, ValueError),  # no blocks by group
        (lambda s: {"prefixes": (PrefixInfo("q", 2, 8, 0, (2,)),)}, ValueError),  # one group
        (lambda s: {"prefixes": (PrefixInfo("q", 2, 8, 0, (2, 1)),)}, ValueError),  # not full
        (lambda s: {"waiting": (WaitingRequest("r9", _spec(9), 2),)}, ValueError),  # no groups
        (lambda s: {"waiting": (WaitingRequest("r9", _spec(9), 2, 0, 0, (2, 3)),)}, ValueError),
        (lambda s: {"active": (_with_row(s.active[0], blocks_by_group=()),)}, ValueError),
        # blocks that do not match the tokens
        (lambda s: {"active": (_with_row(s.active[0], committed_tokens=9),)}, ValueError),
    ],
)
def test_group_snapshot_validation(change, error):
    snap = _group_base(active=[(_spec(0, 4, 20), 7)], waiting=[(_spec(1),)])
    fields = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    with pytest.raises(error):
        SchedulingSnapshot(**{**fields, **change(snap)})


def test_a_plain_snapshot_refuses_rows_with_groups():
    grouped = _group_base(active=[(_spec(0, 4, 20), 7)], waiting=[(_spec(1),)])
    with pytest.raises(ValueError, match="no groups"):
        SchedulingSnapshot(0, 0, 4, 8, 6, 8, active=grouped.active)
    with pytest.raises(ValueError, match="no groups"):
        SchedulingSnapshot(0, 0, 4, 8, 8, 8, waiting=grouped.waiting)
    with pytest.raises(ValueError, match="no groups"):
        SchedulingSnapshot(0, 0, 4, 8, 8, 8, prefixes=(PrefixInfo("q", 1, 4, 0, (1,)),))


def test_row_validation_by_group():
    spec = _spec(0, 4, 20)
    with pytest.raises(ValueError):  # scalars must be group 0's
        ActiveRequest("r0", spec, 4, 1, 1, 6, 0, (GroupBlocks(1, 1, 5), GroupBlocks(1, 1, 3)))
    with pytest.raises(TypeError):
        ActiveRequest("r0", spec, 4, 1, 1, 6, 0, ((1, 1, 6),))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        GroupBlocks(1, 2, 3)  # private > committed
    with pytest.raises(ValueError):
        GroupBlocks(3, 2, 1)  # private > lifetime
    with pytest.raises(ValueError):
        WaitingRequest("r0", spec, 6, 0, 0, (5, 3))
    with pytest.raises(TypeError):
        WaitingRequest("r0", spec, 6, 0, 0, [6, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PrefixInfo("p", 2, 8, 0, (1, 2))


def test_waiting_queue_with_group_shapes():
    q = WaitingQueue()
    q.submit(_spec(0, 4, 60), block_size=4, group_shapes=FULL_AND_WINDOW)
    q.submit(_spec(1, 4, 4), block_size=4, group_shapes=FULL_AND_WINDOW)
    view = q.view()
    assert [r.lifetime_private_blocks_by_group for r in view] == [(16, 3), (2, 2)]
    assert view.first_fitting_groups(0, (16, 2)) == 1
    assert view.first_fitting_groups(0, (16, 3)) == 0
    assert view.unrunnable_groups((15, 3), 10_000) == (0,)
    assert view.unrunnable_groups((16, 3), 63) == (0,)  # 64 tokens do not fit a 63-token table
    with pytest.raises(ValueError):
        view.first_fitting_groups(0, (16,))
    with pytest.raises(ValueError):  # another geometry
        q.submit(_spec(2), block_size=4, group_shapes=((4, None), (4, 16)))
    with pytest.raises(ValueError):
        q.submit(_spec(2), block_size=4)
    for shapes, error in (
        ([(4, None), (4, 8)], TypeError),
        (((4, None, 1),), TypeError),
        (((2, 8),), ValueError),  # group 0's block size is block_size
        (((4, None),), ValueError),  # one full group: no shapes
        (((4, 0),), ValueError),
    ):
        with pytest.raises(error):
            WaitingQueue().submit(_spec(2), block_size=4, group_shapes=shapes)
    plain = WaitingQueue()
    plain.submit(_spec(0), block_size=4)
    with pytest.raises(ValueError):
        plain.view().first_fitting_groups(0, (1, 1))
    with pytest.raises(ValueError):  # prefixes give their blocks per group
        WaitingQueue().submit(
            _spec(3, 8, 4, "p"),
            block_size=4,
            prefixes=(PrefixInfo("p", 2, 8, 0),),
            group_shapes=FULL_AND_WINDOW,
        )


# ---------------------------------------------------------------- policies
def test_window_groups_admit_more_on_the_same_pool():
    """Eight requests of 4 + 60 tokens: 16 blocks each in a full group, 3 in an 8-token window
    group. On a 48-block full pool three fit; with a window group beside it, those three still
    bind the full group, but a two-group cache whose big group is windowed fits all eight."""
    waiting = [(_spec(i, 4, 60),) for i in range(8)]
    config = SchedulerConfig(max_active_requests=8, max_batch_size=8)
    full = make_group_snapshot(
        shapes=((4, None), (4, None)), total_blocks=[48, 48], waiting=waiting
    )
    windowed = make_group_snapshot(
        shapes=((4, 8), (4, None)), total_blocks=[48, 128], waiting=waiting
    )
    assert len(BlockAwareScheduler(config).plan(full).admit) == 3
    assert len(BlockAwareScheduler(config).plan(windowed).admit) == 8


def test_each_group_is_checked_against_its_own_pool():
    config = SchedulerConfig(max_active_requests=8, max_batch_size=8)
    snap = make_group_snapshot(
        shapes=FULL_AND_WINDOW, total_blocks=[100, 5], waiting=[(_spec(i, 4, 8),) for i in range(3)]
    )
    # 3 blocks each in the 5-block window group: only one fits there
    assert BlockAwareScheduler(config).plan(snap).admit == ("r0",)
    reserve = SchedulerConfig(max_active_requests=8, max_batch_size=8, reserve_blocks=3)
    # the reserve is kept in every group: 5 - 3 = 2 < 3, so nobody can ever run
    assert BlockAwareScheduler(reserve).plan(snap).reject == ("r0", "r1", "r2")


def test_rejection_names_the_group():
    config = SchedulerConfig(max_active_requests=8, max_batch_size=8)
    snap = make_group_snapshot(
        shapes=FULL_AND_WINDOW,
        total_blocks=[100, 2],
        max_blocks_per_seq=[100, 2],
        waiting=[(_spec(0, 4, 8),)],
    )
    reason = rejection_reason(snap.waiting[0], snap, config)
    assert "group 1" in reason and "table" in reason  # 3 logical blocks in a 2-block table
    snap = make_group_snapshot(
        shapes=FULL_AND_WINDOW,
        total_blocks=[100, 1],
        max_blocks_per_seq=[100, 4],
        waiting=[(_spec(0, 4, 3),)],
    )
    reason = rejection_reason(snap.waiting[0], snap, config)
    assert "group 1" in reason and "private blocks" in reason


def test_greedy_counts_the_context_per_group():
    snap = make_group_snapshot(
        shapes=FULL_AND_WINDOW, total_blocks=[100, 100], waiting=[(_spec(0, 40, 8),)]
    )
    request = snap.waiting[0]
    assert blocks_needed_now_by_group(request, snap) == (10, 3)
    assert blocks_needed_now(request, snap) == 10


@SETTINGS
@given(group_snapshots(), configs, st.sampled_from(sorted(POLICIES)))
def test_group_plans_equal_the_scanning_oracle(snapshot, config, policy):
    before = copy.deepcopy(snapshot)
    decision = make_scheduler(policy, config).plan(snapshot)
    assert snapshot == before
    assert decision == reference_plan(policy, snapshot, config)


@SETTINGS
@given(group_snapshots(), configs)
def test_group_rejections_are_exactly_the_hopeless(snapshot, config):
    decision = make_scheduler("lifetime", config).plan(snapshot)
    pmap = snapshot.prefix_map
    for r in snapshot.waiting:
        spec = r.spec
        prefix = pmap.get(spec.prefix_id) if spec.prefix_id is not None else None
        hopeless = spec.prefix_id is not None and (
            prefix is None or prefix.num_tokens != spec.initial_context_tokens
        )
        for g, pool in enumerate(snapshot.groups):
            table = -(-spec.total_tokens // pool.block_size)
            prefix_blocks = sum(p.num_blocks_by_group[g] for p in snapshot.prefixes)
            capacity = pool.total_blocks - config.reserve_blocks - prefix_blocks
            need = r.lifetime_private_blocks_by_group[g]
            hopeless |= table > pool.max_blocks_per_seq or need > capacity
        assert (r.request_id in decision.reject) == hopeless


@st.composite
def group_traces(draw, max_requests=12):
    shapes = draw(group_shapes())
    prefixes = ()
    if draw(st.booleans()):
        unit = math.lcm(*(bs for bs, _ in shapes))
        prefixes = (group_prefix("p", unit * draw(st.integers(1, 2)), shapes),)
    n = draw(st.integers(1, max_requests))
    specs = []
    for i in range(n):
        new = draw(st.integers(1, 30))
        if prefixes and draw(st.booleans()):
            specs.append(RequestSpec(i, prefixes[0].num_tokens, new, i, prefix_id="p"))
        else:
            specs.append(RequestSpec(i, draw(st.integers(0, 30)), new, i))
    arrivals = sorted(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    totals = [
        max(1, sum(p.num_blocks_by_group[g] for p in prefixes) + draw(st.integers(0, 20)))
        for g in range(len(shapes))
    ]
    return specs, arrivals, shapes, totals, prefixes


@settings(max_examples=120, deadline=None)
@given(group_traces(), configs)
def test_lifetime_never_stalls_in_any_group(trace, config):
    """No admitted request ever finds its next block missing in any group, everything admitted
    completes, and each window group's blocks per request stay within its bound."""
    specs, arrivals, shapes, totals, prefixes = trace
    out = simulate_groups(
        specs, arrivals, shapes=shapes, total_blocks=totals, config=config, prefixes=prefixes
    )
    assert out.stalls == 0
    assert set(out.finished_at) == set(out.admitted_at)
    assert set(out.finished_at) | out.rejected == {s.request_id for s in specs}
    for g, (bs, window) in enumerate(shapes):
        if window is not None:
            assert out.max_held[g] <= -(-window // bs) + 1


def test_the_baselines_run_on_groups_and_greedy_can_stall():
    """Greedy admits on what the context needs now: at a block boundary of the full group the
    pool runs dry (stalls); the cancel baseline frees room by cancelling; lifetime never
    stalls."""
    specs = [RequestSpec(i, 4, 12, i) for i in range(4)]
    config = SchedulerConfig(max_active_requests=4, max_batch_size=4)
    kwargs = {"shapes": FULL_AND_WINDOW, "total_blocks": [6, 16], "max_steps": 60}
    greedy = simulate_groups(specs, [0] * 4, config=config, policy="greedy", **kwargs)
    cancel = simulate_groups(specs, [0] * 4, config=config, policy="cancel", **kwargs)
    lifetime = simulate_groups(specs, [0] * 4, config=config, **kwargs)
    assert greedy.stalls > 0 and len(greedy.finished_at) < 4
    assert len(cancel.finished_at) < 4 and cancel.stalls == 0
    assert lifetime.stalls == 0 and len(lifetime.finished_at) == 4


def test_active_rows_of_a_window_group_shrink_back():
    row = group_active_row(_spec(0, 0, 100), FULL_AND_WINDOW, (), 50)
    assert row.blocks_by_group[1] == GroupBlocks(3, 3, 3)  # positions [43, 50): blocks 10-12
    assert row.blocks_by_group[0].committed_blocks == 13
    assert row.blocks_in_groups == row.blocks_by_group
