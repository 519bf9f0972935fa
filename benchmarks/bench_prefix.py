"""Automatic prefix caching under traffic (issue 22): the same traces through ``flashdec.LLM``
with ``enable_prefix_caching`` on and off.

One LLM per mode, warmed by a pass on a different prefix (so kernel compiles and graph captures
do not land on a measured pass), serves every pass; each pass starts with nothing of its own
prefix cached (the system prompt differs per rate). The traces (``--traces``):
- shared system prompt: Poisson arrivals, each request a common ``--system``-token prefix plus
  a distinct ``--min-question``..``--max-question``-token question, ``--new`` tokens;
- multi-turn chat: ``--conversations`` conversations starting at Poisson times; each turn
  arrives when the previous one finishes, its prompt the whole history (previous prompt +
  answer) plus a new ``--turn-tokens``-token question, ``--turns`` turns;
- plain: serve_trace.py's trace (random prompts, nothing to hit) at each rate, for caching's
  cost when nothing hits: on against off, <= 2% output tok/s and <= 1 ms TTFT p50.
Per mode: TTFT p50/p99 (first token on the host - arrival), output tok/s, the prefix cache's
hit rate (hit tokens / prompt tokens looked up), and for the system-prompt trace the share of
the shared prefix's tokens that hit; for the chat, TTFT p50 per turn. Greedy, EOS ignored.

With ``--vllm-json`` (vllm_prefix.py's output: vLLM 0.24.0 with enable_prefix_caching=True on
the same traces, run first in the same lease) vLLM's rows stand beside FlashDec's, and the report
states each issue-22 target as met or missed with its margin: prefix hit share >= 0.95 (>= 0.90
on a sliding-window model), TTFT p50 <= vLLM's and output tok/s >= vLLM's on the system-prompt
trace at each rate; TTFT also on the chat (FlashDec with caching on). Without it, the hit-share
target alone is judged.

On the GPU machine (Llama-3-8B shape, random bf16 weights):
  python3 benchmarks/vllm_prefix.py --json $OUT/vllm_prefix.json      # after vLLM's install.sh
  PYTHONPATH=. python3 benchmarks/bench_prefix.py --rate 16 64 --out-dir $OUT \\
      --vllm-json $OUT/vllm_prefix.json
  the window model, first (its JSON becomes a section of the main report):
  --model mistral-7b-window-shape --system 6144 --traces system --rate 16 on both (a prefix
  longer than the 4096-token window, so the window matters), --caching on --name
  prefix_cache_window here; then the main run with --window-json $OUT/prefix_cache_window.json
Locally, a check of the script itself: python3 benchmarks/bench_prefix.py --smoke
Writes prefix_cache.md and prefix_cache.json (``--name``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    load_peer_run,
    markdown_table,
    write_results,
)


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the two traces and the serving limits: the same flags in vllm_prefix.py, so
    both engines serve the same requests."""
    p.add_argument("--model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--rate", type=float, nargs="+", default=[16.0, 64.0])
    p.add_argument("--requests", type=int, default=256, help="system-prompt trace")
    p.add_argument("--system", type=int, default=2048, help="shared prefix tokens")
    p.add_argument("--min-question", type=int, default=64)
    p.add_argument("--max-question", type=int, default=256)
    p.add_argument("--new", type=int, default=64, help="tokens per request (EOS ignored)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=64, help="new question per chat turn")
    p.add_argument("--chat-rate", type=float, default=4.0, help="conversation starts per s")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=8, help="requests of each warm-up pass")
    p.add_argument(
        "--traces", nargs="+", choices=TRACES, default=list(TRACES), help="which traces to serve"
    )
    p.add_argument("--plain-requests", type=int, default=64, help="plain trace (serve_trace's)")
    p.add_argument("--plain-prompt", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--plain-new", type=int, default=128)


TRACES = ("system", "chat", "plain")


# what a vLLM run must share with this one to stand beside it (the rates are matched per row)
TRACE_ARGS = (
    "model",
    "requests",
    "system",
    "min_question",
    "max_question",
    "new",
    "conversations",
    "turns",
    "turn_tokens",
    "chat_rate",
    "max_batch",
    "seed",
    "plain_requests",
    "plain_prompt",
    "plain_new",
)
HIT_SHARE_TARGET = 0.95  # issue 22: hits cover >= 95% of the shared prefix's tokens
ZERO_HIT_TOK_S_SHARE = 0.98  # ... and with nothing to hit, caching costs <= 2% output tok/s
ZERO_HIT_TTFT_MS = 1.0  # ... and <= 1 ms TTFT p50
WINDOW_HIT_TARGET = 0.90  # ... >= 90% on a sliding-window model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool (default: LLM's)")
    p.add_argument(
        "--caching", nargs="+", choices=("on", "off"), default=["on", "off"], help="modes to run"
    )
    p.add_argument("--vllm-json", help="vllm_prefix.py's --json output: vLLM's rows beside ours")
    p.add_argument(
        "--window-json",
        help="this script's JSON of the window model's run (--model mistral-7b-window-shape): "
        "its rows and targets become a section of this report",
    )
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="prefix_cache")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small traces")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.rate, args.requests, args.system = "tiny", [200.0], 4, 40
        args.min_question, args.max_question, args.new = 3, 9, 3
        args.conversations, args.turns, args.turn_tokens, args.chat_rate = 2, 2, 20, 200.0
        args.max_batch, args.warmup = 4, 1
        args.plain_requests, args.plain_prompt, args.plain_new = 4, [8, 24], 3
    return args


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def drive(llm, starts: list[tuple[float, object, list[int]]], new: int, next_turn=None) -> dict:
    """Serve ``starts`` ((seconds after start, key, prompt)); ``next_turn(key, prompt, answer)``
    gives the follow-up prompt (arriving when the answer is complete) or None. Returns the
    per-request records and the run's totals. ``llm`` is a ``flashdec.LLM`` or anything with
    the same ``add_request`` / ``step`` / ``has_unfinished`` / ``request_timing`` / ``release``
    / ``prefix_cache_stats`` (vllm_prefix.py's adapter; its ``evicted_blocks`` is None)."""
    before = llm.prefix_cache_stats()
    events = [(t, i, key, prompt, 0) for i, (t, key, prompt) in enumerate(starts)]
    heapq.heapify(events)
    order = len(events)
    start = time.perf_counter()
    running: dict = {}  # rid -> (key, prompt, turn, arrival)
    records = []
    while events or llm.has_unfinished():
        now = time.perf_counter() - start
        while events and events[0][0] <= now:
            t, _, key, prompt, turn = heapq.heappop(events)
            rid = llm.add_request(prompt, new, ignore_eos=True)
            running[rid] = (key, prompt, turn, start + t)
        if llm.has_unfinished():
            llm.step()
        elif events:  # idle until the next arrival
            time.sleep(max(0.0, events[0][0] - now))
        for rid in [r for r in running if llm.request_timing(r).finished_at is not None]:
            key, prompt, turn, arrived = running.pop(rid)
            timing = llm.request_timing(rid)
            answer = llm.release(rid)
            records.append(
                {
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "ttft_ms": (timing.first_token_at - arrived) * 1e3,
                    "tokens": len(answer),
                }
            )
            follow = next_turn(key, prompt, answer) if next_turn is not None else None
            if follow is not None:
                at = time.perf_counter() - start
                heapq.heappush(events, (at, order, key, follow, turn + 1))
                order += 1
    elapsed = time.perf_counter() - start
    after = llm.prefix_cache_stats()
    queried = after["queried_tokens"] - before["queried_tokens"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    ttft = [r["ttft_ms"] for r in records]
    out_tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "output_tok_s": out_tokens / elapsed if elapsed > 0 else None,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_rate": hit / queried if queried else 0.0,
        "evicted_blocks": None
        if after["evicted_blocks"] is None
        else after["evicted_blocks"] - before["evicted_blocks"],
        "records": records,
    }


