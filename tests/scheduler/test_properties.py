"""Hypothesis properties of the policies over random snapshots and random finite traces."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdec.scheduler import (
    POLICIES,
    PrefixInfo,
    RequestSpec,
    blocks_needed_now,
    lifetime_headroom,
    make_scheduler,
)
from flashdec.scheduler.spec import ceil_div
from tests.profiles import examples
from tests.scheduler.reference_policy import reference_plan
from tests.scheduler.sim import simulate
from tests.scheduler.strategies import configs, snapshots

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def traces(draw, max_requests=14):
    """Random finite traces: specs (some on a shared prefix), arrivals, pool and block size."""
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    prefixes = ()
    if draw(st.booleans()):
        nb = draw(st.integers(1, 3))
        prefixes = (PrefixInfo("p", nb, nb * bs, 0),)
    n = draw(st.integers(1, max_requests))
    specs = []
    for i in range(n):
        new = draw(st.integers(1, 20))
        if prefixes and draw(st.booleans()):
            specs.append(RequestSpec(i, prefixes[0].num_tokens, new, i, prefix_id="p"))
        else:
            specs.append(RequestSpec(i, draw(st.integers(0, 20)), new, i))
    arrivals = sorted(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    prefix_blocks = sum(p.num_blocks for p in prefixes)
    num_blocks = prefix_blocks + draw(st.integers(0, 24))
    return specs, arrivals, bs, max(1, num_blocks), prefixes


@SETTINGS
@given(snapshots(), configs, st.sampled_from(sorted(POLICIES)))
def test_plan_is_pure_and_deterministic(snapshot, config, policy):
    before_snapshot, before_config = copy.deepcopy(snapshot), copy.deepcopy(config)
    scheduler = make_scheduler(policy, config)
    first = scheduler.plan(snapshot)
    assert snapshot == before_snapshot and config == before_config
    assert repr(snapshot) == repr(before_snapshot)
    assert scheduler.plan(snapshot) == first
    assert make_scheduler(policy, before_config).plan(before_snapshot) == first


@SETTINGS
@given(snapshots(), configs, st.sampled_from(sorted(POLICIES)))
def test_plan_equals_the_scanning_oracle(snapshot, config, policy):
    assert make_scheduler(policy, config).plan(snapshot) == reference_plan(policy, snapshot, config)


@SETTINGS
@given(snapshots(), configs, st.sampled_from(sorted(POLICIES)))
def test_decisions_respect_caps_and_reserve(snapshot, config, policy):
    d = make_scheduler(policy, config).plan(snapshot)
    assert len(d.batch) <= config.max_batch_size
    if d.admit:
        assert len(snapshot.active) + len(d.admit) <= config.max_active_requests
    waiting = {r.request_id: r for r in snapshot.waiting}
    admitted = [waiting[rid] for rid in d.admit]
    assert [r.spec.submission_order for r in admitted] == sorted(
        r.spec.submission_order for r in admitted
    )
    # the batch is runnable and never skips a longer-waiting runnable request
    runnable = [r for r in snapshot.active if r.runnable]
    assert len(d.batch) == min(config.max_batch_size, len(runnable) + len(d.admit))
    if policy == "lifetime":
        committed = sum(r.lifetime_private_blocks for r in admitted)
        assert committed <= lifetime_headroom(snapshot, config.reserve_blocks) or not admitted
        total = (
            snapshot.resident_prefix_blocks
            + sum(r.lifetime_private_blocks for r in snapshot.active)
            + committed
            + config.reserve_blocks
        )
        assert not admitted or total <= snapshot.total_blocks
    else:
        need = sum(blocks_needed_now(r, snapshot) for r in admitted)
        assert need <= snapshot.free_blocks - config.reserve_blocks or not admitted


@pytest.mark.large
@settings(max_examples=examples(150, ci=40), deadline=None)
@given(traces(), configs, st.one_of(st.none(), st.integers(1, 8)))
def test_lifetime_never_stalls_and_everything_admitted_completes(trace, config, budget):
    """Also with a step budget, where prompts arrive in chunks over several steps (the
    lifetime commitment is taken at admission, whole)."""
    specs, arrivals, bs, num_blocks, prefixes = trace
    out = simulate(
        specs,
        arrivals,
        block_size=bs,
        num_blocks=num_blocks,
        config=config,
        prefixes=prefixes,
        max_step_tokens=budget,
    )
    assert out.stalls == 0  # no admitted request ever found its next block missing
    assert set(out.finished_at) == set(out.admitted_at)
    # every request either could never fit (rejected) or ran to the end
    assert set(out.finished_at) | out.rejected == {s.request_id for s in specs}
    capacity = num_blocks - config.reserve_blocks - sum(p.num_blocks for p in prefixes)
    for s in specs:
        private = ceil_div(s.total_tokens, bs) - (
            prefixes[0].num_blocks if s.prefix_id is not None else 0
        )
        assert (s.request_id in out.rejected) == (private > capacity)


@pytest.mark.large
@settings(max_examples=examples(40, ci=10), deadline=None)
@given(
    traces(max_requests=10),
    configs.filter(lambda c: c.aging_threshold is not None),
    st.integers(1, 3),
    st.integers(1, 3),
)
def test_aging_bounds_every_wait(trace, config, stream_rate, small_new):
    """A trace followed by a long stream of small arrivals: nobody is overtaken more than
    ``aging_threshold`` times, and an aged request is admitted within a bound that depends on
    what was ahead of it, not on how long the stream runs."""
    specs, arrivals, bs, num_blocks, prefixes = trace
    n = len(specs)
    last = arrivals[-1]
    for step in range(last, last + 80):  # the stream
        for _ in range(stream_rate):
            specs.append(RequestSpec(len(specs), 0, small_new, len(specs)))
            arrivals.append(step)
    out = simulate(
        specs,
        arrivals,
        block_size=bs,
        num_blocks=num_blocks,
        config=config,
        prefixes=prefixes,
        max_steps=20_000,
    )
    assert out.stalls == 0
    assert out.max_skip <= config.aging_threshold
    assert set(out.finished_at) | out.rejected == {s.request_id for s in specs}
    longest = max(s.max_new_tokens for s in specs)
    rounds = ceil_div(config.max_active_requests, config.max_batch_size)
    for rid, aged in out.aged_at.items():
        if rid in out.rejected:
            continue
        ahead = out.aged_context[rid]
        assert out.admitted_at[rid] - aged <= (ahead + 1) * (longest * rounds + 1)
    assert n <= len(specs)
