"""benchmarks/bench_host_tier.py's smoke run (the host tier on and off, on the CPU), its targets
and report, and vllm_host_tier.py driven through a stand-in for vLLM (absent here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_host_tier, vllm_host_tier, vllm_prefix
from benchmarks._common import environment
from tests.test_benchmarks_prefix import FakeVllm

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_the_report(tmp_path):
    bench_host_tier.main(["--smoke", "--out-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "host_tier.json").read_text())
    args = bench_host_tier.parse_args(["--smoke"])
    assert payload["args"]["pool_tokens"] == args.pool_tokens == 128  # 8 x 64 / 4
    assert payload["reference"] is None  # no CUDA: no plain copy_ reference
    on, off = payload["rows"]
    assert (on["mode"], off["mode"]) == ("on", "off")
    for row in (on, off):
        assert row["turns"] == args.sessions * (args.rounds - 1)
        assert len(row["records"]) == args.sessions * args.rounds
        assert all(r["tokens"] == args.new and r["ttft_ms"] > 0 for r in row["records"])
        assert row["num_blocks"] == 8 and row["evicted_blocks"] > 0
        for key in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "hit_share", "queried_tokens"):
            assert row[key] is not None
        assert row["direct"] is None  # CUDA only
    # every revisited history was evicted from the GPU pool: the tier serves it, or nothing does
    assert on["host_hit_tokens"] > 0 and on["gpu_hit_tokens"] == 0
    assert on["hit_tokens"] == on["host_hit_tokens"] == args.sessions * args.history
    assert off["host_hit_tokens"] == 0 and off["hit_tokens"] == 0 and off["host"] is None
    host = on["host"]
    assert host["blocks_up"] == args.sessions * args.history // args.block_size
    assert host["bytes_up"] == host["blocks_up"] * on["host_block_bytes"]
    assert host["failed_down"] == host["failed_up"] == host["dropped_blocks"] == 0
    assert on["host_block_bytes"] == payload["kv_bytes_per_token"] * args.block_size
    goals = {g["target"]: g for g in payload["targets"]}
    assert goals["working set / GPU pool >= 4"]["met"] is True
    assert [g["met"] for g in payload["targets"][-2:]] == [None, None]  # no CUDA
    markdown = (tmp_path / "host_tier.md").read_text()
    assert "working set 8 x 64 = 512 tokens = **4.00x the pool**" in markdown
    assert "| FlashDec | on (1.56 MiB) | 8 |" in markdown and "| FlashDec | off | 8 |" in markdown
    assert "no CUDA: no reference" in markdown and "**smoke run**" in markdown
    assert (tmp_path / "host_tier.png").exists()


def test_sizes_follow_the_working_set():
    args = bench_host_tier.parse_args([])
    assert (args.sessions, args.history, args.rounds) == (16, 8192, 3)
    assert args.pool_tokens == 16 * 8192 // 4
    assert bench_host_tier.kv_bytes_per_token("llama3-8b-shape", "bf16") == 128 * 1024
    assert bench_host_tier.longest_sequence(args) == 8192 + 16 + 2 * (64 + 16)
    per_session = -(-bench_host_tier.longest_sequence(args) // 16) * 16
    assert args.host_gib == pytest.approx(16 * per_session * 128 * 1024 * 1.25 / 2**30)
    small = bench_host_tier.parse_args(["--sessions", "2"])  # a quarter of 2 histories is
    assert small.pool_tokens == (8368 // 16 + 1) * 16  # less than one request + a block
    with pytest.raises(ValueError, match="holds no longest request"):
        bench_host_tier.parse_args(["--pool-tokens", "4096"])
    with pytest.raises(ValueError, match="--rounds must be >= 2"):
        bench_host_tier.parse_args(["--rounds", "1"])


def _row(mode: str, p50: float, share: float, down=None, up=None) -> dict:
    host = None
    if mode == "on":
        host = {"down_gb_s": down, "up_gb_s": up, "dropped_blocks": 0, "capacity_blocks": 9}
        for direction in ("down", "up"):
            host.update({f"blocks_{direction}": 512, f"bytes_{direction}": 2**30})
            host.update({f"copy_{direction}_s": 0.05, f"failed_{direction}": 0})
    return {
        "mode": mode,
        "turns": 32,
        "ttft_p50_ms": p50,
        "ttft_p90_ms": 2 * p50,
        "ttft_p99_ms": 3 * p50,
        "ttft_p50_by_round_ms": [500.0, p50, p50],
        "hit_share": share,
        "gpu_hit_tokens": 0,
        "host_hit_tokens": 100 if mode == "on" else 0,
        "evicted_blocks": 10,
        "measured_wall_s": 1.0,
        "host_gib": 20.0 if mode == "on" else 0.0,
        "host_block_bytes": 2 * 2**20 if mode == "on" else None,
        "host": host,
        "direct": None,
    }


def _vllm_payload(args, config: str, p50: float) -> dict:
    summary = {"turns": 32, "ttft_p50_ms": p50, "ttft_p90_ms": p50, "ttft_p99_ms": p50}
    summary.update(hit_share=0.99, measured_wall_s=2.0, ttft_p50_by_round_ms=[400.0, p50, p50])
    return {
        "engine": "vllm",
        "version": "0.24.0",
        "gpu": "NVIDIA H100",
        "config": config,
        "offload_errors": [],
        "block_size": 16,
        "num_gpu_blocks": args.pool_tokens // 16,
        "args": vars(args),
        "records": [],
        "summary": summary,
    }


def test_targets_met_missed_and_margins(tmp_path):
    args = bench_host_tier.parse_args([])
    rows = [_row("on", 50.0, 0.95, down=20.0, up=30.0), _row("off", 140.0, 0.0)]
    reference = {"bytes": 2**30, "down_gb_s": 40.0, "up_gb_s": 35.0}
    goals = bench_host_tier.targets(args, rows, reference)
    assert [(g["met"], g["margin"]) for g in goals] == [
        (True, "+0.00x"),  # the default pool: a quarter of the working set
        (True, "+5.0 points"),
        (False, "-0.20x"),  # 140 / 50 = 2.8
        (False, "-30.0 points"),  # 20 / 40 = 50%
        (True, "+5.7 points"),  # 30 / 35 = 85.7%
    ]
    path = tmp_path / "v.json"
    config = "OffloadingConnector (CPU, cpu_bytes_to_use 20.43 GiB) + prefix caching"
    path.write_text(json.dumps(_vllm_payload(args, config, 100.0)))
    vllm = bench_host_tier.load_vllm(str(path), args)
    markdown = bench_host_tier.report(args, environment(), rows, reference, vllm)
    assert f"- vLLM 0.24.0 on NVIDIA H100: **{config}**" in markdown
    assert f"| vLLM 0.24.0 | {config} | 32 | 100.0 | 100.0 | 100.0 | 0.990 |" in markdown
    assert "| TTFT p50 tier off / on >= 3 | 2.80x (140.0 / 50.0 ms) | 3 | **MISSED** |" in markdown
    assert "3 met, 2 missed, 0 not measured." in markdown
    assert "vLLM's 100.0 ms (vLLM's / FlashDec's: 2.00x)" in markdown
    # without its offloading, vLLM's row says so, and the report says why
    error = "OffloadingConnector (...): not built: ValueError: no such connector"
    fallback = _vllm_payload(
        args, f"prefix caching only (offloading connector unavailable: {error})", 90.0
    )
    fallback.update(offloading=False, offload_errors=[error])
    markdown = bench_host_tier.report(args, environment(), rows, reference, fallback)
    assert "- vLLM 0.24.0 on NVIDIA H100: **prefix caching only**;" in markdown
    assert f"  - offloading tried, failed: {error}" in markdown
    assert "| vLLM 0.24.0 | prefix caching only | 32 | 90.0 |" in markdown
    # a vLLM run of another trace is refused before anything runs
    other = bench_host_tier.parse_args(["--sessions", "32"])
    path.write_text(json.dumps(_vllm_payload(other, config, 100.0)))
    with pytest.raises(ValueError, match="sessions: ours 16, vLLM's 32; pool_tokens"):
        bench_host_tier.load_vllm(str(path), args)
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=r"not vllm_host_tier\.py's --json output"):
        bench_host_tier.load_vllm(str(path), args)


def test_vllm_serves_the_same_trace():
    """Importing vllm_host_tier does not import vLLM; the same flags give the same trace and
    sizes; its measure() drives vLLM's engine (a stand-in) turn by turn like FlashDec's."""
    ours = bench_host_tier.parse_args(["--smoke"])
    flags = ["--model", "tiny", "--dtype", "fp32", "--history", "64", "--sessions", "8"]
    theirs = vllm_host_tier.parse_args(
        [*flags, "--rounds", "2", "--turn-tokens", "8", "--new", "2"]
    )
    assert "vllm" not in sys.modules
    assert {k: vars(ours)[k] for k in bench_host_tier.TRACE_ARGS} == {
        k: vars(theirs)[k] for k in bench_host_tier.TRACE_ARGS
    }
    engine_args = vllm_host_tier.base_engine_args(theirs)
    assert engine_args["num_gpu_blocks_override"] == 8 and engine_args["block_size"] == 16
    assert engine_args["enable_prefix_caching"] and engine_args["max_model_len"] == 76 + 64
    forms = [d for d, _ in vllm_host_tier.offload_attempts(theirs)]
    assert forms[0].startswith("OffloadingConnector (CPU, cpu_bytes_to_use")
    requests = vllm_prefix.VllmRequests(FakeVllm(), sampling_params=SimpleNamespace)
    result = vllm_host_tier.measure(requests, theirs, 512)
    records, summary = result["records"], result["summary"]
    assert [(r["round"], r["session"]) for r in records] == [
        (rnd, s) for rnd in range(2) for s in range(8)
    ]
    assert [r["prompt_tokens"] for r in records] == [64] * 8 + [64 + 2 + 8] * 8
    # the stand-in caches finished prompts: a revisited session hits its 64-token history
    assert all(r["hit_tokens"] == 64 for r in records[8:])
    assert summary["turns"] == 8 and summary["hit_share"] == pytest.approx(64 / 74)
    assert not requests._timing  # every request released


def test_vllm_script_help_runs_without_vllm():
    done = subprocess.run(
        [sys.executable, "benchmarks/vllm_host_tier.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "OffloadingConnector" in done.stdout and "--offload" in done.stdout


def _fake_vllm(monkeypatch, accepts):
    """A stand-in ``vllm`` package whose LLM builds only when ``accepts(engine_args)``."""
    built = []

    class LLM:
        def __init__(self, model, skip_tokenizer_init, **engine_args):
            if not accepts(engine_args):
                raise ValueError("this form is not supported")
            built.append(engine_args)

    class KVTransferConfig(SimpleNamespace):
        pass

    parallel_state = SimpleNamespace(
        destroy_model_parallel=lambda: None, destroy_distributed_environment=lambda: None
    )
    modules = {
        "vllm": SimpleNamespace(LLM=LLM, __version__="0.24.0"),
        "vllm.config": SimpleNamespace(KVTransferConfig=KVTransferConfig),
        "vllm.distributed": SimpleNamespace(parallel_state=parallel_state),
        "vllm.distributed.parallel_state": parallel_state,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return built


def _extra(engine_args) -> dict:
    config = engine_args.get("kv_transfer_config")
    return {} if config is None else config.kv_connector_extra_config


def test_vllm_offloading_forms_fall_back_in_order(monkeypatch):
    args = vllm_host_tier.parse_args([])
    # the newest form fails, the 0.11-era one builds
    built = _fake_vllm(monkeypatch, lambda kw: "num_cpu_blocks" in _extra(kw))
    errors = []
    attempts = vllm_host_tier.offload_attempts(args)
    _, description, engine_args = vllm_host_tier.build_llm(args, attempts, errors)
    assert description.startswith("OffloadingConnector (CPU, num_cpu_blocks ")
    assert len(attempts) == 1 and len(built) == 1  # the native form is left untried
    assert errors == [
        "OffloadingConnector (CPU, cpu_bytes_to_use 20.43 GiB) + prefix caching: not built: "
        "ValueError: this form is not supported"
    ]
    extra = _extra(engine_args)
    block_bytes = 128 * 1024 * 16  # Llama-3-8B bf16: 128 KiB per token
    assert extra == {"num_cpu_blocks": int(args.host_gib * 2**30) // block_bytes, "block_size": 16}
    assert engine_args["kv_transfer_config"].kv_connector == "OffloadingConnector"
    # nothing builds with offloading: prefix caching alone, and why
    _fake_vllm(monkeypatch, lambda kw: not _extra(kw) and "kv_offloading_size" not in kw)
    errors = []
    _, description, engine_args = vllm_host_tier.build_llm(
        args, vllm_host_tier.offload_attempts(args), errors
    )
    assert len(errors) == 3 and "kv_transfer_config" not in engine_args
    assert description == (
        "prefix caching only (offloading connector unavailable: " + "; ".join(errors) + ")"
    )
    assert engine_args["num_gpu_blocks_override"] == args.pool_tokens // 16
    _, description, _ = vllm_host_tier.build_llm(args, [], [])  # --offload off
    assert description == "prefix caching only (--offload off)"
