"""A long-running serving loop (issue 19 §1): a round costs what is live, not every request
ever served, and a finished request leaves (almost) nothing behind in the engine, the loop or
the cache."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch

from benchmarks._common import line_events
from flashdec import BlockAwareScheduler, DecodeEngine, PagedKVCache, RequestSpec, SchedulerConfig
from flashdec.cache.history import TERMINAL_HISTORY_LIMIT
from flashdec.engine import EngineRequestState
from flashdec.engine.loop import ServingLoop, StepExecutor

RUNNING = 8


class CacheOnly(StepExecutor):
    """The cheapest executor: zero K/V through the cache's transactions, no attention."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.cache = engine.cache

    def _append(self, tx, rows: int) -> None:
        zeros = torch.zeros(rows, 1, 2)
        self.cache.write_token_layer(tx, 0, zeros, zeros)
        self.cache.commit_token(tx)

    def prefill(self, requests):
        counts = [n for _, n in requests]
        self._append(self.cache.begin_tokens([r for r, _ in requests], counts), sum(counts))

    def decode(self, batch):
        self._append(self.cache.begin_token(list(batch)), len(batch))
        return ()


def make_engine(num_blocks: int = 256) -> DecodeEngine:
    cache = PagedKVCache(
        1, 1, 2, 4, num_blocks, dtype=torch.float32, device="cpu", max_blocks_per_seq=64
    )
    return DecodeEngine(cache, append_backend="torch", decode_backend="torch")


FIRST_ORDER = 10**9  # the served requests' submission orders: after everyone else's


def finish_many(engine: DecodeEngine, count: int) -> None:
    """Submit, admit and finish ``count`` one-block requests, 200 per round (an empty pool of
    256 blocks holds them), the engine's own way."""
    scheduler = BlockAwareScheduler(SchedulerConfig(max_active_requests=200, max_batch_size=1))
    done = 0
    while done < count:
        batch = range(done, min(count, done + 200))
        for i in batch:
            engine.submit_request(RequestSpec(f"done{i}", 0, 1, FIRST_ORDER + i))
        decision = scheduler.plan(engine.scheduling_snapshot(0))
        engine.submissions.apply_trusted_decision(decision)
        assert len(decision.admit) == len(batch)
        for rid in decision.admit:
            engine.finish_request(rid)
        done += len(batch)


def loop_after(finished: int) -> ServingLoop:
    """A loop with ``RUNNING`` requests decoding and 100 waiting that never fit beside them,
    after ``finished`` requests were served."""
    engine = make_engine()
    finish_many(engine, finished)
    scheduler = BlockAwareScheduler(SchedulerConfig(max_active_requests=16, max_batch_size=8))
    loop = ServingLoop(engine, scheduler, CacheOnly(engine))
    # 8 x 31 lifetime blocks of 256, then requests of 64 blocks: never beside them (the same
    # ids and orders whatever was served: the waiting queue's shape depends on them)
    for i in range(RUNNING):
        loop.submit(RequestSpec(f"run{i}", 4, 120, i))
    for i in range(100):
        loop.submit(RequestSpec(f"wait{i}", 200, 56, RUNNING + i))
    for _ in range(3):
        record = loop.step()
    assert len(record.served) == RUNNING and record.waiting == 100
    return loop


def test_a_serving_round_costs_what_is_live_not_what_was_served():
    """One ServingLoop step (snapshot + plan + apply, the prompt imports, the decode, the
    fairness step) and one invariant check: the same number of Python lines after 1k and after
    20k finished requests (serving each through the engine costs ~0.15 ms here; the cache's
    own checks go to 100k in tests/cache/test_history.py, the benchmark
    bench_long_run.py to 100k and a 200k soak). Before the fix each round listed every record
    ever created."""
    small, large = loop_after(1_000), loop_after(20_000)
    assert line_events(small.step) == line_events(large.step)
    check = [lp.engine.cache.validate_invariants for lp in (small, large)]
    assert line_events(check[0]) == line_events(check[1])
    # and the metrics count every request without listing them
    m = large.engine.cache.metrics()
    assert (m["num_requests"], m["num_finished_requests"]) == (20_000 + RUNNING, 20_000)
    assert m["num_active_requests"] == RUNNING


