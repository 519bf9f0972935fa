"""The swap rule (``swap_victims``), one rule per test: only the FIFO head that waited its
patience, short of blocks (not slots), and never swapped itself causes a swap; victims are
eligible running requests, newest submission first, just enough to make it fit; when all of
them are not enough, nobody is swapped."""

from flashdec.scheduler import BlockAwareScheduler, RequestSpec, SchedulerConfig, swap_victims
from tests.scheduler.strategies import make_snapshot

CFG = SchedulerConfig(max_active_requests=8, max_batch_size=8)


def _spec(i, ctx=4, new=4):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i)


# three running requests of 3 lifetime blocks each (4 + 8 tokens, block 4) in a 10-block pool:
# 1 block of headroom; the head needs 2 (4 + 4 tokens)
ACTIVE = [(_spec(i, 4, 8), 6) for i in range(3)]
ALL = {"r0", "r1", "r2"}


def _snap(wait_steps=5, active=ACTIVE, total=10, head=None):
    head = head or _spec(9)
    return make_snapshot(total_blocks=total, active=active, waiting=[(head, wait_steps, 0)])


def test_the_newest_eligible_request_gives_way_and_the_head_then_fits():
    snap = _snap()
    assert BlockAwareScheduler(CFG).plan(snap).admit == ()
    assert swap_victims(snap, CFG, ALL, patience=3) == ("r2",)
    assert swap_victims(snap, CFG, {"r0", "r1"}, patience=3) == ("r1",)


def test_just_enough_victims_for_a_larger_head():
    snap = _snap(head=_spec(9, 4, 16))  # needs 5: two victims free 6
    assert swap_victims(snap, CFG, ALL, patience=0) == ("r2", "r1")


def test_no_swap_before_the_head_waited_its_patience():
    assert swap_victims(_snap(wait_steps=2), CFG, ALL, patience=3) == ()
    assert swap_victims(_snap(wait_steps=3), CFG, ALL, patience=3) == ("r2",)


def test_a_head_that_fits_causes_no_swap():
    assert swap_victims(_snap(total=11), CFG, ALL, patience=0) == ()


def test_slots_are_not_a_reason_to_swap():
    full = SchedulerConfig(max_active_requests=3, max_batch_size=8)
    assert swap_victims(_snap(), full, ALL, patience=0) == ()


def test_a_swapped_head_causes_no_swap():
    assert swap_victims(_snap(), CFG, ALL, patience=0, may_swap=False) == ()


def test_nobody_is_swapped_when_all_eligible_are_not_enough():
    snap = _snap(head=_spec(9, 4, 40))  # needs 11 blocks: more than all three free
    assert swap_victims(snap, CFG, ALL, patience=0) == ()
    assert swap_victims(_snap(), CFG, set(), patience=0) == ()


def test_nothing_waiting_nothing_swapped():
    snap = make_snapshot(total_blocks=10, active=ACTIVE)
    assert swap_victims(snap, CFG, ALL, patience=0) == ()
