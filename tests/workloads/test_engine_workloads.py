"""Synthetic and integrated engine workloads: complete, clean, deterministic, honest numbers."""

import dataclasses

import pytest

from flashdec import (
    IntegratedWorkloadResult,
    WorkloadResult,
    run_integrated_workload,
    run_synthetic_workload,
)
from flashdec.workloads import IntegratedWorkloadConfig, SyntheticWorkloadConfig, result_to_json


def _without_timings(result):
    drop = {"elapsed_s", "tokens_per_s", "step_latency", "schedule_latency", "trajectory"}
    values = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    values["trajectory"] = [dataclasses.replace(r, latency_ms=0.0) for r in result.trajectory]
    return {k: v for k, v in values.items() if k not in drop - {"trajectory"}}


def test_synthetic_workload_completes_and_cleans_up():
    result = run_synthetic_workload(num_requests=10, seed=1)
    assert isinstance(result, WorkloadResult)
    assert result.completion_rate == 1.0 and result.finished == 10
    assert result.final_used_blocks == 0
    assert result.tokens_decoded == sum(r.batch for r in result.trajectory)
    assert result.step_latency.count == result.decode_steps > 0
    assert result.step_latency.p50_ms <= result.step_latency.p99_ms
    assert 0 < result.jain_service_rate <= 1
    assert result.invariants_checked == result.steps
    assert max(r.batch for r in result.trajectory) <= result.config.max_batch_size


def test_integrated_workload_mixes_prefixes_failures_and_cleans_up():
    config = IntegratedWorkloadConfig(num_requests=14, failure_rate=0.3, seed=3)
    result = run_integrated_workload(config)
    assert isinstance(result, IntegratedWorkloadResult)
    assert result.completion_rate == 1.0
    assert result.final_used_blocks == 0
    assert result.prefix_hits > 0 and result.prefix_misses > 0
    assert result.injected_failures > 0
    assert result.verified_rollbacks == result.injected_failures
    assert result.prefix_savings_blocks == (
        result.context_blocks_without_sharing
        - result.context_blocks_private
        - result.context_blocks_shared
    )
    assert result.prefix_savings_bytes == result.prefix_savings_blocks * result.bytes_per_block
    assert result.peak_used_blocks <= config.num_blocks


def test_workloads_are_deterministic_under_a_seed():
    a = run_integrated_workload(num_requests=8, seed=7)
    b = run_integrated_workload(num_requests=8, seed=7)
    assert _without_timings(a) == _without_timings(b)
    c = run_integrated_workload(num_requests=8, seed=8)
    assert _without_timings(a) != _without_timings(c)


def test_tight_pool_still_completes_under_lifetime_admission():
    # a pool that fits only a couple of requests at a time: they queue, none gets stuck
    result = run_synthetic_workload(
        num_requests=8, num_blocks=10, max_context=20, max_new_tokens=12, arrivals_per_step=4.0
    )
    assert result.completion_rate == 1.0
    assert result.max_waiting_steps > 0
    assert result.peak_used_blocks <= 10


def test_result_serialises_to_json():
    text = result_to_json(run_synthetic_workload(num_requests=3))
    assert '"completion_rate": 1.0' in text


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"num_requests": 0}, ValueError),
        ({"min_context": 9, "max_context": 3}, ValueError),
        ({"dtype": "int8"}, ValueError),
        ({"arrivals_per_step": 0.0}, ValueError),
        ({"check_invariants": "yes"}, TypeError),
    ],
)
def test_config_validation(overrides, error):
    with pytest.raises(error):
        SyntheticWorkloadConfig(**overrides)
    with pytest.raises(ValueError):
        IntegratedWorkloadConfig(failure_rate=1.5)


def test_warmup_run_measures_the_same_workload_again():
    cold = run_synthetic_workload(num_requests=5, seed=4)
    warm = run_synthetic_workload(num_requests=5, seed=4, warmup_run=True)
    assert _without_timings(cold) == _without_timings(dataclasses.replace(warm, config=cold.config))


@pytest.mark.parametrize("runner", [run_synthetic_workload, run_integrated_workload])
def test_max_steps_stops_early_reports_and_cleans_up(runner):
    result = runner(num_requests=12, max_steps=10, seed=2)
    assert result.stopped_early and result.unfinished > 0
    assert result.finished + result.rejected + result.unfinished == 12
    assert result.final_used_blocks == 0
