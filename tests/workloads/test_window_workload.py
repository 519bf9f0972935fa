"""Workloads on KV layer groups: ``kv_spec`` on the engine workloads, and the window workload's
flat window-group blocks and admitted concurrency with and without windows."""

import json

import pytest

from flashdec.workloads import (
    IntegratedWorkloadConfig,
    SyntheticWorkloadConfig,
    WindowWorkloadConfig,
    result_to_json,
    run_integrated_workload,
    run_synthetic_workload,
    run_window_workload,
)

SPEC = "(2,48,8,2,32):float32:2;(2,24,8,1,16):float32:1:window=16"


def test_integrated_workload_on_groups_reports_every_group():
    result = run_integrated_workload(kv_spec=SPEC, prefix_hit_rate=0.0, num_requests=10, seed=2)
    assert result.completion_rate == 1.0 and result.final_used_blocks == 0
    assert result.verified_rollbacks == result.injected_failures
    full, window = result.groups
    assert (full["window"], window["window"]) == (None, 16)
    assert full["layers"] == [0, 1] and window["layers"] == [2]
    assert window["block_bound_per_request"] == 3
    assert 0 < window["peak_used_blocks"] <= 24
    # peak bytes count each group's blocks at their own size
    assert result.peak_kv_bytes <= 48 * 2 * 2 * 8 * 2 * 32 * 4 + 24 * 2 * 8 * 16 * 4


def test_synthetic_workload_on_one_window_group():
    result = run_synthetic_workload(kv_spec="(2,48,8,2,32):float32:1:window=12", num_requests=6)
    assert result.finished == 6 and result.final_used_blocks == 0
    assert result.groups[0]["block_bound_per_request"] == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_spec": "(2,48,8,2,32):float32"}, "group 0"),
        ({"kv_spec": SPEC, "head_dim": 64}, "--head-dim"),
        ({"kv_spec": SPEC, "dtype": "float16"}, "--dtype"),
        ({"kv_spec": SPEC, "num_q_heads": 3}, "multiple of kv_spec group"),
        ({"kv_spec": "(2,8,8,2,32):float8_e4m3fn:1"}, "FP8"),
        ({"kv_spec": SPEC, "reserve_blocks": 30}, "group 1"),
    ],
)
def test_bad_kv_specs_are_refused_before_running(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticWorkloadConfig(**kwargs)


def test_prefix_hits_need_one_full_group():
    with pytest.raises(ValueError, match="single full-attention"):
        IntegratedWorkloadConfig(kv_spec=SPEC)  # prefix_hit_rate 0.5 by default
    with pytest.raises(ValueError, match="--num-layers"):
        IntegratedWorkloadConfig(kv_spec=SPEC, prefix_hit_rate=0.0, num_layers=2)
    one = IntegratedWorkloadConfig(kv_spec="(2,48,8,2,32):float32:3", prefix_blocks=2)
    assert one.layers == 3 and one.memory_estimate().kv_cache_bytes == 48 * 8 * 2 * 32 * 4 * 6


def test_window_workload_is_flat_and_admits_more():
    config = WindowWorkloadConfig(
        kv_spec="(2,64,8,1,8):float32:1;(2,16,8,1,8):float32:2:window=12",
        generation_tokens=100,
        num_requests=8,
        context_tokens=4,
        max_new_tokens=60,
    )
    result = run_window_workload(config)
    assert result.window_groups_flat
    full, window = zip(*result.blocks_trajectory, strict=True)
    assert list(full) == [-(-n // 8) for n in result.tokens_trajectory]  # grows with the length
    assert max(window) <= 3 and result.steady_blocks[1][1] <= 3  # ceil(12 / 8) + 1
    assert result.max_blocks_held == (13, max(window))
    # 64 tokens: 8 blocks in a full group, 3 in the window group; the 16-block window pool
    # holds 5 at once, the same pool with full attention 2 (the 64-block group fits 8)
    assert (result.windowed.admitted_at_once, result.all_full.admitted_at_once) == (5, 2)
    assert result.concurrency_gain == 2.5
    for run in (result.windowed, result.all_full):
        assert run.finished == 8 and run.stalls == 0 and run.rejected == 0
    assert result.windowed.steps < result.all_full.steps
    assert "all_full" in json.loads(result_to_json(result))


def test_window_workload_config_checks():
    with pytest.raises(ValueError, match="window group"):
        WindowWorkloadConfig(kv_spec="(2,64,8,1,8):float32:2")
    with pytest.raises(ValueError, match="do not fit"):
        WindowWorkloadConfig(kv_spec="(2,4,8,1,8):float32:1;(2,4,8,1,8):float32:1:window=4")
