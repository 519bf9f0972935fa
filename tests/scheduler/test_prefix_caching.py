"""The lifetime policy with automatic prefix caching: a waiting request's need is its lifetime
blocks less those its hit shares with active requests; rejection uses the real pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdec.cache import PagedKVCache
from flashdec.engine import DecodeEngine
from flashdec.engine.loop import ServingLoop
from flashdec.scheduler import (
    BlockAwareScheduler,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
)
from flashdec.scheduler.spec import ceil_div
from tests.profiles import examples
from tests.scheduler.reference_policy import reference_plan
from tests.scheduler.sim import HEAD_DIM, _ZeroKV, simulate
from tests.scheduler.strategies import active_row, configs, waiting_row


def _pressure_snapshot(skip_count: int, hits: bool) -> SchedulingSnapshot:
    """Pool 10 (block size 1): A runs (6 lifetime blocks); B and C wait, 6 blocks each; C's
    hit would share 3 blocks A holds."""
    a = RequestSpec("a", 4, 2, 0)
    b, c = RequestSpec("b", 5, 1, 1), RequestSpec("c", 5, 1, 2)
    return SchedulingSnapshot(
        step=0,
        cache_version=0,
        block_size=1,
        total_blocks=10,
        free_blocks=6,
        max_blocks_per_seq=16,
        active=(active_row(a, 1, (), 4),),
        waiting=(waiting_row(b, 1, (), skip_count=skip_count), waiting_row(c, 1, ())),
        shared_hits=(("c", (3,)),) if hits else (),
    )


@pytest.mark.parametrize("hits", [False, True])
@pytest.mark.parametrize("threshold", [None, 4])
def test_a_cached_request_fits_by_its_hit_and_aging_still_stops_it(hits, threshold):
    config = SchedulerConfig(4, 4, aging_threshold=threshold)
    young = _pressure_snapshot(skip_count=0, hits=hits)
    assert BlockAwareScheduler(config).plan(young).admit == (("c",) if hits else ())
    # B aged: nobody submitted after it may overtake it, cached or not
    aged = _pressure_snapshot(skip_count=4, hits=hits)
    expected = ("c",) if hits and threshold is None else ()
    assert BlockAwareScheduler(config).plan(aged).admit == expected
    for snap in (young, aged):
        assert BlockAwareScheduler(config).plan(snap) == reference_plan("lifetime", snap, config)


@pytest.mark.parametrize(
    "hits, error",
    [
        ((("zz", (1,)),), ValueError),  # not waiting
        ((("c", (7,)),), ValueError),  # more than its lifetime blocks
        ((("c", (1, 1)),), ValueError),  # one count per pool
        ((("c", (-1,)),), ValueError),
        ((("c", (1,)), ("b", (1,))), ValueError),  # not in submission order
        ([("c", (1,))], TypeError),
    ],
)
def test_bad_shared_hits_are_rejected(hits, error):
    snap = _pressure_snapshot(0, False)
    with pytest.raises(error):
        SchedulingSnapshot(**{**snap.__dict__, "shared_hits": hits})


def _caching_loop(num_blocks: int, block_size: int = 2):
    cache = PagedKVCache(
        1,
        1,
        HEAD_DIM,
        block_size,
        num_blocks,
        dtype=torch.float32,
        device="cpu",
        enable_prefix_caching=True,
    )
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    loop = ServingLoop(engine, BlockAwareScheduler(SchedulerConfig(4, 4)), _ZeroKV(engine, True))
    return cache, engine, loop


def test_shared_blocks_admit_under_pressure_and_rejection_uses_the_real_pool():
    cache, engine, loop = _caching_loop(num_blocks=8)
    prompt = list(range(7))  # 3 full blocks
    for rid in ("a", "b"):  # 10 tokens each: 5 blocks; both need 10 of the 8
        engine.submissions.block_hashes[rid] = cache.prefix_cache.block_hashes(prompt)
        loop.submit(RequestSpec(rid, 7, 3, len(engine.submissions.specs)))
    first = loop.step()
    assert first.admitted == ("a",)  # b's hit is not cached yet: 5 blocks, 3 left
    second = loop.step()
    assert second.admitted == ("b",)  # now it shares a's 3 blocks: 2 new ones fit
    assert cache.seq_len("b") >= 6 and cache.prefix_cache.shared_cached_block_refs() == 3
    # decided once, on the real pool: 9 blocks never fit 8, however many references are shared
    assert loop.rejection_reason(RequestSpec("big", 17, 1, 99)) is not None
    assert loop.rejection_reason(RequestSpec("ok", 15, 1, 99)) is None
    while not loop.idle:
        assert not loop.step().stuck
    cache.validate_invariants()


@st.composite
def cached_traces(draw, max_requests=12):
    """Random traces whose prompts start with one of two shared token runs (so hits happen
    while the requests that cached them still run), with a random own tail."""
    bs = draw(st.sampled_from([1, 2, 4]))
    heads = [list(range(100, 100 + draw(st.integers(2, 12)))) for _ in range(2)]
    heads[1] = [t + 50 for t in heads[1]]
    n = draw(st.integers(1, max_requests))
    specs, prompts = [], {}
    for i in range(n):
        head = heads[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, 3), max_size=4))
        prompts[i] = head + tail
        specs.append(RequestSpec(i, len(prompts[i]), draw(st.integers(2, 12)), i))
    arrivals = sorted(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    num_blocks = draw(st.integers(2, 20))
    return specs, arrivals, bs, num_blocks, prompts


@pytest.mark.large
@settings(max_examples=examples(120, ci=30), deadline=None)
@given(cached_traces(), configs, st.one_of(st.none(), st.integers(1, 8)))
def test_lifetime_with_caching_never_stalls_and_rejects_exactly(trace, config, budget):
    specs, arrivals, bs, num_blocks, prompts = trace
    out = simulate(
        specs,
        arrivals,
        block_size=bs,
        num_blocks=num_blocks,
        config=config,
        max_step_tokens=budget,
        prompts=prompts,
    )
    assert out.stalls == 0
    assert set(out.finished_at) == set(out.admitted_at)
    assert set(out.finished_at) | out.rejected == {s.request_id for s in specs}
    capacity = num_blocks - config.reserve_blocks
    for s in specs:  # a request holds all its blocks, shared or not: the real pool decides
        assert (s.request_id in out.rejected) == (ceil_div(s.total_tokens, bs) > capacity)
    if config.aging_threshold is not None:
        assert out.max_skip <= config.aging_threshold
