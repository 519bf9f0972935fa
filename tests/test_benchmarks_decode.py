"""benchmarks/bench_decode.py without a GPU: argument presets, the matrix, the targets of issue 10
and the report, rendered from fake result rows; the ``Case`` helpers on tiny CPU tensors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import bench_decode as bd

CEILINGS = {"copy_tbs": 4.0, "read_tbs": 4.2}


def make_row(heads="32/8/128", shape=None, page=16, fd=None, fi=None, path="HND-tc", **extra):
    """A measured row as bench_decode writes it (times in microseconds)."""
    shape = shape or bd.uniform_shape(1, 32768)
    row = bd.base_row(bd.MatrixCase("bf16", heads, page, shape))
    row["plan"] = {"splits": 4}
    row["fd_us"], row["fd_error"] = fd, None if fd else "RuntimeError: boom"
    if fi is not None:
        row["fi_us"] = {"HND-tc": fi, "HND-cc": None, "NHD-tc": fi * 1.1, "NHD-cc": fi * 1.2}
        row["fi_errors"] = {"HND-cc": "ValueError: unsupported"}
        row["fi_best_path"], row["fi_best_us"] = path, fi
    row.update(extra)
    return bd.finish_row(row, CEILINGS)


def payload(rows, **over):
    args = bd.parse_args(["--quick"])
    return {
        "format": bd.FORMAT,
        "args": {k: getattr(args, k) for k in bd.ARG_KEYS},
        "environment": {
            "command": "python3 benchmarks/bench_decode.py --quick",
            "commit": "abc123",
            "date_utc": "2026-11-30 20:00:00",
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


class TestArgs:
    def test_quick_preset_fills_only_what_is_unset(self):
        args = bd.parse_args(["--quick", "--rep", "7"])
        assert args.heads == bd.QUICK["heads"] and args.rep == 7.0
        assert args.warmup == bd.QUICK["warmup"] and args.budget_s == bd.QUICK["budget_s"]
        full = bd.parse_args([])
        assert full.heads == list(bd.HEAD_CONFIGS) and full.budget_s > 1e6
        assert full.pages == [16, 32, 64] and full.dtypes == ["bf16"]

    @pytest.mark.parametrize("spec", ["32/8", "32/x/128", "30/8/128", "0/1/64"])
    def test_bad_head_config_is_rejected(self, spec):
        with pytest.raises(ValueError, match="head config"):
            bd.parse_args(["--heads", spec])

    def test_bad_kind_and_calls(self):
        with pytest.raises(SystemExit):
            bd.parse_args(["--kinds", "diagonal"])
        with pytest.raises(SystemExit):
            bd.parse_args(["--calls", "0"])


class TestMatrix:
    def test_head_configs_cover_every_group_and_head_dim(self):
        groups = {bd.parse_heads(h)[0] // bd.parse_heads(h)[1] for h in bd.HEAD_CONFIGS}
        assert set(range(1, 9)) <= groups and 32 in groups  # GQA 1-8 and MQA
        assert {bd.parse_heads(h)[2] for h in bd.HEAD_CONFIGS} == {64, 128, 256}

    def test_ragged_lengths_are_fixed_by_the_seed_and_in_range(self):
        a, b = bd.ragged_shape(48, 12345, seed=3), bd.ragged_shape(48, 12345, seed=3)
        assert a == b and a.batch == 48 and a.kind == "ragged"
        assert min(a.lens) >= 1 and max(a.lens) <= 12345 and len(set(a.lens)) > 30
        assert bd.ragged_shape(48, 12345, seed=4).lens != a.lens

    def test_shared_pair_shares_whole_prefix_pages(self):
        shared, own = bd.shared_pair(3, 70, 32)
        assert shared.lens == own.lens and shared.pair == own.label and own.pair == shared.label
        assert shared.shared_prefix == 32 and own.shared_prefix == 0
        with pytest.raises(ValueError, match="shorter"):
            bd.shared_pair(3, 32, 32)
        case = bd.Case(
            list(shared.lens), 4, 2, 16, 16, torch.float32, device="cpu", shared_prefix=32
        )
        apart = bd.Case(list(own.lens), 4, 2, 16, 16, torch.float32, device="cpu")
        # 5 pages a request; the first 2 are the same pages in every row, the rest distinct
        assert case.k.shape[0] == 2 + 3 * 3 + 1 and apart.k.shape[0] == 3 * 5 + 1
        assert (case.tables[:, :2] == case.tables[0, :2]).all()
        own_pages = case.tables[:, 2:5].flatten().tolist()
        assert len(set(own_pages)) == 9 and not set(own_pages) & set(case.tables[0, :2].tolist())
        assert case.indices.tolist() == case.tables[:, :5].flatten().tolist()
        assert case.indptr.tolist() == [0, 5, 10, 15]
        with pytest.raises(ValueError, match="extend past"):
            bd.Case([32, 70], 4, 2, 16, 16, torch.float32, device="cpu", shared_prefix=32)

    def test_skew_pair_has_equal_bytes(self):
        skewed, uniform = bd.skew_pair(32768, 1024, 63)
        assert skewed.total_tokens == uniform.total_tokens and skewed.batch == uniform.batch
        assert skewed.pair == uniform.label and uniform.pair == skewed.label
        assert uniform.label == "uniform 64x1520" and len(set(uniform.lens)) == 1
        with pytest.raises(ValueError, match="evenly"):
            bd.skew_pair(1000, 3, 2)

    def test_quick_covers_every_class_and_the_weak_shapes(self):
        cases, too_big = bd.build_matrix(bd.parse_args(["--quick"]))
        assert not too_big
        assert {c.shape.kind for c in cases} == set(bd.KINDS)
        keys = {(c.heads, c.page, c.shape.label) for c in cases}
        for want in [
            ("28/4/128", 16, "ragged 48x1..12345"),
            ("16/8/256", 16, "B=1 L=32768"),
            ("32/1/128", 16, "B=32 L=4096"),
            ("32/8/128", 16, "B=1024 L=17"),
            ("12/2/128", 16, "uniform 64x1520"),  # the skewed batch brings its partner
            ("32/8/128", 64, "B=32 L=4096"),
        ]:
            assert want in keys
        more = [c for c in cases if c.heads in bd.QUICK["more_heads"]]
        assert {c.shape.label for c in more} == {"B=1 L=32768", "B=1024 L=17"}
        assert len(more) == 12 and cases[-12:] == more  # last: a budget cut drops them first
        groups = {bd.parse_heads(c.heads)[0] // bd.parse_heads(c.heads)[1] for c in cases}
        assert set(range(1, 9)) <= groups  # every GQA group, and MQA
        assert {bd.parse_heads(c.heads)[2] for c in cases} == {64, 128, 256}
        assert len(keys) == len(cases) <= 62  # about four and a half minutes on an H200

    def test_issue25_preset_has_every_row_of_the_issue(self):
        """Issue 25's kernel table in one run: its exact shapes on its head configs."""
        args = bd.parse_args(["--issue25"])
        cases, too_big = bd.build_matrix(args)
        assert not too_big
        keys = {(c.heads, c.page, c.shape.label) for c in cases}
        for want in [
            ("32/8/128", 16, "B=1 L=32768"),
            ("32/8/128", 32, "B=1 L=32768"),
            ("32/4/128", 16, "B=1 L=32768"),
            ("28/4/128", 16, "B=1 L=32768"),
            ("28/4/128", 16, "ragged 4x[12345,777,4097,1]x8"),
            ("28/4/128", 16, "B=48 L=3000"),
            ("16/8/256", 16, "B=512 L=33"),
            ("16/8/256", 16, "B=1024 L=17"),
            ("32/1/128", 16, "B=1 L=32768"),
            ("32/4/128", 16, "skewed 1x32768+63x1024"),
            ("32/4/128", 16, "uniform 64x1520"),
            ("32/8/128", 16, "B=16 L=16384"),
        ]:
            assert want in keys
        ragged = next(c.shape for c in cases if c.shape.label.startswith("ragged 4x"))
        assert ragged.lens == (12345, 777, 4097, 1) * 8
        with pytest.raises(SystemExit):
            bd.parse_args(["--issue25", "--quick"])

    def test_full_matrix_classes_pages_and_size_cap(self):
        args = bd.parse_args(["--max-kv-gib", "1"])
        cases, too_big = bd.build_matrix(args)
        assert too_big and all(
            bd.kv_bytes(c.shape.lens, *bd.parse_heads(c.heads)[1:], 2) <= 2**30 for c in cases
        )
        short = [c for c in cases if c.shape.kind == "short" and c.shape.batch == 1024]
        assert {c.shape.max_len for c in short} == {1, 8, 17, 33, 64}
        pages = {c.page for c in cases if c.heads == "28/4/128"}
        assert pages == {16, 32, 64}
        assert {c.page for c in cases if c.heads == "24/8/128"} == {16}

    def test_shape_selectors(self):
        args = bd.parse_args(["--heads", "32/8/128", "--pages", "16", "--shapes", "B=1", "skewed"])
        labels = [c.shape.label for c in bd.build_matrix(args)[0]]
        assert "B=1 L=32768" in labels and "B=1 L=131072" in labels
        assert "skewed 1x131072+255x512" in labels and "uniform 256x1022" in labels
        assert "B=32 L=4096" not in labels


