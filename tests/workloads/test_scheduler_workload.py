import dataclasses

import pytest

from flashdec.scheduler import RequestSpec, SchedulerConfig
from flashdec.workloads.scheduler_workload import (
    BIG_AGING_REQUEST,
    TRACE_NAMES,
    PolicyRunResult,
    SchedulerWorkloadResult,
    WorkloadTrace,
    build_trace,
    run_scheduler_workload,
    without_prefix_sharing,
)


@pytest.fixture(scope="module")
def boundary() -> SchedulerWorkloadResult:
    return run_scheduler_workload("boundary", check_invariants=True)


def test_boundary_trace_completion(boundary):
    lifetime, cancel, greedy = (boundary.run(p) for p in ("lifetime", "cancel", "greedy"))
    assert lifetime.completion_rate == 1.0
    assert (lifetime.stall_events, lifetime.cancelled, lifetime.deadlock) == (0, 0, False)
    assert cancel.completion_rate == 0.5
    assert (cancel.finished, cancel.cancelled, cancel.deadlock) == (6, 6, False)
    assert greedy.completion_rate == 0.0
    assert greedy.deadlock and greedy.stuck == 12 and greedy.tokens_decoded == 0
    assert lifetime.tokens_decoded == 12 * 8 and cancel.tokens_decoded == 6 * 8


def test_result_shapes(boundary):
    assert boundary.trace == "boundary" and boundary.seed == 0
    assert [r.policy for r in boundary.runs] == ["lifetime", "cancel", "greedy"]
    for r in boundary.runs:
        assert isinstance(r, PolicyRunResult)
        assert len(r.active_trajectory) == len(r.free_blocks_trajectory) == r.steps
        assert len(r.batch_trajectory) == r.steps == r.step_latency.count
        assert sum(r.batch_trajectory) == r.tokens_decoded
        assert r.finished + r.cancelled + r.rejected + r.stuck + r.never_admitted == 12
        assert 0.0 < r.jain_service_rate <= 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        boundary.runs[0].finished = 0  # type: ignore[misc]
    assert boundary.as_dict()["runs"][0]["policy"] == "lifetime"
    with pytest.raises(ValueError):
        boundary.run("fifo")
    # lifetime never holds more than it will need: the pool is never over-committed
    assert min(boundary.run("lifetime").free_blocks_trajectory) >= 0
    assert boundary.run("greedy").free_blocks_trajectory[-1] == 0


def test_aging_bounds_the_big_requests_wait():
    on = run_scheduler_workload("aging", policies=("lifetime",))
    off = run_scheduler_workload("aging", policies=("lifetime",), aging_threshold=None)
    assert on.aging_threshold == 8 and off.aging_threshold is None
    wait_on = on.run("lifetime").waiting_steps_of(BIG_AGING_REQUEST)
    wait_off = off.run("lifetime").waiting_steps_of(BIG_AGING_REQUEST)
    # 8 skips, then at most a few steps for the small requests ahead to drain
    assert wait_on <= 8 + 4
    assert wait_off >= 30  # overtaken until the stream of small requests ends
    for result in (on, off):
        assert result.run("lifetime").completion_rate == 1.0


def test_prefix_sharing_admits_more():
    shared = run_scheduler_workload("prefix", policies=("lifetime",), check_invariants=True)
    private = run_scheduler_workload("prefix", policies=("lifetime",), prefix_sharing=False)
    a, b = shared.run("lifetime"), private.run("lifetime")
    assert (a.peak_active, b.peak_active) == (10, 4)  # (24-4)/2 vs 24/6
    assert a.completion_rate == b.completion_rate == 1.0
    assert a.steps < b.steps and a.max_waiting_steps < b.max_waiting_steps
    assert not private.prefix_sharing
    stripped = without_prefix_sharing(build_trace("prefix"))
    assert stripped.prefixes == () and all(r.prefix_id is None for r in stripped.requests)


def test_mixed_trace_is_seeded_and_deterministic():
    a = run_scheduler_workload("mixed", seed=3, check_invariants=True)
    b = run_scheduler_workload("mixed", seed=3)
    assert [r.outcome() for r in a.runs] == [r.outcome() for r in b.runs]
    assert build_trace("mixed", 3) == build_trace("mixed", 3) != build_trace("mixed", 4)
    life = a.run("lifetime")
    assert life.stall_events == 0 and not life.deadlock
    assert life.finished + life.rejected == life.num_requests


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_every_trace_keeps_the_lifetime_promise(name):
    r = run_scheduler_workload(name, policies=("lifetime",), check_invariants=True).runs[0]
    assert r.stall_events == 0 and r.cancelled == 0 and not r.deadlock
    assert r.finished + r.rejected == r.num_requests


def test_custom_trace_step_by_step():
    specs = (RequestSpec("x", 0, 3, 0), RequestSpec("y", 5, 2, 1), RequestSpec("z", 20, 1, 2))
    trace = WorkloadTrace("tiny", specs, (0, 2, 2), 4, 4, SchedulerConfig(2, 2))
    r = run_scheduler_workload(trace, policies=["greedy"], seed=1, check_invariants=True).runs[0]
    # x decodes at steps 0-2; y (arrives at 2) imports its prompt at 2 and decodes at 3-4;
    # z can never fit: rejected
    assert (r.finished, r.rejected, r.tokens_decoded, r.steps) == (2, 1, 5, 5)
    assert r.batch_trajectory == (1, 1, 1, 1, 1)
    assert r.active_trajectory == (1, 1, 1, 1, 0)
    assert r.free_blocks_trajectory == (3, 3, 2, 2, 4)
    assert dict(r.waiting_steps_by_request) == {"x": 0, "y": 0, "z": 0}


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"trace": "nope"}, ValueError),
        ({"trace": 3}, TypeError),
        ({"policies": ("lifetime", "fifo")}, ValueError),
        ({"policies": ("greedy", "greedy")}, ValueError),
        ({"policies": "greedy"}, TypeError),
        ({"policies": ()}, TypeError),
        ({"seed": -1}, ValueError),
        ({"aging_threshold": -2}, ValueError),
        ({"prefix_sharing": 1}, TypeError),
        ({"deadlock_patience": 0}, ValueError),
        ({"max_steps": 0}, ValueError),
    ],
)
def test_run_argument_errors(kwargs, error):
    with pytest.raises(error):
        run_scheduler_workload(**kwargs)


def _trace(**over):
    args = {
        "name": "t",
        "requests": (RequestSpec("a", 1, 1, 0), RequestSpec("b", 1, 1, 1)),
        "arrival_steps": (0, 0),
        "num_blocks": 4,
        "block_size": 4,
        "config": SchedulerConfig(2, 2),
    }
    args.update(over)
    return WorkloadTrace(**args)


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"requests": [RequestSpec("a", 1, 1, 0)]}, TypeError),
        ({"arrival_steps": (0,)}, ValueError),
        ({"arrival_steps": (2, 1)}, ValueError),
        ({"arrival_steps": (0, -1)}, ValueError),
        ({"requests": (RequestSpec("a", 1, 1, 1), RequestSpec("b", 1, 1, 0))}, ValueError),
        ({"requests": (RequestSpec("a", 1, 1, 0), RequestSpec("a", 1, 1, 1))}, ValueError),
        ({"num_blocks": 0}, ValueError),
        ({"config": None}, TypeError),
        ({"prefixes": (("p", 0),)}, ValueError),
        ({"prefixes": (("p", 1), ("p", 2))}, ValueError),
        ({"prefixes": ("p",)}, TypeError),
    ],
)
def test_trace_validation(over, error):
    with pytest.raises(error):
        _trace(**over)
