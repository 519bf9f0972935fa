import dataclasses

import pytest

from flashdec.scheduler import (
    ActiveRequest,
    PrefixInfo,
    RequestSpec,
    SchedulingSnapshot,
    WaitingRequest,
    lifetime_private_blocks,
)
from tests.scheduler.strategies import make_snapshot

P = PrefixInfo("sys", num_blocks=2, num_tokens=8, refcount=1)


def _spec(i, ctx=4, new=4, pid=None):
    return RequestSpec(f"r{i}", ctx, new, submission_order=i, prefix_id=pid)


def test_lifetime_private_blocks_counts_prefix_once():
    pmap = {"sys": P}
    assert lifetime_private_blocks(_spec(0, 8, 5, "sys"), 4, pmap) == 2  # ceil(13/4) - 2
    assert lifetime_private_blocks(_spec(0, 8, 5), 4, pmap) == 4
    # not resident, or not covering the context: no sharing
    assert lifetime_private_blocks(_spec(0, 8, 5, "other"), 4, pmap) == 4
    assert lifetime_private_blocks(_spec(0, 4, 5, "sys"), 4, pmap) == 3


def test_snapshot_value_equality_and_frozen():
    kw = {
        "prefixes": (P,),
        "active": [(_spec(0, 8, 4, "sys"), 9, 2)],
        "waiting": [(_spec(2), 3, 1), (_spec(1), 0, 0)],
    }
    a, b = make_snapshot(**kw), make_snapshot(**kw)
    assert a == b and hash(a) == hash(b)
    assert a.waiting_ids == ("r1", "r2")  # submission order
    assert a.active_ids == ("r0",)
    assert a.resident_prefix_blocks == 2
    row = a.active[0]
    assert (row.committed_blocks, row.committed_private_blocks) == (3, 1)
    assert row.lifetime_private_blocks == 1 and row.remaining_private_blocks == 0
    assert row.runnable
    assert a != make_snapshot(**{**kw, "step": 1})
    assert a != make_snapshot(**{**kw, "waiting": [(_spec(2), 3, 2), (_spec(1), 0, 0)]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.free_blocks = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.active[0].committed_tokens = 0  # type: ignore[misc]


def _base(**over):
    args = {
        "step": 0,
        "cache_version": 0,
        "block_size": 4,
        "total_blocks": 8,
        "free_blocks": 8,
        "max_blocks_per_seq": 8,
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"step": -1}, ValueError),
        ({"block_size": 0}, ValueError),
        ({"total_blocks": 0}, ValueError),
        ({"free_blocks": 9}, ValueError),
        ({"max_blocks_per_seq": 0}, ValueError),
        ({"cache_version": 1.0}, TypeError),
        ({"prefixes": [P]}, TypeError),
        ({"active": ("r0",)}, TypeError),
        ({"prefixes": (P, P)}, ValueError),
        ({"prefixes": (PrefixInfo("x", 2, 7, 0),)}, ValueError),  # not full blocks
        (
            {"waiting": (WaitingRequest("r1", _spec(1), 2), WaitingRequest("r0", _spec(0), 2))},
            ValueError,  # not in submission order
        ),
        ({"waiting": (WaitingRequest("r0", _spec(0), 3),)}, ValueError),  # wrong lifetime
        (
            {"waiting": (WaitingRequest("r0", _spec(0), 2), WaitingRequest("r0", _spec(0), 2))},
            ValueError,
        ),
        (
            {
                "waiting": (
                    WaitingRequest("r0", _spec(0), 2),
                    WaitingRequest("x", RequestSpec("x", 4, 4, 0), 2),
                )
            },
            ValueError,  # submission order repeated
        ),
        ({"active": (ActiveRequest("r0", _spec(0), 4, 2, 2, 2),)}, ValueError),  # 4 tok != 2 blk
        ({"active": (ActiveRequest("r0", _spec(0, pid="sys"), 4, 1, 1, 2),)}, ValueError),
        ({"free_blocks": 8, "active": (ActiveRequest("r0", _spec(0), 4, 1, 1, 2),)}, ValueError),
    ],
)
def test_snapshot_validation(over, error):
    with pytest.raises(error):
        SchedulingSnapshot(**_base(**over))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("r0", _spec(1), 0, 0, 0, 2), ValueError),  # id mismatch
        (("r0", "spec", 0, 0, 0, 2), TypeError),
        (("r0", _spec(0), 9, 3, 3, 2), ValueError),  # beyond its lifetime tokens
        (("r0", _spec(0), 4, 1, 2, 2), ValueError),  # private > committed blocks
        (("r0", _spec(0), 4, 3, 3, 2), ValueError),  # private > lifetime
        (("r0", _spec(0), 4, 1, 1, 2, -1), ValueError),
    ],
)
def test_active_request_validation(args, error):
    with pytest.raises(error):
        ActiveRequest(*args)


def test_waiting_request_validation():
    with pytest.raises(ValueError):
        WaitingRequest("r9", _spec(0), 2)
    with pytest.raises(ValueError):
        WaitingRequest("r0", _spec(0), 2, skip_count=-1)
    with pytest.raises(TypeError):
        WaitingRequest("r0", None, 2)  # type: ignore[arg-type]


def test_a_reused_active_row_is_checked_again_under_another_geometry():
    row = make_snapshot(prefixes=(P,), active=[(_spec(0, 8, 4, "sys"), 9)]).active[0]

    def snapshot(block_size, prefixes):
        return SchedulingSnapshot(
            **_base(block_size=block_size, free_blocks=4), prefixes=prefixes, active=(row,)
        )

    ok = snapshot(4, (P,))
    assert dataclasses.replace(ok, step=1).active[0] is row
    assert snapshot(4, (P, PrefixInfo("x", 1, 4, 0))).active == (row,)  # still consistent
    for block_size, prefixes in (
        (4, ()),  # its prefix is gone
        (4, (PrefixInfo("sys", 1, 4, 1),)),  # another size
        (2, (PrefixInfo("sys", 4, 8, 1),)),  # the same prefix in 2-token blocks
    ):
        with pytest.raises(ValueError):
            snapshot(block_size, prefixes)