class TestTargets:
    def test_met_and_missed_lines(self):
        skewed, uniform = bd.skew_pair(32768, 1024, 63)
        rows = [
            make_row(fd=40.0, fi=45.0),  # B=1 L=32768 32/8/128: 128 MiB
            make_row(heads="32/1/128", fd=20.0, fi=30.0),
            make_row(shape=bd.uniform_shape(1024, 17, "short"), fd=60.0, fi=50.0),
            make_row(shape=skewed, fd=120.0, fi=400.0),
            make_row(shape=uniform, fd=100.0, fi=110.0),
        ]
        t = {x["target"].split(":")[0].split(" (")[0]: x for x in bd.evaluate_targets(rows)}
        every = t["<= 1.00x FlashInfer's best on every shape where it runs"]
        assert every["status"] == "MISSED" and "1.200x" in every["detail"]
        assert "1 of 5" in every["detail"]
        geo = t["geometric mean <= 0.92x"]
        expected = math.exp(
            sum(math.log(x) for x in (40 / 45, 20 / 30, 60 / 50, 120 / 400, 100 / 110)) / 5
        )
        assert geo["status"] == "met" and f"{expected:.3f}x" in geo["detail"]
        b1 = [x for x in bd.evaluate_targets(rows) if x["target"].startswith("B=1 L=32768")]
        # 128 MiB in 40 us = 3.36 TB/s = 84% of 4.0: missed; MQA 16 MiB in 20 us: 21%: missed
        assert [x["status"] for x in b1] == ["MISSED", "MISSED"]
        short = t["B=1024 L<=64"]
        assert short["status"] == "MISSED" and "B=1024 L=17" in short["detail"]
        skew = t["skewed batch <= 1.10x the uniform batch of equal bytes, every head config"]
        assert skew["status"] == "MISSED" and "x1.20" in skew["detail"]

    def test_without_flashinfer_nothing_is_claimed(self):
        targets = bd.evaluate_targets([make_row(fd=30.0)])
        by_name = {x["target"]: x["status"] for x in targets}
        assert by_name["geometric mean <= 0.92x"] == "not measured"
        assert by_name["B=1 L=32768 >= 85% of copy (GQA/MHA)"] == "met"  # 128 MiB / 30 us
        assert by_name["B=1 L=32768 >= 50% of copy (MQA)"] == "not measured"

    def test_fp8_targets(self):
        big = bd.uniform_shape(32, 4096)  # 512 MiB of bf16 KV at 32/8/128
        fp8 = {"fd_us": 80.0, "fi_best_us": 70.0, "fi_best_path": "HND-tc"}
        rows = [make_row(shape=big, fd=140.0, fi=150.0, fp8=fp8)]
        t = {x["target"]: x for x in bd.evaluate_targets(rows)}
        assert t["FP8 >= 1.7x FlashDec bf16 where bf16 KV >= 512 MiB"]["status"] == "met"
        assert "1.75x" in t["FP8 >= 1.7x FlashDec bf16 where bf16 KV >= 512 MiB"]["detail"]
        vs_fi = t["FP8 <= 1.00x FlashInfer's FP8 decode where it runs"]
        assert vs_fi["status"] == "MISSED" and "1.143x" in vs_fi["detail"]
        assert rows[0]["fp8"]["pct_copy"] == pytest.approx(100 * 256 * 2**20 / 80e-6 / 4e12)


