"""benchmarks/bench_serve.py on the tiny model: both passes complete, and the report, its JSON
and the vLLM comparison columns come out."""

from __future__ import annotations

import json

from benchmarks import bench_serve


def test_smoke_run_writes_the_report_with_a_peer(tmp_path):
    peer = {
        "engine": "vllm",
        "version": "0.24.0",
        "passes": [
            {
                "rate": 50.0,
                "pass_": p,
                "ttft_p50_ms": 10.0,
                "ttft_p99_ms": 20.0,
                "tpot_p50_ms": 5.0,
                "tpot_p99_ms": 6.0,
                "output_tok_s": 100.0,
            }
            for p in range(2)
        ],
    }
    (tmp_path / "vllm.json").write_text(json.dumps(peer))
    bench_serve.main(
        ["--smoke", "--out-dir", str(tmp_path), "--vllm-json", str(tmp_path / "vllm.json")]
    )
    payload = json.loads((tmp_path / "serve.json").read_text())
    rows = payload["rows"]
    assert [(r["rate"], r["pass_"]) for r in rows] == [(50.0, 0), (50.0, 1)]
    assert all(r["all_done"] and r["output_tokens"] == 8 * 8 for r in rows)
    markdown = (tmp_path / "serve.md").read_text()
    assert "| 50.0 | 2 | vLLM |" in markdown and "FlashDec / vLLM, warm pass" in markdown
    assert "Incomplete runs: none." in markdown


def test_the_step_token_budget_is_passed_and_reported(tmp_path):
    """--max-num-batched-tokens reaches flashdec.LLM (the budget a sweep compares) and the report
    names it; without it the LLM's default is reported."""
    bench_serve.main(["--smoke", "--out-dir", str(tmp_path), "--max-num-batched-tokens", "40"])
    payload = json.loads((tmp_path / "serve.json").read_text())
    assert payload["construction"]["budget"] == 40
    assert all(r["all_done"] for r in payload["rows"])
    assert "step token budget (`max_num_batched_tokens`) 40" in (tmp_path / "serve.md").read_text()
