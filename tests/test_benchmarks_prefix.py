"""benchmarks/bench_prefix.py's smoke run: both traces, caching on and off, on the CPU."""

from __future__ import annotations

import json

from benchmarks import bench_prefix


def test_smoke_run_writes_the_report(tmp_path):
    bench_prefix.main(["--smoke", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "prefix_cache.json").read_text())["rows"]
    assert [(r["trace"], r["caching"]) for r in rows] == [
        ("system", True),
        ("chat", True),
        ("system", False),
        ("chat", False),
    ]
    args = bench_prefix.parse_args(["--smoke"])
    for r in rows:  # every request ran to its last token
        assert r["output_tokens"] == r["requests"] * args.new
        assert all(rec["tokens"] == args.new for rec in r["records"])
    assert rows[0]["requests"] == args.requests
    assert rows[1]["requests"] == args.conversations * args.turns
    on_system, on_chat, off_system, off_chat = rows
    # the 40-token system prompt's two full blocks are there to hit (how many requests do
    # depends on the arrivals' wall clock: all of them, where a batch computes them at once)
    assert on_system["hit_tokens"] > 0 and 0 < on_system["prefix_hit_share"] <= 1.0
    assert on_chat["hit_tokens"] > 0 and sorted(r["turn"] for r in on_chat["records"]) == [
        0,
        0,
        1,
        1,
    ]
    assert off_system["hit_tokens"] == off_chat["hit_tokens"] == 0
    markdown = (tmp_path / "prefix_cache.md").read_text()
    assert "| system | 200.0 | on |" in markdown and "TTFT p50 (ms) per chat turn" in markdown
