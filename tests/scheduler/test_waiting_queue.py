"""Unit tests of WaitingQueue and WaitingView, and of snapshots built on a view."""

import copy
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdec.scheduler import (
    POLICIES,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
    WaitingQueue,
    WaitingRequest,
    WaitingView,
    make_scheduler,
)
from tests.scheduler.strategies import active_row

BS = 4
P = PrefixInfo("sys", num_blocks=2, num_tokens=8, refcount=0)


def _spec(i, ctx=4, new=4, pid=None):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i, prefix_id=pid)


def _queue(*specs, prefixes=(P,)):
    q = WaitingQueue()
    for s in specs:
        q.submit(s, block_size=BS, prefixes=prefixes)
    return q


def _counters(view):
    return [(r.request_id, r.wait_steps, r.skip_count) for r in view]


def test_submit_keeps_submission_order_and_derives_lifetime_blocks():
    q = _queue(_spec(2), _spec(0, 8, 5, "sys"), _spec(1, 8, 5), _spec(3, 4, 4, "sys"))
    v = q.view()
    assert v.request_ids() == ("r0", "r1", "r2", "r3")
    # ceil(13/4) - 2 shared; 4 private; 2; prefix does not cover a 4-token context: 2 private
    assert [r.lifetime_private_blocks for r in v] == [2, 4, 2, 2]
    assert len(q) == len(v) == 4
    assert "r1" in q and "zz" not in q and True not in q and 1.5 not in q
    assert q.spec("r2") == _spec(2)
    assert q.geometry == v.geometry == (BS, frozenset({("sys", 2, 8)}))
    assert all(r.wait_steps == 0 and r.skip_count == 0 for r in v)


def test_advance_moves_waits_and_skips():
    q = _queue(*(_spec(i) for i in range(4)))
    q.advance(None)  # nothing admitted: everyone waits, nobody is overtaken
    assert _counters(q.view()) == [("r0", 1, 0), ("r1", 1, 0), ("r2", 1, 0), ("r3", 1, 0)]
    q.remove("r2")  # admitted: leaves first, then the step is counted
    q.advance(2)
    assert _counters(q.view()) == [("r0", 2, 1), ("r1", 2, 1), ("r3", 2, 0)]
    q.submit(_spec(9), block_size=BS, prefixes=(P,))
    q.advance(9)
    assert _counters(q.view()) == [("r0", 3, 2), ("r1", 3, 2), ("r3", 3, 1), ("r9", 1, 0)]


def test_views_are_immutable_values():
    q = _queue(*(_spec(i) for i in range(5)))
    q.advance(3)
    v = q.view()
    rows = tuple(v)
    assert q.view() is v  # the same state gives the same view
    q.remove("r1")
    q.advance(4)
    q.submit(_spec(7), block_size=BS, prefixes=(P,))
    assert tuple(v) == rows and v == rows and rows == v and hash(v) == hash(rows)
    assert v != q.view() and q.view() != rows
    assert v != list(rows)  # like a tuple, never equal to a list
    assert v[0] is v[0] and v[-1] == rows[-1] and v[1:4] == rows[1:4] and v[::-2] == rows[::-2]
    assert rows[2] in v and WaitingRequest("r2", _spec(2), 2, 9, 9) not in v and "r2" not in v
    assert v.index(rows[3]) == 3
    assert copy.deepcopy(v) is v
    assert repr(v).startswith("WaitingView((WaitingRequest(")
    with pytest.raises(IndexError):
        v[5]
    with pytest.raises(TypeError):
        v["r0"]  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        WaitingView()


def test_views_of_the_same_state_compare_in_constant_time():
    q = _queue(*(_spec(i) for i in range(3)))
    a = q.view()
    q.advance(None)
    b = q.view()
    assert a._root is b._root and a != b  # same tree, one more step waited
    c = _queue(*(_spec(i) for i in range(3)))
    c.advance(None)
    assert c.view() == b  # another queue with equal content: element-wise


