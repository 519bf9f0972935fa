"""benchmarks/bench_prefix.py's smoke run: every trace, caching on and off, on the CPU."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from benchmarks import bench_prefix, vllm_prefix
from benchmarks._common import environment
from flashdec.models import BUILTIN_SHAPES


def test_smoke_run_writes_the_report(tmp_path):
    bench_prefix.main(["--smoke", "--out-dir", str(tmp_path)])
    rows = json.loads((tmp_path / "prefix_cache.json").read_text())["rows"]
    assert [(r["trace"], r["caching"]) for r in rows] == [
        ("system", True),
        ("chat", True),
        ("plain", True),
        ("system", False),
        ("chat", False),
        ("plain", False),
    ]
    args = bench_prefix.parse_args(["--smoke"])
    for r in rows:  # every request ran to its last token
        new = args.plain_new if r["trace"] == "plain" else args.new
        assert r["output_tokens"] == r["requests"] * new
        assert all(rec["tokens"] == new for rec in r["records"])
    assert rows[0]["requests"] == args.requests
    assert rows[1]["requests"] == args.conversations * args.turns
    assert rows[2]["requests"] == args.plain_requests
    on_system, on_chat, on_plain, off_system, off_chat, off_plain = rows
    # the 40-token system prompt's two full blocks are there to hit (how many requests do
    # depends on the arrivals' wall clock: all of them, where a batch computes them at once)
    assert on_system["hit_tokens"] > 0 and 0 < on_system["prefix_hit_share"] <= 1.0
    assert on_chat["hit_tokens"] > 0 and sorted(r["turn"] for r in on_chat["records"]) == [
        0,
        0,
        1,
        1,
    ]
    assert off_system["hit_tokens"] == off_chat["hit_tokens"] == off_plain["hit_tokens"] == 0
    # the plain trace's prompts are all looked up (caching on), and nothing of them hits
    vocab = BUILTIN_SHAPES["tiny"].config["vocab_size"]
    plain = bench_prefix.plain_trace(args, vocab, 200.0, args.seed)
    assert on_plain["queried_tokens"] == sum(len(p) for _, _, p in plain)
    assert on_plain["hit_tokens"] == off_plain["queried_tokens"] == 0
    markdown = (tmp_path / "prefix_cache.md").read_text()
    assert "| system | 200.0 | on |" in markdown and "TTFT p50 (ms) per chat turn" in markdown
    assert "zero hits: output tok/s >= 98% of caching off" in markdown


def test_plain_trace_is_serve_trace_and_passes_differ_per_rate():
    """The plain trace is serve_trace.py's (flashdec.workloads' copy of it); the system prompt
    differs per rate, so an engine reused across passes holds none of a pass's own prefix."""
    from flashdec.workloads.serving import poisson_trace

    args = bench_prefix.parse_args([*ARGV, "--plain-requests", "6"])
    plain = bench_prefix.plain_trace(args, 512, 16.0, 7)
    expected = poisson_trace(
        seed=7,
        num_requests=6,
        request_rate=16.0,
        min_prompt_len=256,
        max_prompt_len=1024,
        vocab_size=512,
    )
    assert [(t, p) for t, _, p in plain] == expected
    passes = list(bench_prefix.trace_passes(args, 512))
    assert [(p.trace, p.rate, p.new) for p in passes] == [
        ("system", 500.0, 3),
        ("system", 900.0, 3),
        ("chat", 500.0, 3),
        ("plain", 500.0, 128),
        ("plain", 900.0, 128),
    ]
    first, second = passes[0].starts, passes[1].starts
    assert first[0][2][:40] != second[0][2][:40]  # another system prompt at the second rate
    plain_prompts = [{tuple(p) for _, _, p in run.starts} for run in passes[3:]]
    assert not plain_prompts[0] & plain_prompts[1]  # nothing of the first plain pass to hit
    only = bench_prefix.parse_args([*ARGV, "--traces", "system", "--rate", "16"])
    assert [p.trace for p in bench_prefix.trace_passes(only, 512)] == ["system"]
    assert bench_prefix.longest_sequence(args) == 1024 + 128  # the plain trace's longest


# --- vLLM beside FlashDec (issue 22): vllm_prefix.py and bench_prefix.py --vllm-json ---

ARGV = ["--requests", "5", "--system", "40", "--min-question", "3", "--max-question", "9"]
ARGV += ["--new", "3", "--rate", "500", "900", "--conversations", "2", "--turns", "3"]
ARGV += ["--turn-tokens", "20", "--chat-rate", "500", "--warmup", "1", "--seed", "7"]


