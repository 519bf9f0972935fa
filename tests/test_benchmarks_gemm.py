"""benchmarks/bench_gemm.py on the CPU: the step's GEMM shapes, the report, bad arguments."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_gemm
from flashdec.models.shapes import BUILTIN_SHAPES


def test_llama3_8b_step_gemms_are_the_fused_projections_and_the_head():
    shapes = bench_gemm.model_shapes(BUILTIN_SHAPES["llama3-8b-shape"].make_config())
    assert [(s.name, s.out_features, s.in_features, s.per_step) for s in shapes] == [
        ("qkv", 6144, 4096, 32),
        ("o", 4096, 4096, 32),
        ("gate_up", 28672, 4096, 32),
        ("down", 4096, 14336, 32),
        ("lm_head", 128256, 4096, 1),
    ]


def test_smoke_run_writes_every_shape_at_every_m_and_the_step_totals(tmp_path):
    assert (
        bench_gemm.main(
            ["--smoke", "--batch", "1", "3", "--copies", "2", "--out-dir", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "gemm.json").read_text())
    rows = result["rows"]
    assert [(r["name"], r["m"]) for r in rows] == [
        (name, m) for name in ("qkv", "o", "gate_up", "down", "lm_head") for m in (1, 3)
    ]
    for r in rows:
        assert r["us"] > 0 and r["copies"] == 2 and r["of_copy"] is None  # no ceiling on a CPU
        assert r["bytes"] == 4 * (
            r["out_features"] * r["in_features"] + r["m"] * (r["in_features"] + r["out_features"])
        )
    totals = {t["m"]: t for t in result["step_totals"]}
    at_one = [r for r in rows if r["m"] == 1]
    assert totals[1]["us"] == pytest.approx(sum(r["us"] * r["per_step"] for r in at_one))
    markdown = (tmp_path / "gemm.md").read_text()
    assert "## One decode step's GEMMs" in markdown and "not measured (no GPU" in markdown


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--copies", "0"], ["--dtype", "int8"]])
def test_bad_arguments_are_one_error(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_gemm.main([*argv, "--out-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_smoke_run_with_the_gemv_rows(tmp_path):
    assert (
        bench_gemm.main(
            ["--smoke", "--gemv", "--batch", "1", "--copies", "1", "--out-dir", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "gemm.json").read_text())
    assert [r["name"] for r in result["gemv_rows"]] == ["qkv", "o", "gate_up", "down", "lm_head"]
    for r in result["gemv_rows"]:
        assert r["gemv_us"] > 0 and r["cublas_us"] > 0 and r["used"] is False  # a CPU weight
        assert r["best_config"] == "default"
    assert "FlashDec's GEMV" in (tmp_path / "gemm.md").read_text()