def system_trace(args, vocab: int, rate: float, seed: int) -> list[tuple[float, int, list]]:
    rng = random.Random(seed)
    system = _tokens(rng, args.system, vocab)
    clock, out = 0.0, []
    for i in range(args.requests):
        clock += rng.expovariate(rate)
        question = _tokens(rng, rng.randint(args.min_question, args.max_question), vocab)
        out.append((clock, i, system + question))
    return out


def chat_trace(args, vocab: int, seed: int):
    """The conversations' first turns and the follow-up rule."""
    rng = random.Random(seed)
    clock, starts = 0.0, []
    for c in range(args.conversations):
        clock += rng.expovariate(args.chat_rate)
        starts.append((clock, c, _tokens(rng, args.turn_tokens, vocab)))
    questions = {
        (c, t): _tokens(rng, args.turn_tokens, vocab)
        for c in range(args.conversations)
        for t in range(1, args.turns)
    }
    turns = dict.fromkeys(range(args.conversations), 0)

    def next_turn(key, prompt, answer):
        turns[key] += 1
        if turns[key] >= args.turns:
            return None
        return list(prompt) + list(answer) + questions[(key, turns[key])]

    return starts, next_turn


def plain_trace(args, vocab: int, rate: float, seed: int) -> list[tuple[float, int, list]]:
    """serve_trace.py's trace (random prompts: nothing to hit), for caching's zero-hit cost."""
    from flashdec.workloads.serving import poisson_trace

    lo, hi = args.plain_prompt
    arrivals = poisson_trace(
        seed=seed,
        num_requests=args.plain_requests,
        request_rate=rate,
        min_prompt_len=lo,
        max_prompt_len=hi,
        vocab_size=vocab,
    )
    return [(t, i, prompt) for i, (t, prompt) in enumerate(arrivals)]