def test_vllm_prefix_serves_bench_prefix_traces():
    """The same flags give vllm_prefix.py the same requests as bench_prefix.py, and importing
    it does not import vLLM (absent here: it runs on the GPU machine only)."""
    ours, theirs = bench_prefix.parse_args(ARGV), vllm_prefix.parse_args(ARGV)
    assert "vllm" not in sys.modules
    assert {k: vars(ours)[k] for k in bench_prefix.TRACE_ARGS} == {
        k: vars(theirs)[k] for k in bench_prefix.TRACE_ARGS
    }
    assert theirs.rate == ours.rate == [500.0, 900.0]
    passes = list(bench_prefix.trace_passes(ours, 512))
    passes_v = list(bench_prefix.trace_passes(theirs, 512))
    assert [(p.trace, p.rate, p.starts, p.new) for p in passes_v] == [
        (p.trace, p.rate, p.starts, p.new) for p in passes
    ]
    for run in passes[:2]:
        trace = run.starts
        assert len(trace) == 5 and all(p[:40] == trace[0][2][:40] for _, _, p in trace)
    starts, follow, follow_v = passes[2].starts, passes[2].next_turn, passes_v[2].next_turn
    for _, key, prompt in starts:  # the follow-up turns, answer by answer
        for turn in range(1, 3):
            answer = [turn] * 3
            prompt, prompt_v = follow(key, prompt, answer), follow_v(key, prompt, answer)
            assert prompt_v == prompt and len(prompt) == 20 * (turn + 1) + 3 * turn
        assert follow(key, prompt, [0] * 3) is None and follow_v(key, prompt, [0] * 3) is None
    theirs.plain_prompt, theirs.plain_new = [8, 24], 3
    assert bench_prefix.longest_sequence(theirs) == 3 * (20 + 3)  # the chat's last turn


def test_vllm_model_config_has_flashdec_geometry():
    llama = vllm_prefix.vllm_model_config("llama3-8b-shape", 2432)
    shape = BUILTIN_SHAPES["llama3-8b-shape"].config
    assert llama["architectures"] == ["LlamaForCausalLM"] and "sliding_window" not in llama
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        assert llama[key] == shape[key]
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (32, 8)
    assert (llama["head_dim"], llama["rope_theta"]) == (128, 500000.0)
    assert llama["max_position_embeddings"] == 8192  # serve_trace.py's
    mistral = vllm_prefix.vllm_model_config("mistral-7b-window-shape", 10000)
    assert mistral["architectures"] == ["MistralForCausalLM"]
    assert mistral["model_type"] == "mistral" and mistral["sliding_window"] == 4096
    assert (mistral["vocab_size"], mistral["head_dim"]) == (32000, 128)
    assert mistral["max_position_embeddings"] == 10000
    with pytest.raises(ValueError, match="tiny-qwen2 is a qwen2 shape"):
        vllm_prefix.vllm_model_config("tiny-qwen2", 512)
    with pytest.raises(ValueError, match="unknown built-in shape 'gpt-9'"):
        vllm_prefix.vllm_model_config("gpt-9", 512)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class FakeVllm:
    """vLLM's offline engine as vllm_prefix.py uses it: string ids (outputs carry the caller's,
    add_request returns a suffixed internal one), cumulative outputs one token per step, a
    prompt's cached tokens = its longest 4-token-block prefix shared with a finished prompt
    (at most all but the last token), Prometheus-like counters."""

    def __init__(self):
        self.llm_engine = self
        self.running: dict[str, dict] = {}
        self.finished: list[list[int]] = []
        self.queries = self.hits = 0

    def add_request(self, rid, prompt, params):
        ids = prompt["prompt_token_ids"]
        common = max((_common_prefix(ids, p) for p in self.finished), default=0)
        cached = min(common, len(ids) - 1) // 4 * 4
        self.queries, self.hits = self.queries + len(ids), self.hits + cached
        self.running[rid] = {"ids": ids, "out": [], "max": params.max_tokens, "cached": cached}
        return rid + "-1a2b3c4d"

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outputs = []
        for rid, r in list(self.running.items()):
            r["out"].append(100 + len(r["out"]))
            done = len(r["out"]) == r["max"]
            completion = SimpleNamespace(token_ids=tuple(r["out"]))
            outputs.append(
                SimpleNamespace(
                    request_id=rid,
                    outputs=[completion],
                    finished=done,
                    num_cached_tokens=r["cached"],
                )
            )
            if done:
                self.finished.append(self.running.pop(rid)["ids"])
        return outputs

    def reset_prefix_cache(self):
        self.finished.clear()
        return not self.running

    def get_metrics(self):
        return [
            SimpleNamespace(name="vllm:prefix_cache_queries", value=self.queries),
            SimpleNamespace(name="vllm:prefix_cache_hits", value=self.hits),
            SimpleNamespace(name="vllm:num_preemptions", value=0),
        ]


