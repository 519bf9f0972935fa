"""What stays of a terminal request (issue 19 §1): the cache keeps its state for ever and its
full record only among the newest ``TERMINAL_HISTORY_LIMIT``, so neither memory nor
``validate_invariants`` grows with the requests ever served."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch

from benchmarks._common import line_events
from flashdec.cache import PagedKVCache, RequestState
from flashdec.cache.history import TERMINAL_HISTORY_LIMIT, IdSet, TerminalHistory
from tests.cache.helpers import request_first_block
from tests.cache.snapshot import assert_same_state, snapshot

LIMIT = TERMINAL_HISTORY_LIMIT


def tiny_cache(max_blocks: int = 64) -> PagedKVCache:
    return PagedKVCache(1, 1, 2, 4, max_blocks, dtype=torch.float32, device="cpu")


def one_token(cache: PagedKVCache, rids: list) -> None:
    tx = cache.begin_token(rids)
    zeros = torch.zeros(len(rids), 1, 2)
    cache.write_token_layer(tx, 0, zeros, zeros)
    cache.commit_token(tx)


def serve(cache: PagedKVCache, ids, tokens: int = 0, cancel_every: int = 0) -> None:
    """Each id: added, ``tokens`` committed, then finished (every ``cancel_every``-th cancelled)."""
    for i, rid in enumerate(ids):
        cache.add_request(rid)
        for _ in range(tokens):
            one_token(cache, [rid])
        if cancel_every and i % cancel_every == 0:
            cache.cancel_request(rid)
        else:
            cache.finish_request(rid)


# ---------------------------------------------------------------------------- IdSet


def test_id_set_keeps_consecutive_ints_as_runs():
    ids = IdSet()
    for x in [5, 7, 3, 4, 9, 6]:  # out of order: runs start, grow and merge
        ids.add(x)
    assert all(x in ids for x in (3, 4, 5, 6, 7, 9))
    assert all(x not in ids for x in (-1, 2, 8, 10, "5", 5.5))
    assert len(ids) == 6 and ids.num_runs == 2  # [3, 8) and [9, 10)
    ids.add(8)  # closes the gap
    assert ids.num_runs == 1 and len(ids) == 7
    ids.add(8)  # again: nothing changes
    assert ids.num_runs == 1 and len(ids) == 7
    ids.add(-2)
    assert -2 in ids and -1 not in ids and ids.num_runs == 2


def test_id_set_holds_other_ids_one_by_one():
    ids = IdSet()
    for x in ["r1", "r0", -3, "5"]:
        ids.add(x)
    assert "r1" in ids and "5" in ids and 5 not in ids and -3 in ids
    assert ids.num_stored == 4 and len(ids) == 4


def test_terminal_history_lists_the_newest_and_knows_every_state():
    history = TerminalHistory("finished", limit=3)
    states = ["finished", "cancelled", "finished", "finished", "rejected"]
    dropped = [history.add(i, state) for i, state in enumerate(states)]
    assert dropped == [None, None, None, 0, 1]
    assert list(history.recent()) == [2, 3, 4] and history.num_recent == 3
    assert [history.state(i) for i in range(6)] == [*states, None]
    assert [history.count(s) for s in ("finished", "cancelled", "rejected")] == [3, 1, 1]
    # every id in one run; the unusual ends once more each
    assert history.num_stored == 3


# ---------------------------------------------------------------------------- the cache


def test_a_terminal_request_keeps_its_state_for_ever_and_its_record_while_recent():
    cache = tiny_cache()
    serve(cache, [f"old{i}" for i in range(LIMIT + 10)], tokens=1, cancel_every=7)
    serve(cache, ["new"], tokens=3)
    cache.add_request("live")
    one_token(cache, ["live"])
    # every id keeps its state, and none can be reused
    assert cache.request_state("old0") == RequestState.CANCELLED
    assert cache.request_state("old1") == RequestState.FINISHED
    for rid in ("old0", "old1", "new", "live"):
        with pytest.raises(ValueError, match="ids are not reused"):
            cache.add_request(rid)
    # the newest terminal records are whole; an older one holds nothing and has lost its length
    assert cache.seq_len("new") == 3 and cache.request_block_ids("new") == []
    assert cache.request_block_ids("old1") == [] and cache.request_prefix("old1") is None
    assert request_first_block(cache, "old1") == 0
    with pytest.raises(ValueError, match="no longer kept"):
        cache.seq_len("old1")
    with pytest.raises(ValueError, match="unknown request id"):
        cache.request_state("never")
    # listing is bounded: the active ones and the newest terminal ones, in insertion order
    listed = cache.request_ids()
    assert len(listed) == LIMIT + 1 and listed[-2:] == ["new", "live"]
    assert cache.request_ids("active") == ["live"]
    assert "old0" not in cache.request_ids("cancelled")
    cancelled = len(range(0, LIMIT + 10, 7))
    m = cache.metrics()
    assert m["num_requests"] == LIMIT + 12
    assert (m["num_active_requests"], m["num_finished_requests"]) == (1, LIMIT + 11 - cancelled)
    assert m["num_cancelled_requests"] == cancelled
    assert m["terminal_request_history_count"] == m["terminal_request_history_limit"] == LIMIT
    cache.validate_invariants()


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.finish_request("old1"),
        lambda c: c.cancel_request("old1"),
        lambda c: c.begin_token(["live", "old1"]),
        lambda c: c.block_tables(["old1"]),
        lambda c: c.attach_prefix("old1", "p"),
    ],
)
def test_an_old_terminal_request_is_refused_as_terminal_and_nothing_changes(call):
    cache = PagedKVCache(
        1, 1, 2, 4, 64, dtype=torch.float32, device="cpu", prefix_cache_capacity_blocks=4
    )
    blocks = torch.zeros(1, 1, 1, 4, 2)
    cache.register_prefix("p", blocks, blocks)
    serve(cache, [f"old{i}" for i in range(LIMIT + 2)])
    cache.add_request("live")
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="it is finished, expected active"):
        call(cache)
    assert_same_state(cache, before)


def test_validate_invariants_finds_blocks_a_terminal_request_still_owns():
    cache = tiny_cache()
    serve(cache, ["a"])
    cache._allocator.allocate(1, ("request", "a"))
    with pytest.raises(RuntimeError, match="not an active request nor a prefix"):
        cache.validate_invariants()


def _cache_with(finished: int) -> PagedKVCache:
    cache = tiny_cache(max_blocks=256)
    serve(cache, [f"done{i}" for i in range(finished)])
    live = [f"live{i}" for i in range(16)]
    for rid in live:
        cache.add_request(rid)
    for _ in range(6):
        one_token(cache, live)
    return cache


def test_validate_invariants_costs_what_is_live_not_what_was_served():
    """Operation count (lines executed) of one check after 1k and after 100k finished
    requests: equal. Before the fix it walked every record ever created (O(history))."""
    small, large = _cache_with(1_000), _cache_with(100_000)
    assert line_events(small.validate_invariants) == line_events(large.validate_invariants)
    assert line_events(lambda: small.request_ids("active")) == line_events(
        lambda: large.request_ids("active")
    )
    assert line_events(small.metrics) == line_events(large.metrics)


@pytest.mark.parametrize(
    ("make_id", "bound"),
    [
        (int, 8),  # consecutive ints join one run: nothing per request
        (lambda i: f"req-{i}", 160),  # the id itself in a set (~60 B here) and its slot
    ],
)
def test_memory_per_finished_request_is_bounded(make_id, bound):
    """Memory the cache still holds per finished request, past the bounded history (Python and
    NumPy allocations, tracemalloc): ``bound`` bytes. Before the fix every record was kept
    whole: about 1.1 KB each."""
    cache = tiny_cache()
    n = 10_000
    tracemalloc.start()
    try:  # both readings with the bounded history full, every object in it traced
        serve(cache, [make_id(i) for i in range(2 * LIMIT)], tokens=1)
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        serve(cache, [make_id(i) for i in range(2 * LIMIT, 2 * LIMIT + n)])
        gc.collect()
        per_request = (tracemalloc.get_traced_memory()[0] - start) / n
    finally:
        tracemalloc.stop()
    assert per_request < bound, f"{per_request:.0f} B per finished request"
    cache.validate_invariants()


def test_id_set_discard_splits_a_run_and_ignores_absent_ids():
    ids = IdSet()
    for i in range(10):
        ids.add(i)
    ids.add("x")
    for gone in (4, 0, 9, 42, "x", "y"):
        ids.discard(gone)
    assert [i for i in range(12) if i in ids] == [1, 2, 3, 5, 6, 7, 8]
    assert "x" not in ids and ids.num_runs == 2 and len(ids) == 7
    ids.add(4)
    assert ids.num_runs == 1


def test_terminal_history_takes_back_a_just_added_id():
    """A serving step taken back un-rejects its requests: they were never terminal."""
    history = TerminalHistory("finished", limit=3)
    for rid in range(3):
        history.add(rid, "finished")
    history.add(3, "rejected")
    history.discard(3)
    assert history.state(3) is None and history.count("rejected") == 0
    assert list(history.recent()) == [1, 2] and history.state(2) == "finished"
    history.discard(99)  # never terminal: nothing to take back
    assert history.count("finished") == 3
