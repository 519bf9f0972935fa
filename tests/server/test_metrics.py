"""``GET /metrics``: valid Prometheus text (every sample declared, histogram buckets cumulative
and ending at the count), counting requests, tokens, KV blocks, the LLM's prefix-cache
lookups (``prefix_cache_stats``) and its speculation counters."""

from __future__ import annotations

import re

import pytest

from flashdec.server.metrics import Histogram
from tests.server.conftest import make_llm, metric

httpx = pytest.importorskip("httpx")

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+=\"[^\"]*\"\})? (\S+)$")


def _parse(text: str) -> dict[str, str]:
    """Family name -> type; asserts every sample line is well formed and declared first."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE.match(line)
        assert match, line
        name = match.group(1)
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or (family in types and types[family] == "histogram"), line
        float(match.group(3))
    return types


def _buckets(text: str, family: str) -> list[float]:
    return [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(family + "_bucket")
    ]


def test_histogram_buckets_are_cumulative():
    hist = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    lines = hist.lines("x")
    assert lines[:3] == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4']
    assert lines[3:] == [f"x_sum {0.05 + 0.1 + 0.5 + 3.0!r}", "x_count 4"]


def test_metrics_endpoint(server_for):
    llm = make_llm(tokenizer=False)  # token-id prompts: a faster front-end start
    server = server_for(llm)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for n in (3, 5):
            body = {"prompt": [9, 10, 11, 12], "max_tokens": n, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json={"prompt": 1}).status_code == 400
        response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    types = _parse(text)
    assert types["flashdec_time_to_first_token_seconds"] == "histogram"
    assert types["flashdec_kv_blocks_used"] == "gauge"
    assert metric(text, "flashdec_requests_received_total") == 2
    assert metric(text, "flashdec_requests_rejected_total") == 1
    assert metric(text, "flashdec_generation_tokens_total") == 8
    assert metric(text, "flashdec_prompt_tokens_total") == 8
    assert metric(text, "flashdec_kv_blocks_total") == llm.engine.cache.metrics()["num_blocks"]
    for family, count in (("time_to_first_token", 2), ("time_per_output_token", 2)):
        buckets = _buckets(text, f"flashdec_{family}_seconds")
        assert buckets == sorted(buckets) and buckets[-1] == count
    # the LLM's prefix cache: both 4-token prompts looked up; a 4-token prompt holds no full
    # 16-token block, so nothing can hit
    assert metric(text, "flashdec_prefix_cache_queried_tokens_total") == 8
    assert metric(text, "flashdec_prefix_cache_hit_tokens_total") == 0


def test_prefix_cache_families_when_the_llm_has_one(server_for):
    llm = make_llm(tokenizer=False)  # token-id prompts: a faster front-end start
    llm.prefix_cache_stats = lambda: {"queried_tokens": 40, "hit_tokens": 16}  # SPEC §8.7's
    server = server_for(llm)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    _parse(text)
    assert metric(text, "flashdec_prefix_cache_queried_tokens_total") == 40
    assert metric(text, "flashdec_prefix_cache_hit_tokens_total") == 16
    assert "speculative" not in text  # speculation is off


def test_host_tier_families_when_the_llm_has_one(server_for):
    llm = make_llm(tokenizer=False, host_kv_cache_gib=0.001)
    real = llm.prefix_cache_stats()
    assert real["host"]["capacity_blocks"] > 0
    host = {key: 0 for key in real["host"]}
    host.update(capacity_blocks=real["host"]["capacity_blocks"], cached_blocks=7)
    host.update(blocks_down=9, bytes_down=9 * 4096, copy_down_s=0.25, failed_down=1)
    host.update(blocks_up=3, bytes_up=3 * 4096, copy_up_s=0.125, failed_up=2)
    llm.prefix_cache_stats = lambda: {**real, "hit_tokens": 64, "host_hit_tokens": 48, "host": host}
    server = server_for(llm)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    types = _parse(text)
    assert types["flashdec_host_kv_blocks_cached"] == "gauge"
    assert types["flashdec_host_kv_copy_up_bytes_total"] == "counter"
    assert metric(text, "flashdec_prefix_cache_host_hit_tokens_total") == 48
    assert metric(text, "flashdec_host_kv_blocks_total") == real["host"]["capacity_blocks"]
    assert metric(text, "flashdec_host_kv_blocks_cached") == 7
    assert metric(text, "flashdec_host_kv_copy_down_blocks_total") == 9
    assert metric(text, "flashdec_host_kv_copy_down_bytes_total") == 9 * 4096
    assert metric(text, "flashdec_host_kv_copy_down_seconds_total") == 0.25
    assert metric(text, "flashdec_host_kv_copy_up_failures_total") == 2
    assert metric(text, "flashdec_host_kv_copy_up_seconds_total") == 0.125
    assert types["flashdec_requests_swapped_total"] == "counter"  # preemption by swap is on
    assert metric(text, "flashdec_requests_swapped_total") == 0


def test_no_host_tier_family_without_one(server_for):
    text = httpx.get(server_for(make_llm(tokenizer=False)).url + "/metrics", timeout=30).text
    assert "prefix_cache_hit" in text and "host_kv" not in text and "swapped" not in text


def test_no_prefix_cache_family_without_one(server_for):
    server = server_for(make_llm(tokenizer=False, enable_prefix_caching=False))
    text = httpx.get(server.url + "/metrics", timeout=30).text
    _parse(text)
    assert "prefix_cache" not in text


def test_speculation_families_count_the_llms_drafts(server_for):
    """With speculation on the server exports the drafts verified and accepted: the LLM's own
    counters. (A tiny random model seldom repeats its context, so the drafter here always
    proposes; verification keeps the output exact either way.)"""
    from flashdec.speculative import SpeculativeConfig

    llm = make_llm(tokenizer=False, speculative=SpeculativeConfig(method="ngram", num_tokens=3))
    llm._runner.drafter.propose = lambda rid, prompt, tokens, k, tail=(): [5, 6, 7][:k]
    server = server_for(llm)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": [5, 6, 7, 8] * 6, "max_tokens": 12, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    _parse(text)
    counts = llm.speculative_counters()
    assert counts["draft_tokens"] > 0
    assert metric(text, "flashdec_speculative_draft_tokens_total") == counts["draft_tokens"]
    assert metric(text, "flashdec_speculative_accepted_tokens_total") == counts["accepted_tokens"]