def test_vllm_requests_drive_both_traces():
    """bench_prefix.drive runs vLLM through vllm_prefix's adapter: every request to its last
    token, chat turns built from the answers, hits from num_cached_tokens, vLLM's counters
    read around the measured pass (after a warm-up and an emptied cache)."""
    args = vllm_prefix.parse_args(ARGV)
    fake = FakeVllm()
    requests = vllm_prefix.VllmRequests(fake, sampling_params=SimpleNamespace)
    trace = bench_prefix.system_trace(args, 512, 500.0, args.seed)
    run = bench_prefix.TracePass("system", 500.0, trace, args.new)
    result = vllm_prefix.measured(requests, args, 512, run)
    assert result["requests"] == 5 and result["output_tokens"] == 15
    assert all(r["tokens"] == 3 and r["ttft_ms"] >= 0 for r in result["records"])
    assert result["queried_tokens"] == sum(len(p) for _, _, p in trace)
    # one request's prompt of the warm-up pass is cached before the reset: none of it counts
    assert result["metric_queried_tokens"] == result["queried_tokens"]
    assert result["metric_hit_tokens"] == result["hit_tokens"]
    assert result["evicted_blocks"] is None
    assert not requests._timing and not requests._answers  # everything released

    starts, follow = bench_prefix.chat_trace(args, 512, args.seed)
    run = bench_prefix.TracePass("chat", 4.0, starts, args.new, follow)
    chat = vllm_prefix.measured(requests, args, 512, run)
    assert sorted(r["turn"] for r in chat["records"]) == [0, 0, 1, 1, 2, 2]
    lengths = sorted({r["prompt_tokens"] for r in chat["records"]})
    assert lengths == [20, 43, 66]  # history + answer (3) + a new 20-token question
    # each later turn hits its whole history's full blocks (finished before it arrived)
    assert chat["hit_tokens"] == 2 * (20 + 40) and chat["hit_rate"] == chat["hit_tokens"] / (
        2 * (20 + 43 + 66)
    )
    assert bench_prefix.ttft_p50_by_turn(chat["records"])[0] >= 0


def _row(trace, rate, caching, ttft, tok_s, share=None):
    return {
        "trace": trace,
        "rate": rate,
        "caching": caching,
        "requests": 4,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": 2 * ttft,
        "output_tok_s": tok_s,
        "hit_rate": 0.9,
        "prefix_hit_share": share,
        "evicted_blocks": None,
        "ttft_p50_by_turn_ms": [ttft, ttft / 2] if trace == "chat" else None,
    }


def _vllm_json(path, args, rows):
    payload = {"engine": "vllm", "version": "0.24.0", "gpu": "NVIDIA H200", "block_size": 16}
    payload.update(engine_args={"enable_prefix_caching": True}, args=vars(args), rows=rows)
    path.write_text(json.dumps(payload))
    return str(path)


def test_targets_met_missed_and_margins(tmp_path):
    args = bench_prefix.parse_args(["--rate", "16", "64", "--turns", "2"])
    rows = [
        _row("system", 16.0, True, 40.0, 1000.0, share=0.99),
        _row("system", 64.0, True, 80.0, 2000.0, share=0.90),
        _row("chat", 4.0, True, 30.0, 500.0),
        _row("system", 16.0, False, 90.0, 900.0, share=0.0),
    ]
    peer = [
        _row("system", 16.0, True, 50.0, 800.0, share=1.0),  # slower than FlashDec
        _row("chat", 4.0, True, 20.0, 600.0),  # faster first tokens than FlashDec
    ]  # no 64/s row
    peer[0].update(metric_hit_tokens=90, metric_queried_tokens=120, hit_tokens=80)
    peer[0].update(queried_tokens=100)
    vllm = bench_prefix.load_vllm(_vllm_json(tmp_path / "v.json", args, peer), args)
    goals = bench_prefix.targets(args, rows, vllm)
    verdicts = [(g["kind"], g["trace"], g["rate"], g["met"], g["margin"]) for g in goals]
    assert verdicts == [
        ("hit", "system", 16.0, True, "+4.0 points"),
        ("ttft", "system", 16.0, True, "10.0 ms (20.0%) under vLLM's"),
        ("tok/s", "system", 16.0, True, "+200 tok/s (+25.0%) vs vLLM"),
        ("hit", "system", 64.0, False, "-5.0 points"),
        ("ttft", "system", 64.0, None, "no vLLM row at this rate"),
        ("tok/s", "system", 64.0, None, "no vLLM row at this rate"),
        ("ttft", "chat", 4.0, False, "10.0 ms (50.0%) over vLLM's"),
    ]
    assert goals[0]["target"] == "prefix hit share >= 0.95"
    markdown = bench_prefix.report(args, environment(), rows, vllm)
    assert "| vLLM 0.24.0 | system | 16.0 | on | 4 | 50.0 |" in markdown
    assert "| vLLM 0.24.0 | on | 20.0 | 10.0 |" in markdown  # its chat turns
    assert "3 met, 2 missed, 2 not measured" in markdown
    assert "prefix_cache_hits / queries: system 16.0/s 90 / 120 (outputs: 80 / 100)" in markdown
    assert "| TTFT p50 <= vLLM's | chat | 4.0 | 30.0 ms | 20.0 ms | **missed** |" in markdown

    # a window model's bar is 0.90; without vLLM only the hit share is judged
    window = bench_prefix.parse_args(["--model", "mistral-7b-window-shape", "--rate", "64"])
    goals = bench_prefix.targets(window, rows[1:3], None)
    assert [(g["target"], g["met"], g["margin"]) for g in goals] == [
        ("window model: prefix hit share >= 0.90", True, "+0.0 points"),
        ("TTFT p50 <= vLLM's", None, "no --vllm-json"),
        ("output tok/s >= vLLM's", None, "no --vllm-json"),
        ("TTFT p50 <= vLLM's", None, "no --vllm-json"),
    ]