# ids whose hashes collide in CPython (-1 and -2; 1 and 2**61) share a trie bucket
IDS = [-1, -2, 1, 2**61, 0, "a", "b", 7, "r7"]


def test_old_views_answer_lookups_from_their_own_state():
    q = WaitingQueue()
    for order, rid in enumerate(IDS):
        q.submit(RequestSpec(rid, 4, 4, order), block_size=BS)
    old = q.view()
    for rid in (-1, 2**61, "a"):
        q.remove(rid)
    q.submit(RequestSpec("late", 4, 4, 100), block_size=BS)
    q.advance(5)
    new = q.view()
    for view, present in ((old, IDS), (new, [r for r in IDS if r not in (-1, 2**61, "a")])):
        rows = {r.request_id: r for r in view}
        for i, rid in enumerate(present):
            assert view.has_id(rid) and view.get(rid) is rows[rid]
            assert view.position(rid) == i
            assert view.has_submission_order(rows[rid].spec.submission_order)
        for rid in {*IDS, "late", 99, "zz"} - set(present) - ({"late"} if view is new else set()):
            assert not view.has_id(rid) and view.get(rid) is None
            with pytest.raises(ValueError):
                view.position(rid)
        assert not view.has_id(True) and not view.has_id(1.0) and not view.has_id(None)
        assert view.has_any_id(["zz", present[-1]]) and not view.has_any_id(["zz", True, 99])
        orders = [r.spec.submission_order for r in rows.values()]
        assert view.has_any_submission_order([500, orders[0]])
        assert not view.has_any_submission_order([500, 100 if view is old else 101])
    assert not old.has_submission_order(100) and new.has_submission_order(100)


def test_many_ids_old_and_current_views():
    q = WaitingQueue()
    for i in range(1500):
        q.submit(RequestSpec(f"id{i}" if i % 2 else i * 7919, 1, 1, i), block_size=BS)
    old = q.view()
    gone = [rid for i, rid in enumerate(old.request_ids()) if i % 3 == 0]
    for rid in gone:
        q.remove(rid)
    new = q.view()
    assert all(old.has_id(rid) for rid in old.request_ids())
    assert not any(new.has_id(rid) for rid in gone)
    assert all(new.has_id(rid) for rid in new.request_ids())
    for rid in new.request_ids():
        q.remove(rid)
    assert len(q) == 0 and q.geometry is None and len(q.view()) == 0
    assert all(old.has_id(rid) for rid in old.request_ids())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), max_size=60),
    advances=st.lists(st.one_of(st.none(), st.integers(0, 70)), max_size=12),
    start=st.integers(0, 70),
    blocks=st.integers(-2, 20),
    threshold=st.integers(0, 8),
    capacity=st.integers(-1, 20),
    width=st.integers(1, 20),
)
def test_queries_equal_a_scan(sizes, advances, start, blocks, threshold, capacity, width):
    q = WaitingQueue()
    for i, (ctx, new) in enumerate(sizes):
        pid = "sys" if i % 5 == 1 else ("gone" if i % 7 == 3 else None)
        q.submit(
            RequestSpec(i, 8 if i % 10 == 1 else ctx, new, (i * 37) % 101, pid),
            block_size=BS,
            prefixes=(P,),
        )
        if i < len(advances):
            q.advance(advances[i])
    v = q.view()
    rows = tuple(v)

    def first(pred):
        return next((i for i in range(start, len(rows)) if pred(rows[i])), None)

    assert v.first_fitting(start, blocks) == first(lambda r: r.lifetime_private_blocks <= blocks)
    assert v.first_aged(start, threshold) == first(lambda r: r.skip_count >= threshold)
    pmap = {"sys": P}
    expected = tuple(
        i
        for i, r in enumerate(rows)
        if r.lifetime_private_blocks > capacity
        or r.spec.lifetime_blocks(BS) > width
        or (
            r.spec.prefix_id is not None
            and (
                r.spec.prefix_id not in pmap
                or pmap[r.spec.prefix_id].num_tokens != r.spec.initial_context_tokens
            )
        )
    )
    assert v.unrunnable(capacity, width) == expected


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda q: q.submit("r9", block_size=BS), TypeError),
        (lambda q: q.submit(_spec(9), block_size=0, prefixes=(P,)), ValueError),
        (lambda q: q.submit(_spec(9), block_size=4.0, prefixes=(P,)), TypeError),
        (lambda q: q.submit(_spec(9), block_size=BS, prefixes=[object()]), TypeError),
        (lambda q: q.submit(_spec(9), block_size=BS, prefixes="sys"), TypeError),
        (lambda q: q.submit(_spec(9), block_size=BS, prefixes=(P, P)), ValueError),
        (lambda q: q.submit(_spec(9), block_size=8, prefixes=(P,)), ValueError),
        (lambda q: q.submit(_spec(9), block_size=BS, prefixes=()), ValueError),
        (lambda q: q.submit(_spec(1), block_size=BS, prefixes=(P,)), ValueError),
        (lambda q: q.submit(RequestSpec("x", 4, 4, 1), block_size=BS, prefixes=(P,)), ValueError),
        (lambda q: q.remove("zz"), ValueError),
        (lambda q: q.remove(1.5), TypeError),
        (lambda q: q.spec("zz"), ValueError),
        (lambda q: q.advance(-1), ValueError),
        (lambda q: q.advance(True), TypeError),
        (lambda q: q.advance("3"), TypeError),
    ],
)
def test_rejected_calls_change_nothing(call, error):
    q = _queue(*(_spec(i) for i in range(3)))
    q.advance(2)
    before = q.view()
    rows = tuple(before)
    with pytest.raises(error):
        call(q)
    assert q.view() is before and tuple(q.view()) == rows and len(q) == 3


