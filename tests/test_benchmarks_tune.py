"""benchmarks/tune_decode.py without a GPU: the grid it sweeps, the order it times in, plans it
builds, and the report rendered from fake timings."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_decode as bd
from benchmarks import tune_decode as td


def test_weak_shapes_are_those_of_issue_10():
    keys = {td.shape_key(h, s, 16) for h, s in td.WEAK_SHAPES}
    for want in [
        "32/8/128 p16 B=1024 L=17",
        "28/4/128 p16 B=48 L=3000",
        "28/4/128 p16 ragged 48x1..12345",
        "16/8/256 p16 B=1 L=32768",
        "16/8/256 p16 B=32 L=4096",
        "32/1/128 p16 B=1 L=32768",
        "32/1/128 p16 B=32 L=4096",
        "32/8/128 p16 skewed 1x32768+63x1024",
    ]:
        assert want in keys
    assert all(s.max_len <= 64 for h, s in td.WEAK_SHAPES if s.kind == "short")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tile_grid_fits_shared_memory_and_pairs_warps_with_tiles(head_dim):
    grid = td.tile_grid(head_dim, 2)
    assert grid and len({tuple(t.values()) for t in grid}) == len(grid)
    block_d = max(16, head_dim)
    for t in grid:
        assert t["num_stages"] * t["block_n"] * block_d * 2 * 2 <= td.MAX_STAGE_BYTES
        assert not (t["num_warps"] == 2 and t["block_n"] * block_d > 4096)
        assert not (t["num_warps"] == 8 and t["block_n"] * block_d < 4096)
    assert all(t["num_stages"] > 1 for t in grid)  # long (or unknown) contexts: pipelined
    one_stage = {
        t["block_n"] for t in td.tile_grid(head_dim, 2, max_len=40) if t["num_stages"] == 1
    }
    assert one_stage >= {t["block_n"] for t in grid} - {16} and 16 not in one_stage  # 40 > 2 x 16
    # the defaults of decode_plan for this head_dim are in the grid
    from flashdec.kernels.decode_plan import default_kernel_config

    for load in (0.0, 4.0, 8.0):
        cfg = default_kernel_config(head_dim, torch.bfloat16, programs_per_sm=load)
        if cfg.num_stages * cfg.block_n * block_d * 4 <= td.MAX_STAGE_BYTES:
            assert (
                dict(block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                in grid
            )


def test_fp8_tiles_go_wider():
    bf16, fp8 = td.tile_grid(128, 2), td.tile_grid(128, 1)
    assert max(t["block_n"] for t in fp8) == 256 > max(t["block_n"] for t in bf16)
    assert len(fp8) > len(bf16)
    assert all(h in bd.HEAD_CONFIGS for h, _ in td.FP8_SHAPES)


def test_split_specs_target_items_per_sm():
    assert td.split_specs(bd.uniform_shape(1024, 17), 8, 132) == []  # too short to split
    specs = td.split_specs(bd.uniform_shape(1, 32768), 1, 132)
    counts = [n for kind, n in specs if kind == "splits"]
    assert counts == sorted(set(counts)) and counts[0] == 1 and max(counts) <= 1024
    assert 132 in counts and 264 in counts and ("pps", 4) in specs
    short = td.split_specs(bd.uniform_shape(2, 40), 1, 132)
    assert max(n for kind, n in short if kind == "splits") == 40 // td.MIN_SPLIT_TOKENS
    assert td.program_specs(300, 132) == [("programs", 132), ("programs", 264)]


def test_shape_matching():
    shape = bd.uniform_shape(48, 3000)
    assert td.shape_matches("B=48", "28/4/128", shape)
    assert td.shape_matches("28/4/128@B=48 L=3000", "28/4/128", shape)
    assert not td.shape_matches("32/8/128@B=48", "28/4/128", shape)
    assert td.shape_matches("uniform", "28/4/128", shape)
    assert not td.shape_matches("ragged", "28/4/128", shape)


def test_grid_is_timed_round_robin_over_shapes():
    a, b = bd.uniform_shape(1, 64), bd.uniform_shape(2, 64)
    grid = [("1/1/16", a, ("auto", 0), {"block_n": n}) for n in (16, 32, 64)]
    grid += [("1/1/16", b, ("auto", 0), {"block_n": n}) for n in (16, 32)]
    assert td.grid_tiles(grid) == [0, 3, 1, 4, 2]


def test_make_plan_applies_every_knob():
    case = bd.Case([40, 200], 4, 2, 16, 8, torch.float32, device="cpu")
    tile = {"block_n": 32, "num_warps": 2, "num_stages": 3}
    plan = td.make_plan(case, ("splits", 4), tile)
    assert (plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits) == (32, 2, 3, 4)
    split = bd.Case([300], 4, 1, 16, 8, torch.float32, device="cpu")
    base = td.make_plan(split, ("auto", 0), {"block_n": 16})
    shrunk = td.make_plan(split, ("programs", 1), {"block_n": 16})
    assert base.uses_split and base.num_programs > 1 and shrunk.num_programs == 1
    _, launch = split.flashdec_fns_for(shrunk)  # one program loops over every work item
    torch.testing.assert_close(launch(), split.sdpa_fn()(), atol=2e-3, rtol=2e-3)
    short = bd.Case([5, 7, 3], 4, 2, 16, 8, torch.float32, device="cpu")
    persist = td.make_plan(short, ("persist", 1), {"block_n": 16})
    assert persist.uses_split and persist.num_programs == 1
    assert persist.tokens_per_split >= short.max_len  # one split per request: no merge work
    _, launch = short.flashdec_fns_for(persist)
    torch.testing.assert_close(launch(), short.sdpa_fn()(), atol=2e-3, rtol=2e-3)
    assert td.persist_specs(bd.uniform_shape(1024, 17), 8, 132)[0] == ("persist", 528)
    assert td.persist_specs(bd.uniform_shape(8, 17), 8, 132) == []
    assert td.spec_of({"split": "splits=4"}) == ("splits", 4)
    assert td.spec_of({"split": td.spec_label(("auto", 0))}) == ("auto", 0)


def fake_payload():
    def row(shape, phase, us, bn=64, split="auto", splits=1, programs=None, error=None):
        r = {"shape": shape, "phase": phase, "split": split, "block_n": bn, "num_warps": 4}
        r.update(num_stages=3, splits=splits, programs=programs, us=us)
        if us:
            r["pct_copy"], r["max_diff_vs_default"] = 50.0, 0.001
        if error:
            r["error"] = error
        return r

    a, b = "32/8/128 p16 B=1024 L=17", "32/1/128 p16 B=1 L=32768"
    results = [
        row(a, "default", 60.0),
        row(a, "tile", 45.0, bn=32),
        row(a, "tile", 50.0, bn=16),
        row(b, "default", 30.0, splits=256, programs=256),
        row(b, "split", 20.0, split="splits=132", splits=132, programs=132),
        row(b, "tile", 18.0, bn=32, split="splits=132", splits=132, programs=132),
        row(b, "tile", None, bn=16, error="OutOfResources: shared memory"),
        row(b, "tile", 19.0, bn=16),
    ]
    return {
        "environment": {
            "command": "python3 benchmarks/tune_decode.py",
            "commit": "abc",
            "date_utc": "2026-11-30",
            "gpu": None,
            "python": "3.12",
            "torch": "2.11",
            "cuda": "13.0",
            "triton": "3.6.0",
            "flashinfer": None,
        },
        "args": vars(td.parse_args([])),
        "num_sms": 132,
        "flashinfer_error": None,
        "flashinfer": {
            a: {"best_us": 50.0, "best_path": "HND-tc"},
            b: {"best_us": None, "errors": {"HND-tc": "x"}},
        },
        "shapes": [{"key": a, "kv_mib": 68.0}, {"key": b, "kv_mib": 16.0}],
        "results": results,
        "elapsed_s": 12.0,
    }


def test_report_compares_best_default_and_flashinfer():
    text = td.render(fake_payload())
    line_a = next(x for x in text.splitlines() if x.startswith("| 32/8/128 p16 B=1024 L=17"))
    cells = [c.strip() for c in line_a.strip("|").split("|")]
    assert cells[2] == "60.0" and cells[4] == "45.0" and cells[6].startswith("bn 32 w4 s3 auto")
    assert cells[7] == "1.33" and cells[8] == "50.0 (HND-tc)"
    assert cells[9] == "1.200" and cells[10] == "0.900" and cells[11] == "—" and cells[12] == "3"
    line_b = next(x for x in text.splitlines() if x.startswith("| 32/1/128"))
    assert "splits=132 (132 splits, 132 programs)" in line_b and "— (—)" in line_b
    assert "1 configurations failed" in text and "OutOfResources" in text
    # bn 16 / bn 32 ran on both shapes: ranked by geomean of time / the shape's best tile
    ranking = [x for x in text.splitlines() if x.startswith("| 32 | 4 | 3")]
    assert ranking and "1.000" in ranking[0]
    json.dumps(fake_payload())  # what write_results stores


def test_args():
    args = td.parse_args(["--shapes", "B=1", "--budget-s", "30"])
    assert args.shapes == ["B=1"] and args.budget_s == 30 and args.workers >= 1
    assert td.parse_args([]).budget_s <= 220  # with start-up, under four minutes
    with pytest.raises(SystemExit):
        td.parse_args(["--calls", "0"])


@pytest.fixture
def cpu_sweep(monkeypatch):
    from tests.test_benchmarks_decode import FakeFlashInfer

    clock = iter(range(1000, 100000))
    monkeypatch.setattr(bd, "graph_us_per_call", lambda fn, *a: (fn(), float(next(clock)))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    props = type("Props", (), {"multi_processor_count": 4})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    real_case = bd.Case
    monkeypatch.setattr(td, "Case", lambda *a, **k: real_case(*a, **k, device="cpu"))
    monkeypatch.setattr(td, "load_flashinfer", lambda: (FakeFlashInfer, None))
    monkeypatch.setattr(td, "flashinfer_workspace", lambda: torch.zeros(1))
    monkeypatch.setattr(td, "BLOCK_N", (16, 32))
    monkeypatch.setattr(td, "WARPS", (4,))
    monkeypatch.setattr(td, "STAGES", (2,))


def test_fp8_run_on_the_cpu_with_stand_ins(cpu_sweep, monkeypatch, tmp_path):
    if bd.FP8 is None:
        pytest.skip("no float8 in this torch")
    monkeypatch.setattr(td, "FP8_SHAPES", [("4/2/16", bd.uniform_shape(2, 130))])
    args = td.parse_args(["--fp8", "--page", "8", "--workers", "1", "--out-dir", str(tmp_path)])
    assert td.run(args) == 0
    saved = json.loads((tmp_path / "decode_tuning.json").read_text())
    assert not [r for r in saved["results"] if r.get("error")]
    assert [r["block_n"] for r in saved["results"] if r["phase"] == "tile"] == [16, 32, 256]
    assert (
        saved["shapes"][0]["bf16_default_us"]
        and saved["shapes"][0]["kv_mib"]
        == 260 * 2 * 16 * 2 / 2**20  # tokens x Hkv x D x (K, V) x 1 byte
    )
    assert saved["flashinfer"]["4/2/16 p8 B=2 L=130"]["best_path"] == "HND-tc"
    text = (tmp_path / "decode_tuning.md").read_text()
    assert "FP8 e4m3 KV" in text and "bf16 / best" in text
    # phase 1b: every FP8 kernel variant once, after the default (which runs the plan's own)
    rows = saved["results"]
    assert [td.fp8_of(r) for r in rows if r["phase"] == "fp8"] == td.FP8_VARIANTS
    default = next(r for r in rows if r["phase"] == "default")
    assert td.fp8_of(default) == {
        "fp8_compute": td.DEFAULT_FP8_COMPUTE,
        "fp8_staging": td.DEFAULT_FP8_STAGING,
        "fp8_tile": td.DEFAULT_FP8_TILE,
    }
    assert default not in td.FP8_VARIANTS and len(td.FP8_VARIANTS) == 7
    fp8_rows = [r for r in rows if r["phase"] in ("default", "fp8")]
    tokens = {r["block_n"] for r in fp8_rows if r["fp8_tile"] == "tokens"}
    assert {r["block_n"] for r in fp8_rows if r["fp8_tile"] == "bytes"} == {2 * min(tokens)}
    # later phases keep the best variant (the tile grid sets block_n itself)
    best = min((r for r in rows if r["phase"] in ("default", "fp8")), key=lambda r: r["us"])
    for r in rows:
        if r["phase"] in ("split", "tile"):
            assert td.fp8_of(r, with_tile=False) == td.fp8_of(best, with_tile=False)
    assert "## FP8 kernel variants" in text and "| q/none |" in text


def test_run_on_the_cpu_with_stand_ins(cpu_sweep, monkeypatch, tmp_path):
    """The sweep's control flow, timings faked: every phase runs, every output is compared with
    the default's, and the report names the best configuration against FlashInfer's."""
    shapes = [("4/2/16", bd.uniform_shape(3, 20)), ("4/1/16", bd.ragged_shape(2, 70))]
    monkeypatch.setattr(td, "WEAK_SHAPES", shapes)
    args = td.parse_args(["--page", "8", "--workers", "1", "--out-dir", str(tmp_path)])
    assert td.run(args) == 0
    saved = json.loads((tmp_path / "decode_tuning.json").read_text())
    phases = [r["phase"] for r in saved["results"]]
    assert phases.count("default") == 2 and phases.count("tile") == 4 and "split" in phases
    assert not [r for r in saved["results"] if r.get("error")]
    assert max(r["max_diff_vs_default"] for r in saved["results"]) < 0.05
    assert saved["flashinfer"]["4/2/16 p8 B=3 L=20"]["best_path"] == "HND-tc"
    lines = (tmp_path / "decode_tuning.jsonl").read_text().splitlines()
    assert len(lines) == len(saved["results"])
    text = (tmp_path / "decode_tuning.md").read_text()
    assert "| 4/1/16 p8 ragged 2x1..70 |" in text


def test_plan_facts_explain_the_weak_shapes(capsys):
    """--plans needs no GPU: the CPU plans use the H200's SM count."""
    facts = {td.shape_key(h, s, 16): td.plan_facts(h, s, 16) for h, s in td.WEAK_SHAPES}
    group7 = facts["28/4/128 p16 B=48 L=3000"]
    assert not group7["split"] and group7["items"] == 192
    assert group7["wave_ratio"] == pytest.approx(2 / (192 / 132))  # some SMs run 2 programs
    mqa = facts["32/1/128 p16 B=1 L=32768"]
    # 256 splits of 128 tokens: 32 heads x 129 floats x 2 (written, read) per split = 50% of KV
    assert mqa["splits"] * mqa["tokens_per_split"] >= 32768
    assert mqa["partial_traffic"] == pytest.approx(256 * 32 * 129 * 4 * 2 / (32768 * 128 * 4))
    skew = facts["32/8/128 p16 skewed 1x32768+63x1024"]
    assert skew["split"] and skew["items"] < skew["programs"]  # programs that find no item
    assert all(f["largest_item_vs_sm_share"] > 0 for f in facts.values())
    assert td.main(["--plans", "--shapes", "short"]) == 0
    out = capsys.readouterr().out
    assert "| 32/8/128 p16 B=1024 L=17 | no |" in out and "B=48" not in out
    if bd.FP8 is not None:
        f8 = td.plan_facts("32/8/128", bd.uniform_shape(32, 4096), 16, bd.FP8)
        assert f8["items"] == 256
        assert f8["fp8"] == f"{td.DEFAULT_FP8_COMPUTE}/{td.DEFAULT_FP8_STAGING}"
        assert group7["fp8"] == "—"