def test_vllm_json_of_other_traces_is_refused_before_running(tmp_path):
    args = bench_prefix.parse_args(["--smoke"])
    other = bench_prefix.parse_args(["--smoke"])
    other.system, other.seed = 48, 3
    path = _vllm_json(tmp_path / "v.json", other, [])
    with pytest.raises(ValueError, match="system: ours 40, vLLM's 48; seed: ours 0, vLLM's 3"):
        bench_prefix.main(["--smoke", "--out-dir", str(tmp_path), "--vllm-json", path])
    assert not (tmp_path / "prefix_cache.md").exists()  # refused before the runs
    (tmp_path / "x.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=r"not vllm_prefix\.py's --json output"):
        bench_prefix.load_vllm(str(tmp_path / "x.json"), args)


def test_zero_hit_targets_and_the_window_section(tmp_path):
    """The plain trace judges caching on against off at the same rate (<= 2% tok/s, <= 1 ms
    TTFT p50); a window model's run, given as --window-json, becomes a section of the report."""
    args = bench_prefix.parse_args(["--rate", "16", "64", "--turns", "2"])
    rows = [
        _row("plain", 16.0, True, 30.5, 990.0),  # -1.0% and +0.5 ms: both met
        _row("plain", 64.0, True, 42.0, 900.0),  # -10% and +2 ms: both missed
        _row("plain", 16.0, False, 30.0, 1000.0),
        _row("plain", 64.0, False, 40.0, 1000.0),
    ]
    goals = bench_prefix.targets(args, rows, None)
    assert [(g["kind"], g["rate"], g["met"], g["margin"]) for g in goals] == [
        ("tok/s", 16.0, True, "-1.0% vs caching off"),
        ("ttft", 16.0, True, "+0.50 ms vs caching off"),
        ("tok/s", 64.0, False, "-10.0% vs caching off"),
        ("ttft", 64.0, False, "+2.00 ms vs caching off"),
    ]
    lone = bench_prefix.targets(args, rows[:1], None)  # caching on only: nothing to judge by
    assert [g["met"] for g in lone] == [None, None]

    window_args = bench_prefix.parse_args(
        ["--model", "mistral-7b-window-shape", "--system", "6144", "--traces", "system"]
    )
    window_rows = [_row("system", 16.0, True, 60.0, 700.0, share=0.97)]
    window = {
        "args": vars(window_args),
        "rows": window_rows,
        "vllm": None,
        "targets": bench_prefix.targets(window_args, window_rows, None),
    }
    path = tmp_path / "w.json"
    path.write_text(json.dumps(window))
    loaded = bench_prefix.load_window(str(path))
    markdown = bench_prefix.report(args, environment(), rows, None, loaded)
    assert "## Window model: mistral-7b-window-shape (4096-token sliding window)" in markdown
    assert "| window model: prefix hit share >= 0.90 | system | 16.0 | 0.970 |" in markdown
    (tmp_path / "full.json").write_text(json.dumps({**window, "args": vars(args)}))
    with pytest.raises(ValueError, match="not a run of a sliding-window model"):
        bench_prefix.load_window(str(tmp_path / "full.json"))
