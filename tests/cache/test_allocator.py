"""BlockAllocator: free list, all-or-nothing allocation, ownership, release checks."""

from __future__ import annotations

import pytest

from flashdec.cache import BlockAllocator


def test_fresh_pool_hands_out_distinct_ids_and_tracks_owners():
    alloc = BlockAllocator(5)
    a = alloc.allocate(2, "a")
    b = alloc.allocate(3, "b")
    assert sorted(a + b) == [0, 1, 2, 3, 4]
    assert alloc.num_free == 0 and alloc.num_used == 5
    assert all(alloc.owner_of(i) == "a" for i in a)
    assert alloc.owned_blocks() == {"a": sorted(a), "b": sorted(b)}
    alloc.check_integrity()


def test_allocation_is_all_or_nothing():
    alloc = BlockAllocator(3)
    alloc.allocate(2, "x")
    with pytest.raises(RuntimeError, match="out of KV blocks: 2 requested, 1 of 3 free"):
        alloc.allocate(2, "y")
    assert alloc.num_free == 1
    assert alloc.owned_blocks() == {"x": [0, 1]}
    assert alloc.allocate(0, "y") == []


def test_release_returns_blocks_and_they_are_reused():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(3, ("request", 7))
    alloc.release(ids[:2], ("request", 7))
    assert alloc.num_free == 3
    again = alloc.allocate(2, "z")
    assert sorted(again) == sorted(ids[:2])
    alloc.check_integrity()


@pytest.mark.parametrize(
    ("release", "owner", "exc", "match"),
    [
        ([0, 0], None, ValueError, "listed twice"),
        ([3], None, RuntimeError, "already free"),
        ([0], "other", RuntimeError, "owned by 'mine'"),
        ([9], None, ValueError, "outside"),
        ([True], None, TypeError, "ints"),
    ],
)
def test_bad_release_changes_nothing(release, owner, exc, match):
    alloc = BlockAllocator(4)
    alloc.allocate(2, "mine")  # blocks 0 and 1
    with pytest.raises(exc, match=match):
        alloc.release([1, *release], owner)  # the valid first id must not be freed either
    assert alloc.owned_blocks() == {"mine": [0, 1]}
    assert alloc.num_free == 2
    alloc.check_integrity()


@pytest.mark.parametrize(
    ("args", "exc"),
    [((1.5, "o"), TypeError), ((-1, "o"), ValueError), ((1, None), ValueError)],
)
def test_bad_allocate_arguments(args, exc):
    alloc = BlockAllocator(2)
    with pytest.raises(exc):
        alloc.allocate(*args)
    assert alloc.num_free == 2


@pytest.mark.parametrize(("n", "exc"), [(0, ValueError), (True, TypeError), ("4", TypeError)])
def test_bad_pool_size(n, exc):
    with pytest.raises(exc):
        BlockAllocator(n)


def test_integrity_check_sees_corruption():
    alloc = BlockAllocator(3)
    alloc.allocate(1, "a")
    alloc._owner[2] = "ghost"  # owned but still on the free list
    with pytest.raises(RuntimeError, match="block 2 is free"):
        alloc.check_integrity()
    alloc._owner[2] = None
    alloc._free.append(alloc._free[0])
    with pytest.raises(RuntimeError, match="twice"):
        alloc.check_integrity()
