"""benchmarks/profile_steps.py: the step attribution of a Chrome trace (synthetic traces) and a
smoke run on the CPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import profile_steps as ps


def _step(index, ts, dur):
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": f"{ps.STEP_PREFIX}{index}",
        "ts": ts,
        "dur": dur,
    }


def _launch(corr, ts, cat="cuda_runtime"):
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "args": {"correlation": corr},
    }


def _gpu(corr, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_kernels_belong_to_the_step_that_launched_them():
    events = [
        _step(0, 0, 100),
        _launch(1, 10),
        _launch(2, 20, "cuda_driver"),  # a graph launch: one correlation, many kernels
        _step(1, 100, 50),
        _launch(3, 120),
        _launch(9, 400),  # outside every step: ignored
        _step(2, 300, 10),  # no GPU work
        # step 0's work runs late (after step 1's host range began): still step 0's
        _gpu(1, 50, 40),
        _gpu(2, 80, 30),  # overlaps the first: busy is the union
        _gpu(2, 130, 10, "gpu_memcpy"),
        _gpu(3, 160, 20),  # after an idle gap of 20 us
        _gpu(9, 500, 5),
    ]
    rows = ps.step_timeline(events)
    assert [r["step"] for r in rows] == [0, 1, 2]
    first, second, third = rows
    assert first["wall_us"] == 100 and first["gpu_ops"] == 3
    assert first["busy_us"] == pytest.approx(60 + 10)  # [50, 110) and [130, 140)
    assert first["span_us"] == 90 and first["gap_us"] is None
    assert second["busy_us"] == 20 and second["gap_us"] == 20  # 140 -> 160
    assert third["busy_us"] is None and third["gpu_ops"] == 0


def test_work_that_overlaps_the_step_before_has_no_gap():
    events = [_step(0, 0, 10), _launch(1, 1), _step(1, 10, 10), _launch(2, 11)]
    events += [_gpu(1, 20, 30), _gpu(2, 40, 30)]  # starts before step 0's work ends
    rows = ps.step_timeline(events)
    assert rows[1]["gap_us"] == 0.0


def test_summary_by_kind():
    rows = [
        {"kind": "decode only", "wall_us": 1000, "busy_us": 800, "gap_us": None, "rows": 4},
        {"kind": "decode only", "wall_us": 3000, "busy_us": 900, "gap_us": 200, "rows": 4},
        {"kind": "with prompt chunks", "wall_us": 9000, "busy_us": None, "gap_us": None, "rows": 5},
    ]
    summary = ps.summarize(rows)
    decode = summary["kinds"]["decode only"]
    assert decode["steps"] == 2 and decode["wall_p50_us"] == 2000 and decode["busy_sum_ms"] == 1.7
    assert decode["gap_p50_us"] == 200 and decode["gap_sum_ms"] == 0.2
    assert summary["kinds"]["with prompt chunks"]["busy_p50_us"] is None
    assert summary["total"] == {
        "steps": 3,
        "wall_sum_ms": 13.0,
        "busy_sum_ms": 1.7,
        "gap_sum_ms": 0.2,
    }


def test_bad_arguments_exit_with_a_message():
    with pytest.raises(SystemExit):
        ps.parse_args(["--requests", "0"])
    with pytest.raises(SystemExit):
        ps.parse_args(["--min-prompt", "64", "--max-prompt", "8"])


def test_smoke_run_writes_the_report(tmp_path):
    ps.main(["--smoke", "--out-dir", str(tmp_path), "--name", "steps"])
    payload = json.loads((tmp_path / "steps.json").read_text())
    assert payload["rows"] and {r["kind"] for r in payload["rows"]} <= {
        "decode only",
        "with prompt chunks",
    }
    text = (tmp_path / "steps.md").read_text()
    assert "No GPU work in the trace" in text and "| decode only |" in text
