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

On the GPU machine (Llama-3-8B shape, random bf16 weights):
  PYTHONPATH=. python3 benchmarks/bench_prefix.py --rate 16 64 --out-dir $OUT
  PYTHONPATH=. python3 benchmarks/bench_prefix.py --model <mistral-shape with a window> ...
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool (default: LLM's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=8, help="requests of each LLM's warm-up pass")
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
    per-request records and the run's totals."""
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
        "evicted_blocks": after["evicted_blocks"] - before["evicted_blocks"],
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


def make_llm(args, model, caching: bool):
    """A fresh LLM (nothing of the measured traces cached), warmed on another prefix."""
    import flashdec

    longest = args.system + args.max_question + args.new
    chat_longest = args.turns * (args.turn_tokens + args.new)
    llm = flashdec.LLM(
        model,
        max_batch_size=args.max_batch,
        num_blocks=args.num_blocks,
        max_model_len=max(longest, chat_longest) + 64,
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
    # the shared prefix's full blocks that every request after the first could hit
    prefix = (args.system // 16) * 16 * (args.requests - 1)
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
        by_turn = {}
        for r in result["records"]:
            by_turn.setdefault(r["turn"], []).append(r["ttft_ms"])
        result["ttft_p50_by_turn_ms"] = [_percentile(by_turn[t], 50) for t in sorted(by_turn)]
        rows.append({"trace": "chat", "rate": args.chat_rate, "caching": caching, **result})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "records"}), flush=True)
        del llm
    return rows


def report(args, env: dict, rows: list[dict]) -> str:
    columns = ["trace", "rate /s", "caching", "requests", "TTFT p50 ms", "TTFT p99 ms"]
    columns += ["out tok/s", "hit rate", "prefix hit share", "evicted blocks"]
    table = [
        [
            r["trace"],
            r["rate"],
            "on" if r["caching"] else "off",
            r["requests"],
            r["ttft_p50_ms"],
            r["ttft_p99_ms"],
            r["output_tok_s"],
            f"{r['hit_rate']:.3f}",
            "—" if r.get("prefix_hit_share") is None else f"{r['prefix_hit_share']:.3f}",
            r["evicted_blocks"],
        ]
        for r in rows
    ]
    chat = [r for r in rows if r["trace"] == "chat"]
    turn_cols = ["caching"] + [f"turn {t + 1}" for t in range(args.turns)]
    turn_rows = [["on" if r["caching"] else "off", *r["ttft_p50_by_turn_ms"]] for r in chat]
    lines = [
        f"# Automatic prefix caching under traffic ({args.model})",
        "",
        environment_markdown(env),
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
        "TTFT p50 (ms) per chat turn:",
        "",
        markdown_table(turn_cols, turn_rows),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = environment()
    rows = run(args)
    markdown = report(args, env, rows)
    payload = {"environment": env, "args": vars(args), "rows": rows}
    md_path, _ = write_results(args.name, markdown, payload, Path(args.out_dir))
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