@dataclass(frozen=True)
class TracePass:
    """One measured pass: ``drive(llm, starts, new, next_turn)``."""

    trace: str
    rate: float
    starts: list
    new: int
    next_turn: Callable | None = None


def trace_passes(args, vocab: int) -> Iterator[TracePass]:
    """The passes of ``args.traces``, the same on both engines. The system and plain traces'
    prompts differ per rate (seed + the rate's index; the Poisson draws are rate-independent, so
    one seed would repeat the prompts): an engine reused across passes holds none of a pass's own
    prompts when it starts."""
    if "system" in args.traces:
        for i, rate in enumerate(args.rate):
            starts = system_trace(args, vocab, rate, args.seed + i)
            yield TracePass("system", rate, starts, args.new)
    if "chat" in args.traces:
        starts, follow = chat_trace(args, vocab, args.seed)
        yield TracePass("chat", args.chat_rate, starts, args.new, follow)
    if "plain" in args.traces:  # another seed per rate too: nothing of an earlier pass to hit
        for i, rate in enumerate(args.rate):
            starts = plain_trace(args, vocab, rate, args.seed + i)
            yield TracePass("plain", rate, starts, args.plain_new)


def measured_row(args, run: TracePass, caching: bool, result: dict, block_size: int) -> dict:
    """A pass's row: ``drive``'s result with the prefix hit share (system trace) or the TTFT
    p50 per turn (chat)."""
    if run.trace == "system":
        prefix = shared_prefix_tokens(args, block_size)
        result["prefix_hit_share"] = result["hit_tokens"] / prefix if prefix else None
    if run.trace == "chat":
        result["ttft_p50_by_turn_ms"] = ttft_p50_by_turn(result["records"])
    row = {"trace": run.trace, "rate": run.rate, "caching": caching, **result}
    print(json.dumps({k: v for k, v in row.items() if k != "records"}), flush=True)
    return row


