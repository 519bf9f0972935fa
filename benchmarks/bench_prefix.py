"""Automatic prefix caching under traffic (issue 22): the same trace through ``flashdec.LLM``
with ``enable_prefix_caching`` on and off.

Two traces, each served by a fresh LLM per mode after a warm-up pass on a different prefix (so
kernel compiles and graph captures do not land on the measured pass, and the measured pass
starts with nothing of its own prefix cached):
- shared system prompt: Poisson arrivals, each request a common ``--system``-token prefix plus
  a distinct ``--min-question``..``--max-question``-token question, ``--new`` tokens;
- multi-turn chat: ``--conversations`` conversations starting at Poisson times; each turn
  arrives when the previous one finishes, its prompt the whole history (previous prompt +
  answer) plus a new ``--turn-tokens``-token question, ``--turns`` turns.
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
  the window model: --model mistral-7b-window-shape --system 6144 on both (a prefix longer
  than the 4096-token window, so the window matters)
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
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
)
HIT_SHARE_TARGET = 0.95  # issue 22: hits cover >= 95% of the shared prefix's tokens
WINDOW_HIT_TARGET = 0.90  # ... >= 90% on a sliding-window model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool (default: LLM's)")
    p.add_argument("--vllm-json", help="vllm_prefix.py's --json output: vLLM's rows beside ours")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="prefix_cache")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small traces")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.rate, args.requests, args.system = "tiny", [200.0], 4, 40
        args.min_question, args.max_question, args.new = 3, 9, 3
        args.conversations, args.turns, args.turn_tokens, args.chat_rate = 2, 2, 20, 200.0
        args.max_batch, args.warmup = 4, 1
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
    """The most tokens (prompt + answer) one request of either trace holds."""
    system = args.system + args.max_question + args.new
    return max(system, args.turns * (args.turn_tokens + args.new))


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
    prefix = shared_prefix_tokens(args, block_size=16)  # FlashDec's block size
    rows = []
    for caching in (True, False):
        for rate in args.rate:
            llm = make_llm(args, model, caching)
            result = drive(llm, system_trace(args, vocab, rate, args.seed), args.new)
            result["prefix_hit_share"] = result["hit_tokens"] / prefix if prefix else None
            rows.append({"trace": "system", "rate": rate, "caching": caching, **result})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "records"}), flush=True)
            del llm
        llm = make_llm(args, model, caching)
        starts, follow = chat_trace(args, vocab, args.seed)
        result = drive(llm, starts, args.new, follow)
        result["ttft_p50_by_turn_ms"] = ttft_p50_by_turn(result["records"])
        rows.append({"trace": "chat", "rate": args.chat_rate, "caching": caching, **result})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "records"}), flush=True)
        del llm
    return rows


def model_window(name: str) -> int | None:
    """The built-in shape's sliding window (None: full attention)."""
    from flashdec.models import BUILTIN_SHAPES

    shape = BUILTIN_SHAPES.get(name)
    return None if shape is None else shape.config.get("sliding_window")


def load_vllm(path: str, args) -> dict:
    """vllm_prefix.py's JSON, checked to have served the same traces as this run."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data.get("rows"), list) or not isinstance(data.get("args"), dict):
        raise ValueError(f"{path} is not vllm_prefix.py's --json output (no rows/args)")
    theirs = data["args"]
    differ = [
        f"{k}: ours {getattr(args, k)!r}, vLLM's {theirs.get(k)!r}"
        for k in TRACE_ARGS
        if theirs.get(k) != getattr(args, k)
    ]
    if differ:
        raise ValueError(f"{path} served other traces than this run: " + "; ".join(differ))
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
    out = []
    for r in (r for r in rows if r["caching"]):
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


def report(args, env: dict, rows: list[dict], vllm: dict | None = None) -> str:
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
    turn_cols = ["engine", "caching"] + [f"turn {t + 1}" for t in range(args.turns)]
    turn_rows = [
        [engine, "on" if r["caching"] else "off", *r["ttft_p50_by_turn_ms"]]
        for engine, r in both
        if r["trace"] == "chat"
    ]
    goals = targets(args, rows, vllm)
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
    window = model_window(args.model)
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
        + (f" (a {window}-token sliding window)" if window else " (full attention)"),
        f"- system-prompt trace: {args.requests} requests at each rate, a {args.system}-token "
        f"shared prefix + a {args.min_question}-{args.max_question}-token question, "
        f"{args.new} new tokens, greedy, EOS ignored, max batch {args.max_batch}, seed "
        f"{args.seed}",
        f"- chat trace: {args.conversations} conversations of {args.turns} turns (starting "
        f"at {args.chat_rate}/s; each turn = history + {args.turn_tokens} new tokens)",
        "- hit rate = hit tokens / prompt tokens looked up; prefix hit share = hit tokens / "
        "the shared prefix's full-block tokens of every request after the first",
        "",
        markdown_table(columns, table),
        "",
        *_vllm_counters(vllm),
        "TTFT p50 (ms) per chat turn:",
        "",
        markdown_table(turn_cols, turn_rows),
        "",
        "## Issue 22 targets",
        "",
        f"{counts['met']} met, {counts['**missed**']} missed, {counts['not measured']} not "
        "measured (FlashDec with caching on; the bar is fixed for the hit share, vLLM's own "
        "number with caching on otherwise).",
        "",
        markdown_table(
            ["target", "trace", "rate /s", "FlashDec", "bar", "verdict", "margin"], goal_rows
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm = load_vllm(args.vllm_json, args) if args.vllm_json else None  # before the runs
    env = environment()
    rows = run(args)
    markdown = report(args, env, rows, vllm)
    payload = {"environment": env, "args": vars(args), "rows": rows}
    payload.update(vllm=vllm, targets=targets(args, rows, vllm))
    md_path, _ = write_results(args.name, markdown, payload, Path(args.out_dir))
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