def test_geometry_is_free_again_once_the_queue_is_empty():
    q = _queue(_spec(0))
    q.remove("r0")
    assert q.geometry is None
    q.submit(_spec(1), block_size=8)
    assert q.geometry == (8, frozenset()) and q.view()[0].lifetime_private_blocks == 1


# ---------------------------------------------------------------- snapshots on a view
def _snapshot(waiting, *, active=(), total=64, block_size=BS, prefixes=(P,)):
    act = tuple(active_row(s, block_size, prefixes, t) for s, t in active)
    used = sum(p.num_blocks for p in prefixes) + sum(r.committed_private_blocks for r in act)
    return SchedulingSnapshot(
        step=3,
        cache_version=7,
        block_size=block_size,
        total_blocks=total,
        free_blocks=total - used,
        max_blocks_per_seq=16,
        prefixes=prefixes,
        active=act,
        waiting=waiting,
    )


def test_snapshot_on_a_view_equals_one_on_a_tuple():
    q = _queue(_spec(1, 8, 5, "sys"), _spec(2, 4, 30), _spec(3), _spec(4, 4, 60), _spec(5))
    q.advance(4)
    active = [(_spec(0, 8, 8, "sys"), 10)]
    on_view = _snapshot(q.view(), active=active, total=14)
    on_tuple = _snapshot(tuple(q.view()), active=active, total=14)
    assert on_view == on_tuple and hash(on_view) == hash(on_tuple)
    assert on_view.waiting_ids == on_tuple.waiting_ids == ("r1", "r2", "r3", "r4", "r5")
    assert on_view.waiting_view is on_view.waiting
    assert on_tuple.waiting_view is on_tuple.waiting_view and on_tuple.waiting_view == q.view()
    for policy in POLICIES:
        for aging in (None, 0, 1):
            config = SchedulerConfig(4, 2, reserve_blocks=1, aging_threshold=aging)
            scheduler = make_scheduler(policy, config)
            assert scheduler.plan(on_view) == scheduler.plan(on_tuple)