class TestReport:
    def rows(self):
        skewed, uniform = bd.skew_pair(32768, 1024, 63)
        return [
            make_row(fd=40.0, fi=45.0),
            make_row(heads="28/4/128", shape=bd.ragged_shape(48, 12345), fd=90.0, fi=80.0),
            make_row(shape=skewed, fd=110.0, fi=400.0, path="NHD-tc"),
            make_row(shape=uniform, fd=100.0, fi=110.0),
            make_row(heads="16/8/256", fd=None, fi=50.0),
        ]

    def test_markdown_has_targets_summary_and_every_row(self):
        text = bd.render_markdown(payload(self.rows()))
        assert "## Targets of issue 10" in text and "[MISSED]" in text
        assert "FlashInfer: present" in text and "NHD-tc 1" in text
        assert "skewed 1x32768+63x1024 vs uniform 64x1520: FlashDec x1.10" in text
        assert "28/4/128 (group 7: Qwen2/2.5-7B): 1.125x" in text
        assert "FlashDec failed on 1 of 5 shapes" in text
        table = [line for line in text.splitlines() if line.startswith("| bf16")]
        assert len(table) == 5 and "| fail |" in table[-1]
        assert "## FP8" not in text

    def test_outputs_that_disagree_are_flagged(self):
        rows = self.rows()
        rows[0]["max_abs_diff_vs_fi"], rows[1]["max_abs_diff_vs_fi"] = 0.008, 0.5
        text = bd.render_markdown(payload(rows))
        assert "largest |diff| 0.5000 (bf16 28/4/128 p16 ragged 48x1..12345) over 2 shapes" in text
        assert "1 above 0.05; **bf16 28/4/128 p16 ragged 48x1..12345: 0.500**" in text

    def test_missing_flashinfer_is_said(self):
        rows = [make_row(fd=40.0)]
        text = bd.render_markdown(payload(rows, flashinfer_error="ModuleNotFoundError: x"))
        assert "**MISSING** (ModuleNotFoundError: x)" in text
        assert "[not measured] geometric mean" in text

    def test_budget_and_partial_are_said(self):
        text = bd.render_markdown(payload([], skipped_budget=["bf16 32/8/128 16 B=1"], partial=1))
        assert "partial results" in text and "time budget" in text and "1 cases" in text

    def test_json_round_trip_and_rerender_keeps_notes(self, tmp_path):
        data = payload(self.rows())
        md = bd.write_report(data, tmp_path, "decode", plot=False)
        saved = json.loads((tmp_path / "decode.json").read_text())
        assert saved["rows"] == json.loads(json.dumps(data["rows"]))
        assert [t["status"] for t in saved["targets"]][:2] == ["MISSED", "met"]
        md.write_text(md.read_text() + "\n## Notes\n\nwritten by hand\n")
        assert bd.main(["--from-json", str(tmp_path / "decode.json")]) == 0
        text = md.read_text()
        assert text.count("## Notes") == 1 and "written by hand" in text
        assert "## Targets of issue 10" in text

    def test_rerender_refuses_the_old_format(self, tmp_path, capsys):
        (tmp_path / "old.json").write_text(json.dumps({"rows": [], "environment": {}}))
        assert bd.main(["--from-json", str(tmp_path / "old.json")]) == 2
        assert "earlier bench_decode" in capsys.readouterr().err

    def test_fp8_table(self):
        fp8 = {
            "fd_us": 80.0,
            "fi_best_us": 90.0,
            "fi_best_path": "HND-cc",
            "fd_error_vs_bf16": {"max_abs": 0.03, "rel_l2": 0.02},
        }
        rows = [make_row(shape=bd.uniform_shape(32, 4096), fd=140.0, fi=150.0, fp8=fp8)]
        text = bd.render_markdown(payload(rows))
        assert "## FP8 e4m3 KV cache" in text
        line = next(x for x in text.splitlines() if x.startswith("| 32/8/128"))
        assert "| 1.75 |" in line and "| 0.889 |" in line and "| 0.0200 |" in line


