"""The bench-serve trace: the same arrivals as the review's serve_trace.py, seeded and exact."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from flashdec.workloads.serving import poisson_trace

# ../shared beside the project's clone (a worktree sits one level deeper)
_SERVE_TRACE = next(
    (
        p / "shared/tools/serve/serve_trace.py"
        for p in Path(__file__).resolve().parents
        if (p / "shared/tools/serve/serve_trace.py").exists()
    ),
    None,
)


def test_the_trace_is_seeded_poisson_with_prompts_in_range():
    knobs = dict(num_requests=50, request_rate=20.0, min_prompt_len=3, max_prompt_len=9)
    trace = poisson_trace(seed=0, vocab_size=100, **knobs)
    assert trace == poisson_trace(seed=0, vocab_size=100, **knobs)  # deterministic
    times = [t for t, _ in trace]
    assert times == sorted(times) and times[0] > 0
    assert all(3 <= len(p) <= 9 and all(0 <= i < 100 for i in p) for _, p in trace)
    assert 1.0 < times[-1] < 5.0  # 50 arrivals at 20/s: ~2.5 s
    assert poisson_trace(seed=1, vocab_size=100, **knobs) != trace


@pytest.mark.skipif(_SERVE_TRACE is None, reason="../shared/tools/serve/serve_trace.py not here")
def test_the_trace_is_serve_traces():
    spec = importlib.util.spec_from_file_location("serve_trace", _SERVE_TRACE)
    serve_trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_trace)
    a = argparse.Namespace(seed=3, requests=6, min_prompt=4, max_prompt=9)
    ours = poisson_trace(
        seed=3,
        num_requests=6,
        request_rate=16.0,
        min_prompt_len=4,
        max_prompt_len=9,
        vocab_size=serve_trace.VOCAB,
    )
    assert ours == serve_trace.trace(a, 16.0)


def test_the_model_knobs_reach_the_llm():
    from flashdec.workloads.generation import load_llm
    from flashdec.workloads.model_config import ServeConfig

    config = ServeConfig(device="cpu", max_num_batched_tokens=16, prefix_caching=False)
    llm = load_llm(config)
    assert llm.max_num_batched_tokens == 16 and llm.loop.max_step_tokens == 16
    assert llm.prefix_cache_stats()["enabled"] is False
    assert load_llm(ServeConfig(device="cpu")).prefix_cache_stats()["enabled"] is True