@pytest.mark.parametrize(
    "over",
    [
        {"block_size": 8, "prefixes": (PrefixInfo("sys", 1, 8, 0),)},
        {"prefixes": ()},
        {"prefixes": (P, PrefixInfo("other", 1, 4, 0))},
        {"active": [(RequestSpec("r1", 4, 4, 50), 4)]},  # id also waiting
        {"active": [(RequestSpec("x", 4, 4, 1), 4)]},  # submission order also waiting
    ],
)
@pytest.mark.parametrize("stale", [False, True])
def test_snapshot_rejects_a_view_that_does_not_fit(over, stale):
    q = _queue(_spec(1), _spec(2))
    view = q.view()
    if stale:
        q.remove("r1")
        q.remove("r2")
    over = dict(over)
    active = over.pop("active", ())
    with pytest.raises(ValueError):
        _snapshot(view, active=active, **over)


def test_a_decision_stays_checkable_after_the_queue_moves_on():
    q = _queue(*(_spec(i) for i in range(4)))
    snap = _snapshot(q.view(), total=8)
    d = make_scheduler("lifetime", SchedulerConfig(8, 8)).plan(snap)
    assert d.admit == ("r0", "r1", "r2")
    for rid in d.admit:
        q.remove(rid)
    q.advance(2)
    # the snapshot's view still holds r0..r3: edits are checked against it, not the live queue
    assert dataclasses.replace(d, admit=("r3",), batch=("r3",)).admit == ("r3",)
    with pytest.raises(ValueError):
        dataclasses.replace(d, admit=("zz",))
    with pytest.raises(ValueError):
        dataclasses.replace(d, reject=("r0",))  # both admitted and rejected


def test_restore_undoes_removals_with_their_counters():
    q = _queue(*(_spec(i) for i in range(5)))
    q.advance(None)
    q.remove("r1")
    q.advance(1)  # r0 skipped once; everyone waited two steps
    before = _counters(q.view())
    checkpoint = q.checkpoint()
    q.remove("r3")
    q.remove("r0")
    q.restore(checkpoint, ["r3", "r0"])
    view = q.view()
    assert _counters(view) == before == [("r0", 2, 1), ("r2", 2, 0), ("r3", 2, 0), ("r4", 2, 0)]
    assert "r0" in q and view.get("r3").wait_steps == 2 and len(q) == 4
    q.advance(3)  # the restored queue moves on as the original would have
    assert _counters(q.view()) == [("r0", 3, 2), ("r2", 3, 1), ("r3", 3, 0), ("r4", 3, 0)]


def test_restore_empties_back_to_the_geometry_it_had():
    q = _queue(_spec(0))
    checkpoint = q.checkpoint()
    q.remove("r0")
    assert q.geometry is None
    q.restore(checkpoint, ["r0"])
    assert q.geometry == (BS, frozenset({("sys", 2, 8)})) and q.view().request_ids() == ("r0",)


@pytest.mark.parametrize(
    "change",
    [
        lambda q: q.submit(_spec(9), block_size=BS, prefixes=(P,)),
        lambda q: q.advance(None),
        lambda q: q.remove("r2"),  # a removal the caller does not name
    ],
)
def test_restore_refuses_when_more_than_the_removals_changed(change):
    q = _queue(*(_spec(i) for i in range(3)))
    checkpoint = q.checkpoint()
    q.remove("r0")
    change(q)
    before = (_counters(q.view()), q.view().request_ids())
    with pytest.raises(RuntimeError, match="cannot be restored"):
        q.restore(checkpoint, ["r0"])
    assert (_counters(q.view()), q.view().request_ids()) == before
    with pytest.raises(TypeError, match="QueueCheckpoint"):
        q.restore(object(), [])