class TestCaseOnCpu:
    def test_layouts_and_fp8_copies_hold_the_same_values(self):
        case = bd.Case([5, 20], 4, 2, 16, 8, torch.bfloat16, device="cpu")
        k, v = case.kv_for("NHD")
        assert k.shape == (case.k.shape[0], 8, 2, 16)
        assert torch.equal(k.transpose(1, 2), case.k) and torch.equal(v.transpose(1, 2), case.v)
        assert case.kv_for("HND")[0] is case.k
        if bd.FP8 is None:
            pytest.skip("no float8 in this torch")
        k8, v8, sk, _ = case.fp8_cache()
        assert k8.dtype == bd.FP8 and sk == pytest.approx(case.k.abs().max().item() / 448)
        err = (k8.float() * sk - case.k.float()).abs().max().item()
        assert err <= 0.0625 * case.k.abs().max().item()  # e4m3: 3 mantissa bits
        assert torch.equal(case.kv_for("NHD", fp8=True)[1].transpose(1, 2), v8)
        assert case.kv_bytes == 25 * 2 * 16 * 2 * 2

    def test_flashdec_path_matches_the_gather_reference(self):
        case = bd.Case([5, 20], 4, 2, 16, 8, torch.float32, device="cpu")
        plan, api, launch = case.flashdec_fns()
        ref = case.sdpa_fn()()
        torch.testing.assert_close(api(), ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(launch(), ref, atol=2e-3, rtol=2e-3)
        assert bd.plan_summary(plan)["splits"] == plan.num_splits


@pytest.mark.gpu
def test_bench_decode_runs_on_the_gpu(tmp_path):
    code = bd.main(
        [
            "--heads",
            "32/8/128",
            "--pages",
            "16",
            "--kinds",
            "uniform",
            "skewed",
            "--shapes",
            "B=32 L=4096",
            "skewed 1x32768+63x1024",
            "--warmup",
            "2",
            "--rep",
            "5",
            "--fp8",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert len(saved["rows"]) == 3 and all(r.get("fd_us") for r in saved["rows"])
    assert (tmp_path / "decode.md").exists()


class FakeFlashInfer:
    """A stand-in for FlashInfer's paged decode wrapper, computed in PyTorch from the page arrays
    bench_decode gives it (so it also checks those arrays against FlashDec's block table)."""

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, workspace, layout, use_tensor_cores=False):
            if layout == "NHD" and not use_tensor_cores:
                raise RuntimeError("this path is not compiled")
            self.layout = layout

        def plan(self, indptr, indices, last_page_len, hq, hkv, d, page, **dtypes):
            self.meta = (indptr.tolist(), indices.tolist(), last_page_len.tolist(), hq // hkv, page)
            self.fp8 = dtypes["kv_data_type"] == bd.FP8

        def run(self, q, kv, k_scale=None, v_scale=None, out=None):
            indptr, indices, last, group, page = self.meta
            k, v = kv
            if self.layout == "NHD":
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            k, v = k.float() * (k_scale or 1.0), v.float() * (v_scale or 1.0)
            for b in range(q.shape[0]):
                ids = indices[indptr[b] : indptr[b + 1]]
                n = (len(ids) - 1) * page + last[b]
                kb = k[ids].permute(1, 0, 2, 3).reshape(k.shape[1], -1, k.shape[3])[:, :n]
                vb = v[ids].permute(1, 0, 2, 3).reshape(v.shape[1], -1, v.shape[3])[:, :n]
                kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
                p = torch.softmax(
                    q[b].float()[:, None, :] @ kb.transpose(1, 2) / q.shape[2] ** 0.5, -1
                )
                out[b] = (p @ vb)[:, 0].to(out.dtype)
            return out


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench_decode's GPU steps made runnable on the CPU: timing by one call, tiny shapes."""
    calls = []

    def fake_time(fn, calls_per_graph, warmup, rep):
        fn()
        calls.append(fn)
        return 10.0 + len(calls)

    monkeypatch.setattr(bd, "graph_us_per_call", fake_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    real_case = bd.Case
    monkeypatch.setattr(bd, "Case", lambda *a, **k: real_case(*a, **k, device="cpu"))
    return calls


class TestMeasureOnCpu:
    def args(self, *extra):
        return bd.parse_args(["--warmup", "1", "--rep", "1", "--workers", "1", *extra])

    def test_every_path_is_timed_and_checked(self, cpu_bench):
        shape = bd.Shape("tiny", "ragged", (5, 20, 9))
        mc = bd.MatrixCase("bf16", "4/2/16", 8, shape)
        ws = torch.zeros(16, dtype=torch.uint8)
        row = bd.measure(mc, self.args("--sdpa"), FakeFlashInfer, ws, CEILINGS)
        assert row["fd_us"] and row["fd_error"] is None and row["plan"]["splits"] >= 1
        assert set(row["fi_us"]) == {"HND-tc", "HND-cc", "NHD-tc", "NHD-cc"}
        assert row["fi_us"]["NHD-cc"] is None and "not compiled" in row["fi_errors"]["NHD-cc"]
        assert row["fi_best_path"] == "HND-tc" and row["ratio"] == row["fd_us"] / 12.0
        assert row["max_abs_diff_vs_fi"] < 0.05  # FlashDec and the stand-in read the same pages
        assert row["sdpa_us"] and row["max_abs_diff_vs_sdpa"] < 0.05
        assert bd.table_rows([row])[0][-1] == bd.fmt(row["sdpa_us"])

    def test_fp8_rows(self, cpu_bench):
        if bd.FP8 is None:
            pytest.skip("no float8 in this torch")
        mc = bd.MatrixCase("bf16", "4/2/16", 8, bd.Shape("tiny", "uniform", (12, 12)))
        row = bd.measure(mc, self.args("--fp8"), FakeFlashInfer, torch.zeros(1), CEILINGS)
        f8 = row["fp8"]
        assert f8["fi_best_us"] and f8["fi_error_vs_bf16"]["rel_l2"] < 0.1
        assert f8["fd_us"] and f8["fd_error"] is None and f8["speedup_vs_bf16"]
        assert f8["fd_error_vs_bf16"]["rel_l2"] < 0.1  # e4m3 rounding of K and V

    def test_fp8_api_and_launcher_agree(self):
        if bd.FP8 is None:
            pytest.skip("no float8 in this torch")
        case = bd.Case([9, 30], 4, 2, 16, 8, torch.bfloat16, device="cpu")
        plan = case.plan(kv_dtype=bd.FP8)
        api, launch = case.flashdec_fns_for(plan)
        torch.testing.assert_close(api(), launch(), atol=0, rtol=0)
        bf16 = case.flashdec_fns()[1]()
        assert bd.output_error(api(), bf16)["rel_l2"] < 0.1

    def test_merge_modes(self, cpu_bench):
        """--merge picks how a split plan merges; the launcher path merges like the API."""
        mc = bd.MatrixCase("bf16", "4/2/16", 8, bd.Shape("one", "uniform", (300,)))
        for mode, fused in (("auto", True), ("fused", True), ("separate", False)):
            row = bd.measure(mc, self.args("--merge", mode), None, None, CEILINGS)
            assert row["plan"]["splits"] > 1 and row["plan"]["fused_merge"] is fused
            assert row["fd_us"] and row["fd_error"] is None
        case = bd.Case([300], 4, 2, 16, 8, torch.bfloat16)  # on the CPU (cpu_bench)
        plan = case.plan()
        assert plan.fused_merge
        api, launch = case.flashdec_fns_for(plan)
        torch.testing.assert_close(api(), launch(), atol=0, rtol=0)
        with pytest.raises(SystemExit):
            bd.parse_args(["--merge", "both"])

    def test_run_without_flashinfer_writes_the_report(self, cpu_bench, monkeypatch, tmp_path):
        monkeypatch.setattr(bd, "copy_ceiling_tbs", lambda: 4.0)
        monkeypatch.setattr(bd, "read_ceiling_tbs", lambda: 4.2)
        skewed, uniform = bd.skew_pair(40, 8, 3)
        tiny = [bd.uniform_shape(2, 30), bd.ragged_shape(3, 50), skewed, uniform]
        monkeypatch.setattr(bd, "all_shapes", lambda seed=0: tiny)
        args = self.args("--heads", "4/2/16", "2/1/32", "--pages", "8", "--no-flashinfer")
        args.out_dir = str(tmp_path)
        assert bd.run(args) == 0
        saved = json.loads((tmp_path / "decode.json").read_text())
        assert len(saved["rows"]) == 8 and not saved["partial"]
        assert all(r["fd_us"] for r in saved["rows"])
        text = (tmp_path / "decode.md").read_text()
        assert "**MISSING** (disabled (--no-flashinfer))" in text
        assert "skewed 1x40+3x8 vs uniform 4x16" in text

    def test_budget_stops_adding_cases(self, cpu_bench, monkeypatch, tmp_path):
        monkeypatch.setattr(bd, "copy_ceiling_tbs", lambda: 4.0)
        monkeypatch.setattr(bd, "read_ceiling_tbs", lambda: 4.2)
        monkeypatch.setattr(bd, "all_shapes", lambda seed=0: [bd.uniform_shape(2, 30)])
        args = self.args("--heads", "4/2/16", "2/1/32", "--no-flashinfer", "--budget-s", "0")
        args.pages, args.out_dir = [8], str(tmp_path)
        assert bd.run(args) == 0
        saved = json.loads((tmp_path / "decode.json").read_text())
        assert saved["rows"] == [] and len(saved["skipped_budget"]) == 2

    def test_a_failing_case_is_reported_and_skipped(self, cpu_bench, monkeypatch, tmp_path):
        monkeypatch.setattr(bd, "copy_ceiling_tbs", lambda: 4.0)
        monkeypatch.setattr(bd, "read_ceiling_tbs", lambda: 4.2)
        monkeypatch.setattr(bd, "all_shapes", lambda seed=0: [bd.uniform_shape(2, 30)])
        real = bd.measure

        def measure(mc, *a):
            if mc.heads == "4/2/16":
                raise torch.cuda.OutOfMemoryError("out of memory")
            return real(mc, *a)

        monkeypatch.setattr(bd, "measure", measure)
        args = self.args("--heads", "4/2/16", "2/1/32", "--pages", "8", "--no-flashinfer")
        args.out_dir = str(tmp_path)
        assert bd.run(args) == 0
        rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
        assert "OutOfMemoryError" in rows[0]["error"] and rows[1]["fd_us"]


def test_run_in_workers_deals_jobs_to_spawned_processes():
    from benchmarks._common import run_in_workers

    assert run_in_workers(len, list(range(7)), 3, 60) == 7
    assert run_in_workers(len, list(range(5)), 2, 60, round_robin=True) == 5
    assert run_in_workers(abs, [1, 2], 2, 60) is None  # abs(list) fails: reported, not raised


def test_warm_up_compiles_small_cases_and_flashinfer_modules_in_workers(monkeypatch):
    seen = {}

    def fake_run(fn, jobs, workers, timeout, *extra, round_robin=False):
        seen.update(fn=fn, jobs=jobs, workers=workers, extra=extra, round_robin=round_robin)
        return len(jobs)

    monkeypatch.setattr(bd, "run_in_workers", fake_run)
    args = bd.parse_args(["--quick", "--workers", "4", "--fp8"])
    cases, _ = bd.build_matrix(args)
    bd.warm_up(cases, args, flashinfer=object())
    kinds = [kind for kind, _ in seen["jobs"]]
    assert kinds.count("flashinfer") == len(args.heads) + len(args.more_heads)
    small = [
        c for c in cases if bd.kv_bytes(c.shape.lens, *bd.parse_heads(c.heads)[1:], 2) <= 2**31
    ]
    assert kinds.count("case") == len(small) < len(cases)  # 2 GiB cases compile while timing
    assert seen["fn"] is bd.warm_up_worker and seen["extra"] == (0, True) and seen["round_robin"]
    seen.clear()
    bd.warm_up(cases, bd.parse_args(["--workers", "1"]), None)
    assert not seen