def shared_prefix_tokens(args, block_size: int) -> int:
    """The shared prefix's full-block tokens of every request after the first: the most the
    system-prompt trace can hit on it."""
    return (args.system // block_size) * block_size * (args.requests - 1)


def ttft_p50_by_turn(records: list[dict]) -> list[float | None]:
    by_turn: dict[int, list[float]] = {}
    for r in records:
        by_turn.setdefault(r["turn"], []).append(r["ttft_ms"])
    return [_percentile(by_turn[t], 50) for t in sorted(by_turn)]


def longest_sequence(args) -> int:
    """The most tokens (prompt + answer) one request of any trace holds."""
    system = args.system + args.max_question + args.new
    plain = args.plain_prompt[1] + args.plain_new
    return max(system, args.turns * (args.turn_tokens + args.new), plain)


def make_llm(args, model, caching: bool):
    """A fresh LLM (nothing of the measured traces cached), warmed on another prefix."""
    import flashdec

    llm = flashdec.LLM(
        model,
        max_batch_size=args.max_batch,
        num_blocks=args.num_blocks,
        max_model_len=longest_sequence(args) + 64,
        enable_prefix_caching=caching,
    )
    vocab = model.config.vocab_size
    drive(llm, system_trace(args, vocab, args.rate[0], args.seed + 1000)[: args.warmup], args.new)
    return llm


def run(args) -> list[dict]:
    from flashdec.models import build_random_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_random_model(args.model, device=device, seed=0)
    vocab = model.config.vocab_size
    rows = []
    for caching in (mode == "on" for mode in args.caching):
        llm = make_llm(args, model, caching)  # one warm LLM per mode serves every pass
        for run_ in trace_passes(args, vocab):
            result = drive(llm, run_.starts, run_.new, run_.next_turn)
            rows.append(measured_row(args, run_, caching, result, llm.engine.cache.block_size))
        del llm
    return rows


def model_window(name: str) -> int | None:
    """The built-in shape's sliding window (None: full attention)."""
    from flashdec.models import BUILTIN_SHAPES

    shape = BUILTIN_SHAPES.get(name)
    return None if shape is None else shape.config.get("sliding_window")


def load_vllm(path: str, args) -> dict:
    """vllm_prefix.py's JSON, checked to have served the same traces as this run."""
    return load_peer_run(path, args, TRACE_ARGS, "rows", "vllm_prefix.py")


def load_window(path: str) -> dict:
    """This script's JSON of a window model's run, checked to be one."""
    data = json.loads(Path(path).read_text())
    if not all(isinstance(data.get(k), list) for k in ("rows", "targets")):
        raise ValueError(f"{path} is not bench_prefix.py's JSON (no rows/targets)")
    if not model_window(data.get("args", {}).get("model", "")):
        raise ValueError(f"{path} is not a run of a sliding-window model")
    return data


def _target(kind: str, target: str, row: dict, ours, bar, met, margin: str) -> dict:
    return {
        "kind": kind,
        "target": target,
        "trace": row["trace"],
        "rate": row["rate"],
        "flashdec": ours,
        "bar": bar,
        "met": met,
        "margin": margin,
    }


def targets(args, rows: list[dict], vllm: dict | None) -> list[dict]:
    """Issue 22's targets, each met (True), missed (False) or not measured (None), with the
    margin: FlashDec's caching-on rows against a fixed hit-share bar and vLLM's rows."""
    window = model_window(args.model)
    bar = WINDOW_HIT_TARGET if window else HIT_SHARE_TARGET
    hit_name = ("window model: " if window else "") + f"prefix hit share >= {bar:.2f}"
    peer = {(r["trace"], r["rate"]): r for r in (vllm or {}).get("rows", [])}
    missing = "no vLLM row at this rate" if vllm else "no --vllm-json"
    off = {(r["trace"], r["rate"]): r for r in rows if not r["caching"]}
    out = []
    for r in (r for r in rows if r["caching"]):
        if r["trace"] == "plain":
            out += _zero_hit_targets(r, off.get(("plain", r["rate"])))
            continue
        if r["trace"] == "system":
            share = r.get("prefix_hit_share")
            if share is None:
                out.append(_target("hit", hit_name, r, None, bar, None, "no shared prefix"))
            else:
                margin = f"{(share - bar) * 100:+.1f} points"
                out.append(_target("hit", hit_name, r, share, bar, share >= bar, margin))
        v = peer.get((r["trace"], r["rate"]))
        checks = [("ttft", "TTFT p50 <= vLLM's", "ttft_p50_ms")]
        if r["trace"] == "system":
            checks.append(("tok/s", "output tok/s >= vLLM's", "output_tok_s"))
        for kind, name, key in checks:
            ours, theirs = r.get(key), None if v is None else v.get(key)
            if ours is None or not theirs:
                out.append(_target(kind, name, r, ours, theirs, None, missing))
                continue
            if kind == "ttft":
                diff = theirs - ours  # > 0: FlashDec's first tokens come sooner
                side = "under" if diff >= 0 else "over"
                margin = f"{abs(diff):.1f} ms ({abs(diff) / theirs:.1%}) {side} vLLM's"
                out.append(_target(kind, name, r, ours, theirs, ours <= theirs, margin))
            else:
                diff = ours - theirs
                margin = f"{diff:+.0f} tok/s ({diff / theirs:+.1%}) vs vLLM"
                out.append(_target(kind, name, r, ours, theirs, ours >= theirs, margin))
    return out


def _zero_hit_targets(on: dict, off: dict | None) -> list[dict]:
    """Caching's cost where nothing hits (the plain trace): on against off, same rate."""
    tok_name = f"zero hits: output tok/s >= {ZERO_HIT_TOK_S_SHARE:.0%} of caching off"
    ttft_name = f"zero hits: TTFT p50 <= caching off + {ZERO_HIT_TTFT_MS:g} ms"
    if off is None:
        return [
            _target("tok/s", tok_name, on, on["output_tok_s"], None, None, "no caching-off row"),
            _target("ttft", ttft_name, on, on["ttft_p50_ms"], None, None, "no caching-off row"),
        ]
    tok_bar = ZERO_HIT_TOK_S_SHARE * off["output_tok_s"]
    change = on["output_tok_s"] / off["output_tok_s"] - 1
    ttft_bar = off["ttft_p50_ms"] + ZERO_HIT_TTFT_MS
    added = on["ttft_p50_ms"] - off["ttft_p50_ms"]
    return [
        _target(
            "tok/s",
            tok_name,
            on,
            on["output_tok_s"],
            tok_bar,
            on["output_tok_s"] >= tok_bar,
            f"{change:+.1%} vs caching off",
        ),
        _target(
            "ttft",
            ttft_name,
            on,
            on["ttft_p50_ms"],
            ttft_bar,
            on["ttft_p50_ms"] <= ttft_bar,
            f"{added:+.2f} ms vs caching off",
        ),
    ]


def _value(kind: str, value) -> str:
    if value is None:
        return "—"
    return {"hit": f"{value:.3f}", "ttft": f"{value:.1f} ms", "tok/s": f"{value:.0f}"}[kind]


def _vllm_counters(vllm: dict | None) -> list[str]:
    """vLLM's Prometheus counters beside the hit tokens its outputs report (a cross-check: a
    request looked up again while it waits counts again there)."""
    rows = [r for r in (vllm or {}).get("rows", []) if "metric_queried_tokens" in r]
    if not rows:
        return []
    each = [
        f"{r['trace']} {r['rate']}/s {r['metric_hit_tokens']} / {r['metric_queried_tokens']} "
        f"(outputs: {r['hit_tokens']} / {r['queried_tokens']})"
        for r in rows
    ]
    return ["vLLM's vllm:prefix_cache_hits / queries: " + "; ".join(each), ""]


def _runs_table(rows: list[dict], vllm: dict | None) -> tuple[str, list]:
    """Every pass of both engines as a table, and the (engine, row) pairs in it."""
    peer_name = f"vLLM {vllm.get('version', '?')}" if vllm else None
    both = [("FlashDec", r) for r in rows] + [(peer_name, r) for r in (vllm or {}).get("rows", [])]
    columns = ["engine", "trace", "rate /s", "caching", "requests", "TTFT p50 ms", "TTFT p99 ms"]
    columns += ["out tok/s", "hit rate", "prefix hit share", "evicted blocks"]
    table = [
        [
            engine,
            r["trace"],
            r["rate"],
            "on" if r["caching"] else "off",
            r["requests"],
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["output_tok_s"],
            f"{r['hit_rate']:.3f}",
            "—" if r.get("prefix_hit_share") is None else f"{r['prefix_hit_share']:.3f}",
            r.get("evicted_blocks"),
        ]
        for engine, r in both
    ]
    return markdown_table(columns, table), both


def _goals_section(goals: list[dict]) -> list[str]:
    """The targets' count line and table."""
    verdict = {True: "met", False: "**missed**", None: "not measured"}
    goal_rows = [
        [
            g["target"],
            g["trace"],
            g["rate"],
            _value(g["kind"], g["flashdec"]),
            _value(g["kind"], g["bar"]),
            verdict[g["met"]],
            g["margin"],
        ]
        for g in goals
    ]
    counts = {v: sum(g["met"] is k for g in goals) for k, v in verdict.items()}
    return [
        f"{counts['met']} met, {counts['**missed**']} missed, {counts['not measured']} not "
        "measured (FlashDec with caching on; the bar is fixed for the hit share, caching off's "
        "own number for the zero-hit cost, vLLM's own number with caching on otherwise).",
        "",
        markdown_table(
            ["target", "trace", "rate /s", "FlashDec", "bar", "verdict", "margin"], goal_rows
        ),
    ]


def _window_section(window: dict | None) -> list[str]:
    """The window model's run (its own JSON from this script), as a section."""
    if window is None:
        return []
    a = window["args"]
    table, _ = _runs_table(window["rows"], window.get("vllm"))
    return [
        "",
        f"## Window model: {a['model']} ({model_window(a['model'])}-token sliding window)",
        "",
        f"Its own run of this script (`--model {a['model']} --system {a['system']}`, a prefix "
        "longer than the window, so the window matters), vLLM beside it in the same lease:",
        "",
        table,
        "",
        *_goals_section(window["targets"]),
    ]


def report(args, env: dict, rows: list[dict], vllm: dict | None = None, window=None) -> str:
    peer_name = f"vLLM {vllm.get('version', '?')}" if vllm else None
    table, both = _runs_table(rows, vllm)
    turn_cols = ["engine", "caching"] + [f"turn {t + 1}" for t in range(args.turns)]
    turn_rows = [
        [engine, "on" if r["caching"] else "off", *r["ttft_p50_by_turn_ms"]]
        for engine, r in both
        if r["trace"] == "chat"
    ]
    goals = targets(args, rows, vllm)
    window_size = model_window(args.model)
    vllm_line = "- vLLM: not given (--vllm-json)"
    if vllm:
        settings = ", ".join(f"{k}={v}" for k, v in vllm.get("engine_args", {}).items())
        vllm_line = f"- {peer_name} on {vllm.get('gpu')}: block size {vllm.get('block_size')}"
        vllm_line += f", {settings}" if settings else ""
    lines = [
        f"# Automatic prefix caching under traffic ({args.model})",
        "",
        environment_markdown(env),
        vllm_line,
        f"- model: {args.model}"
        + (f" (a {window_size}-token sliding window)" if window_size else " (full attention)"),
        f"- system-prompt trace: {args.requests} requests at each rate, a {args.system}-token "
        f"shared prefix + a {args.min_question}-{args.max_question}-token question, "
        f"{args.new} new tokens, greedy, EOS ignored, max batch {args.max_batch}, seed "
        f"{args.seed}",
        f"- chat trace: {args.conversations} conversations of {args.turns} turns (starting "
        f"at {args.chat_rate}/s; each turn = history + {args.turn_tokens} new tokens)",
        f"- plain trace (caching's cost with nothing to hit): serve_trace.py's, "
        f"{args.plain_requests} requests, prompts {args.plain_prompt[0]}-{args.plain_prompt[1]} "
        f"random tokens, {args.plain_new} new tokens",
        f"- traces served: {', '.join(args.traces)}; each engine is warmed on another prefix, "
        "then serves every pass (FlashDec: one LLM per caching mode; vLLM: its prefix cache "
        "reset before each pass); the system prompt differs per rate",
        "- hit rate = hit tokens / prompt tokens looked up; prefix hit share = hit tokens / "
        "the shared prefix's full-block tokens of every request after the first",
        "",
        table,
        "",
        *_vllm_counters(vllm),
        "TTFT p50 (ms) per chat turn:",
        "",
        markdown_table(turn_cols, turn_rows),
        "",
        "## Issue 22 targets",
        "",
        *_goals_section(goals),
        *_window_section(window),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm = load_vllm(args.vllm_json, args) if args.vllm_json else None  # before the runs
    window = load_window(args.window_json) if args.window_json else None
    env = environment()
    rows = run(args)
    markdown = report(args, env, rows, vllm, window)
    payload = {"environment": env, "args": vars(args), "rows": rows}
    payload.update(vllm=vllm, targets=targets(args, rows, vllm), window=window)
    md_path, _ = write_results(args.name, markdown, payload, Path(args.out_dir))
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