@pytest.mark.parametrize(
    ("make_id", "bound"),
    [
        (int, 16),  # flashdec.LLM's ids: consecutive ints, kept as runs (measured: ~2 B)
        (lambda i: f"req-{i}", 200),  # the id itself (~60 B) and its set slot
    ],
)
def test_memory_per_request_served_through_the_loop_is_bounded(make_id, bound):
    """Memory the engine, the loop and the cache still hold per finished request, once the
    bounded histories are full (tracemalloc: Python and NumPy allocations, garbage collected
    first). Before the fix: about 1.2 KB per request (cache record, spec, submission order,
    loop counter)."""
    engine = make_engine()
    scheduler = BlockAwareScheduler(SchedulerConfig(max_active_requests=32, max_batch_size=32))
    loop = ServingLoop(engine, scheduler, CacheOnly(engine))
    submitted = 0

    def serve(count: int) -> None:
        nonlocal submitted
        end = submitted + count
        while submitted < end or not loop.idle:
            while submitted < end and loop.num_live < 64:
                loop.submit(RequestSpec(make_id(submitted), 3, 2, submitted))
                submitted += 1
            loop.step()

    tracemalloc.start()
    try:  # both readings with the bounded histories full, every object in them traced
        serve(2 * TERMINAL_HISTORY_LIMIT)
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        serve(5_000)
        gc.collect()
        per_request = (tracemalloc.get_traced_memory()[0] - start) / 5_000
    finally:
        tracemalloc.stop()
    assert per_request < bound, f"{per_request:.0f} B per finished request"
    assert engine.cache.metrics()["num_finished_requests"] == submitted
    assert loop.generated == {}  # counts leave with their requests


def test_the_engine_keeps_every_terminal_state_and_refuses_reused_ids_and_orders():
    engine = make_engine()
    scheduler = BlockAwareScheduler(SchedulerConfig(max_active_requests=4, max_batch_size=4))
    n = TERMINAL_HISTORY_LIMIT + 5
    for i in range(n):  # rejected: more blocks than the pool holds
        engine.submit_request(RequestSpec(f"big{i}", 4000, 1, i))
    engine.submit_request(RequestSpec("gone", 1, 1, n))
    engine.cancel_request("gone")  # cancelled while waiting
    engine.submissions.apply_trusted_decision(scheduler.plan(engine.scheduling_snapshot(0)))
    finish_many_after = RequestSpec("done", 1, 1, n + 1)
    engine.submit_request(finish_many_after)
    engine.submissions.apply_trusted_decision(scheduler.plan(engine.scheduling_snapshot(1)))
    engine.finish_request("done")
    assert engine.request_state("big0") is EngineRequestState.REJECTED
    assert engine.request_state("gone") is EngineRequestState.CANCELLED
    assert engine.request_state("done") is EngineRequestState.FINISHED
    for spec in (
        RequestSpec("big0", 1, 1, n + 2),
        RequestSpec("gone", 1, 1, n + 2),
        RequestSpec("done", 1, 1, n + 2),
    ):
        with pytest.raises(ValueError, match="already exists"):
            engine.submit_request(spec)
    with pytest.raises(ValueError, match="submission_order 0 is already used"):
        engine.submit_request(RequestSpec("fresh", 1, 1, 0))
    with pytest.raises(ValueError, match="only a waiting or active request's spec is kept"):
        engine.submissions.request_spec("done")
    # listing is bounded: the newest closed ids and the cache's newest terminal ones
    listed = engine.request_ids()
    assert "big0" not in listed and listed[-1] == "done"
    assert len(listed) == TERMINAL_HISTORY_LIMIT + 1
    # what the engine keeps per request is the live ones' only
    submissions = engine.submissions
    assert not submissions.specs and not engine._waiting and not submissions._service_wait
    assert not submissions._active_rows
