import dataclasses
import math

import pytest

from flashdec.workloads.stats import (
    LatencyStats,
    SpeculationStats,
    jain_index,
    percentile,
    ratio,
    safe_rate,
)


def test_percentile_interpolates_between_ranks():
    data = [4.0, 1.0, 3.0, 2.0]
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 4.0
    assert percentile(data, 50) == 2.5
    assert percentile([7], 99) == 7.0
    assert math.isclose(percentile(list(range(101)), 90), 90.0)


@pytest.mark.parametrize(
    ("values", "q", "error"),
    [
        ([], 50, ValueError),
        ([1.0], 101, ValueError),
        ([1.0], -1, ValueError),
        ([float("nan")], 50, ValueError),
        (["1"], 50, TypeError),
        ("12", 50, TypeError),
    ],
)
def test_percentile_errors(values, q, error):
    with pytest.raises(error):
        percentile(values, q)


def test_latency_stats_from_seconds_in_ms():
    s = LatencyStats.from_seconds([0.001, 0.002, 0.003, 0.010])
    assert s.count == 4
    assert math.isclose(s.p50_ms, 2.5)
    assert math.isclose(s.mean_ms, 4.0)
    assert math.isclose(s.max_ms, 10.0)
    assert s.p50_ms <= s.p90_ms <= s.p99_ms <= s.max_ms
    assert s == LatencyStats.from_seconds((0.003, 0.001, 0.010, 0.002))  # order-free
    assert LatencyStats.from_seconds([]) == LatencyStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert set(s.as_dict()) == {"count", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "max_ms"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.p50_ms = 0.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        LatencyStats.from_seconds([-0.1])
    with pytest.raises(ValueError):
        LatencyStats.from_seconds([float("inf")])


def test_jain_index():
    assert jain_index([3, 3, 3]) == 1.0
    assert math.isclose(jain_index([1, 0, 0, 0]), 0.25)
    assert math.isclose(jain_index([1, 2]), 9 / 10)
    assert jain_index([]) == 1.0 and jain_index([0, 0]) == 1.0
    with pytest.raises(ValueError):
        jain_index([1, -1])
    with pytest.raises(TypeError):
        jain_index([True])


def test_rate_helpers():
    assert safe_rate(10, 2.0) == 5.0 and safe_rate(10, 0.0) == 0.0
    assert ratio(1, 4) == 0.25 and ratio(0, 0) == 1.0


def test_speculation_stats_between_two_counter_readings():
    before = {"draft_tokens": 10, "accepted_tokens": 4, "request_steps": 8, "step_tokens": 12}
    after = {"draft_tokens": 30, "accepted_tokens": 19, "request_steps": 18, "step_tokens": 37}
    stats = SpeculationStats.between("ngram", before, after)
    assert (stats.draft_tokens, stats.accepted_tokens) == (20, 15)
    assert stats.acceptance_rate == 0.75 and stats.tokens_per_step == 2.5
    assert dict(stats.rows())["acceptance rate"] == "75.0%"
    idle = SpeculationStats.between("ngram", before, before)
    assert (idle.acceptance_rate, idle.tokens_per_step) == (0.0, 1.0)
