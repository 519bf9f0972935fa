"""benchmarks/bench_extend.py without a GPU: the matrix, FLOP and byte counts, the targets, the
report and the sweep summary from fake rows; the case builder on tiny CPU tensors."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import bench_extend as be
from flashdec import paged_extend_attention_ref

CEILINGS = {"copy_tbs": 4.0}

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def make_row(shape, heads="32/8/128", fd=None, fi=None, path="NHD-fa3", **extra):
    row = be.base_row(be.MatrixCase("bf16", heads, 16, shape))
    row["plan"] = {"block_m": 128, "block_n": 64, "warps": 8, "stages": 3, "splits": 1}
    row["fd_us"], row["fd_error"] = fd, None if fd else "RuntimeError: boom"
    if fi is not None:
        row["fi_us"] = {"HND-fa2": fi * 1.3, "HND-fa3": None, "NHD-fa2": fi * 1.2, "NHD-fa3": fi}
        row["fi_errors"] = {"HND-fa3": "ValueError: unsupported"}
        row["fi_best_path"], row["fi_best_us"] = path, fi
    row.update(extra)
    return be.finish_row(row, CEILINGS)


def payload(rows, **over):
    args = be.parse_args([])
    return {
        "format": be.FORMAT,
        "sweep": False,
        "num_configs": 0,
        "args": {k: getattr(args, k) for k in be.ARG_KEYS},
        "environment": {
            "command": "python3 benchmarks/bench_extend.py",
            "commit": "abc123",
            "date_utc": "2026-12-02 10:00:00",
            "gpu": {"name": "NVIDIA H200", "sm_count": 132, "memory_gib": 139.8},
            "python": "3.12",
            "torch": "2.11",
            "cuda": "13.0",
            "triton": "3.6.0",
            "flashinfer": "0.6.15.post1",
        },
        "ceilings": CEILINGS,
        "flashinfer_error": None,
        "rows": rows,
        "skipped_size": [],
        "skipped_budget": [],
        "partial": False,
        **over,
    }


CHUNK = be.ExtendShape("chunk", 1, 512, 4096)
VERIFY = be.ExtendShape("verify", 64, 4, 4096)


class TestMatrix:
    def test_issue_matrix_and_quick_subset(self):
        cases, too_big = be.build_matrix(be.parse_args([]))
        assert not too_big
        labels = {c.shape.label for c in cases}
        assert len(labels) == 18 + 18 and len(cases) == 2 * 36  # two head configs
        assert "chunk B=16 n=2048 ctx=32768" in labels and "verify B=64 n=8 ctx=32768" in labels
        assert {c.heads for c in cases} == {"32/8/128", "28/4/128"}
        quick, _ = be.build_matrix(be.parse_args(["--quick"]))
        assert {c.shape.kind for c in quick} == {"chunk", "verify"} and len(quick) < len(cases)

    def test_selectors_size_cap_and_sweep_shapes(self):
        args = be.parse_args(["--kinds", "chunk", "--shapes", "B=1 ctx=0", "--heads", "32/8/128"])
        labels = [c.shape.label for c in be.build_matrix(args)[0]]
        assert labels == ["chunk B=1 n=512 ctx=0", "chunk B=1 n=2048 ctx=0"]
        capped, too_big = be.build_matrix(be.parse_args(["--max-kv-gib", "1"]))
        assert too_big and all(
            be.kv_bytes(c.shape, *be.parse_heads(c.heads)[1:], 2) <= 2**30 for c in capped
        )
        sweep = be.parse_args(["--sweep"])
        assert sweep.name == "extend_sweep"
        got = {c.shape.label for c in be.build_matrix(sweep)[0]}
        assert got == {s for kind in be.KINDS for s in be.SWEEP_SHAPES[kind]}

    def test_sweep_grid(self):
        args = be.parse_args(["--sweep", "--sweep-block-n", "32", "64", "--sweep-splits", "0", "4"])
        configs = be.sweep_configs(args)
        assert len(configs) == 2 * 2 * 2 * 3 * 2
        assert {c["num_splits"] for c in configs} == {None, 4}
        assert be.config_label(configs[0]) == "Mauto N32 w4 s2 splitsauto"

    def test_flops_and_bytes(self):
        s = be.ExtendShape("chunk", 2, 3, 10)  # queries see 11, 12, 13 keys
        assert s.attended() == 2 * (11 + 12 + 13)
        assert s.flops(4, 8) == 4 * 4 * 8 * 72
        assert s.bytes(4, 2, 8, 2) == 2 * 8 * (2 * 2 * 13 * 2 + 2 * 6 * 4)


class TestReport:
    def test_targets_per_class(self):
        rows = [make_row(CHUNK, fd=90.0, fi=100.0), make_row(VERIFY, fd=30.0, fi=25.0)]
        t = {x["target"]: x for x in be.evaluate_targets(rows)}
        everything = t["all shapes: geomean <= 1.00x FlashInfer's best"]
        assert everything["status"] == "MISSED"
        assert f"{math.sqrt(0.9 * 1.2):.3f}x" in everything["detail"]
        assert t["chunk: worst <= 1.15x"]["status"] == "met"
        assert t["verify: worst <= 1.15x"]["status"] == "MISSED"
        assert "1.200x" in t["verify: worst <= 1.15x"]["detail"]

    def test_without_flashinfer_nothing_is_claimed(self):
        rows = [make_row(CHUNK, fd=90.0)]
        assert {t["status"] for t in be.evaluate_targets(rows)} == {"not measured"}
        text = be.render_markdown(payload(rows, flashinfer_error="ModuleNotFoundError: x"))
        assert "**MISSING**" in text and "FlashDec alone" in text

    def test_markdown_rows_rates_and_failures(self):
        rows = [
            make_row(CHUNK, fd=500.0, fi=450.0, max_abs_diff_vs_fi=0.01),
            make_row(VERIFY, fd=None, fi=40.0),
        ]
        assert rows[0]["fd_tflops"] == pytest.approx(CHUNK.flops(32, 128) / 500e-6 / 1e12)
        text = be.render_markdown(payload(rows))
        assert "## Targets of issue 20" in text and "chunk B=1 n=512 ctx=4096" in text
        assert "NHD-fa3 2" in text and "FlashDec failed on 1 of 2 shapes" in text
        assert "128/64/8/3/1" in text and "| fail |" in text

    def test_sweep_summary_picks_the_robust_config(self):
        rows = []
        for shape, times in (
            (CHUNK, {"default": 100.0, "A": 90.0, "B": 80.0}),
            (be.ExtendShape("chunk", 4, 2048, 0), {"default": 100.0, "A": 95.0, "B": 140.0}),
        ):
            for config, us in times.items():
                row = be.base_row(be.MatrixCase("bf16", "32/8/128", 16, shape))
                row.update(config=config, fd_us=us)
                rows.append(be.finish_row(row, CEILINGS))
        summary = be.sweep_summary(rows)
        (cls,) = summary["per_class"]
        assert cls["config"] == "A"  # 90/80 and 95/95 beat B's 1.0 and 140/95
        assert cls["geomean_vs_best"] == pytest.approx(math.sqrt(90 / 80 * 1.0))
        assert [b["best"] for b in summary["best_per_shape"]] == ["B", "A"]
        assert summary["best_per_shape"][0]["speedup"] == pytest.approx(100 / 80)
        text = be.render_sweep({**payload(rows), "sweep": True, "num_configs": 2})
        assert "## Best configuration per class" in text and "| A |" in text

    def test_report_round_trip(self, tmp_path):
        rows = [make_row(CHUNK, fd=90.0, fi=100.0)]
        be.write_report(payload(rows), tmp_path, "extend", plot=False)
        assert (tmp_path / "extend.md").exists()
        args = be.parse_args(["--from-json", str(tmp_path / "extend.json")])
        assert be.rerender(args) == 0
        assert "## Targets of issue 20" in (tmp_path / "extend.md").read_text()


def test_case_builds_a_consistent_problem():
    """The case's tables, lengths and FlashInfer arrays describe the same cache; FlashDec's
    planned call (interpreted here) matches the reference on it."""
    shape = be.ExtendShape("verify", 2, 3, 21)
    case = be.ExtendCase(shape, 4, 2, 16, 8, torch.float32, seed=1, device="cpu")
    assert case.tables.shape == (2, 3) and case.indices.numel() == 6
    assert case.kv_indptr.tolist() == [0, 3, 6] and case.qo_indptr.tolist() == [0, 3, 6]
    assert case.last_page_len.tolist() == [8, 8] and case.lens.tolist() == [24, 24]
    assert len(set(case.indices.tolist())) == 6
    nhd_k, _ = case.kv_for("NHD")
    assert torch.equal(nhd_k.transpose(1, 2), case.k)
    out = case.flashdec_fn(case.plan())()
    ref = paged_extend_attention_ref(case.q, case.k, case.v, case.tables, case.lens, case.qlens)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_compile_check_lists_the_matrix_and_the_gpu_variants():
    """benchmarks/compile_extend.py (sm_90 compile without a GPU) covers every default plan of
    the benchmark and the variants the GPU tests run; its report flags what does not fit."""
    from benchmarks import compile_extend as ce

    cases = ce.cases(ce.parse_args([]))
    labels = {c[0] for c in cases}
    assert {"default", "head_dim 256", "fp8", "window", "dim_major", "fp32"} <= labels
    assert sum(c[0] == "default" for c in cases) == 72
    sweep = ce.cases(ce.parse_args(["--sweep"]))
    assert len(sweep) > len(cases)
    row = {"variant": "default", "heads": "32/8/128", "dtype": "bfloat16", "shape": "x"}
    text = ce.render(
        {
            "environment": _fake_environment(),
            "kernels": 1,
            "rows": [{**row, "smem_kib": 240.0, "fits": False}, {**row, "error": "E: boom"}],
        }
    )
    assert "2 fail to compile or do not fit" in text and "**NO**" in text


def _fake_environment():
    return payload([])["environment"]


def test_measure_and_sweep_rows_on_the_interpreter(monkeypatch):
    """The measuring code paths end to end on a tiny case, with the CUDA-graph timer replaced
    by one plain call (the CPU has no graphs)."""
    monkeypatch.setattr(be, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(be, "graph_us_per_call", lambda fn, calls, warmup, rep: (fn(), 5.0)[1])
    args = be.parse_args(["--heads", "4/2/16", "--page", "8", "--sweep-block-n", "16"])
    mc = be.MatrixCase("fp16", "4/2/16", 8, be.ExtendShape("verify", 2, 3, 21))
    row = be.measure(mc, args, None, None, CEILINGS)
    assert row["fd_us"] == 5.0 and row["fd_error"] is None and row["plan"]["block_m"] == 16
    assert row["fd_tflops"] > 0 and row["ratio"] is None
    args.sweep_block_m, args.sweep_warps, args.sweep_stages = [None], [4], [2]
    rows = be.measure_sweep(mc, be.sweep_configs(args), args)
    assert [r["config"] for r in rows] == ["default", "Mauto N16 w4 s2 splitsauto"]
    assert all(r["fd_us"] == 5.0 for r in rows)
    assert be.progress_line(be.finish_row(rows[1], CEILINGS)).startswith("fp16 4/2/16 verify")
