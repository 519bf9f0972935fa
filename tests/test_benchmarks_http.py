"""benchmarks/bench_http.py on the tiny model: its trace is serve_trace.py's, and one small trace
replays through ``LLM.step`` and over HTTP (a client process) with every request complete."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from benchmarks import bench_http as bh


def test_the_trace_is_serve_traces():
    sys.path.insert(0, str(bh.SERVE_TRACE))
    try:
        serve_trace = pytest.importorskip("serve_trace")
    finally:
        sys.path.pop(0)
    a = argparse.Namespace(seed=3, requests=5, min_prompt=4, max_prompt=9)
    ours = bh.make_trace(3, 5, 4, 9, 16.0, serve_trace.VOCAB)
    assert ours == serve_trace.trace(a, 16.0)
    assert bh.pct([0.001, 0.002, 0.003], 50) == pytest.approx(2.0)


def test_a_small_trace_both_ways():
    import flashdec
    from flashdec.models import build_random_model
    from flashdec.server import start_server

    model = build_random_model("tiny", dtype=torch.float32, device="cpu", seed=0)
    llm = flashdec.LLM(model, max_batch_size=8, max_model_len=64)
    trace = bh.make_trace(0, 4, 4, 12, 50.0, model.config.vocab_size)
    inproc = bh.run_in_process(llm, trace, 4)
    with start_server(llm) as server:
        http = bh.run_over_http(server.url, trace, 4)
    for result in (inproc, http):
        assert result["requests_done"] == 4 and result["output_tok_s"] > 0
        assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0
