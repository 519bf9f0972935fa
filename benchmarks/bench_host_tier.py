"""The host tier of automatic prefix caching (``flashdec.LLM(host_kv_cache_gib=)``) under a
multi-turn chat whose prefix working set is several times the GPU pool.

Trace (deterministic: ``random.Random(--seed)``, token ids below the vocabulary size):
``--sessions`` chat sessions, each starting with a ``--history``-token history (8192 by default).
Round 0 serves every session's history as its prompt (all misses: it builds the histories and
is the warm-up; not measured). Each later round (``--rounds`` in all) visits the sessions
round-robin in the same order; a turn's prompt is the session's whole history + a new
``--turn-tokens``-token question, its answer ``--new`` tokens (greedy, EOS ignored), and the
history becomes prompt + answer. Requests are served one at a time (``add_request``, then
``step`` until it is done), so TTFT (first token on the host - submission,
``LLM.request_timing``) isolates the prompt's prefill against the copy up of its prefix.

The GPU pool holds ``--pool-tokens`` (default: the working set ``sessions * history`` / 4, in
whole blocks), so by the time a session comes round again its history has been evicted from
the GPU pool. Two modes of one ``flashdec.LLM`` with the same pool, one after the other in this
process (the first freed before the second is built):
- host tier on: ``host_kv_cache_gib=--host-gib`` (default: every session's longest history,
  in whole blocks, at the model's KV bytes per token, + 25% slack): evicted blocks are copied
  down to pinned host memory and a revisited session's history is copied up;
- host tier off: ``host_kv_cache_gib=0`` (prefix caching still on): evicted prefixes are
  recomputed.
Per mode: TTFT p50/p90/p99 over the measured turns, the hit share (hit tokens / prompt tokens
looked up, over the measured rounds), host hit tokens, blocks and bytes moved each way, the
copy seconds (``prefix_cache_stats()['host']``: CUDA events of the completed copies on the tier's
side stream) and the copy bandwidth each way = bytes / copy seconds.

Copy bandwidth reference (CUDA only): a plain pinned ``copy_(non_blocking=True)`` of the same
bytes (the blocks of one ``--history``-token history, contiguous on the GPU and in pinned host
memory), each way, CUDA events, median of ``--copy-reps``. A second figure calls the tier's own
``BlockTransfer`` directly on as many blocks (down, then up; after the serving run, on the "on"
LLM about to be freed, so overwriting its blocks does not matter): the transfer path alone,
without the serving run around it.

Targets (each MET or MISSED, with its margin): hit share with the tier >= 0.9; TTFT p50 with
the tier off / on >= 3.0; copy bandwidth each way >= 80% of the plain pinned copy; working set
/ GPU pool >= 4. ``--vllm-json`` (vllm_host_tier.py's output: vLLM 0.24.0 on the same trace, in
the same lease, with its CPU offloading connector if the bundle supports it, else with prefix
caching alone: the JSON says which) puts vLLM's TTFTs beside FlashDec's.

On the GPU machine (Llama-3-8B shape, random bf16 weights), vLLM first (after its install.sh):
  python3 benchmarks/vllm_host_tier.py --json $OUT/vllm_host_tier.json
  PYTHONPATH=. python3 benchmarks/bench_host_tier.py --out-dir $OUT \\
      --vllm-json $OUT/vllm_host_tier.json
Locally, a check of the script itself: python3 benchmarks/bench_host_tier.py --smoke
Writes host_tier.md, host_tier.json and host_tier.png (``--name``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    environment,
    environment_markdown,
    goal,
    goals_section,
    load_peer_run,
    markdown_table,
    use_interpreter_without_gpu,
    write_results,
)

HIT_SHARE_TARGET = 0.90  # hits cover >= 90% of the measured turns' prompt tokens (tier on)
TTFT_SPEEDUP_TARGET = 3.0  # TTFT p50: recomputing (tier off) / copying up (tier on)
COPY_SHARE_TARGET = 0.80  # the tier's copy bandwidth / a plain pinned copy_'s, each way
WORKING_SET_TARGET = 4.0  # the sessions' histories / the GPU pool
HOST_SLACK = 1.25  # default host tier: every session's longest history + 25%
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("on", "off")

# what a vLLM run must share with this one to stand beside it (sizes as resolved)
TRACE_ARGS = (
    "model",
    "dtype",
    "sessions",
    "history",
    "rounds",
    "turn_tokens",
    "new",
    "block_size",
    "pool_tokens",
    "host_gib",
    "max_num_batched_tokens",
    "seed",
)


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the trace and the pool sizes: the same flags in vllm_host_tier.py, so both
    engines serve the same requests with the same GPU pool and host tier."""
    p.add_argument("--model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--sessions", type=int, default=16, help="chat sessions")
    p.add_argument("--history", type=int, default=8192, help="tokens of each initial history")
    p.add_argument("--rounds", type=int, default=3, help="rounds (round 0 builds the histories)")
    p.add_argument("--turn-tokens", type=int, default=64, help="new question per turn")
    p.add_argument("--new", type=int, default=16, help="answer tokens (EOS ignored)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--pool-tokens",
        type=int,
        default=None,
        help="GPU pool in tokens (default: sessions * history / 4, in whole blocks)",
    )
    p.add_argument(
        "--host-gib",
        type=float,
        default=None,
        help="host tier in GiB (default: every session's longest history + 25%%)",
    )
    p.add_argument("--max-batch", type=int, default=4, help="max_batch_size / max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="tier on/off")
    p.add_argument("--copy-reps", type=int, default=10, help="timed copies per reference")
    p.add_argument("--vllm-json", help="vllm_host_tier.py's --json output: vLLM's rows beside")
    p.add_argument(
        "--from-json",
        help="this script's own JSON of an earlier run (same lease): rewrite its report with "
        "--vllm-json beside it, running nothing",
    )
    p.add_argument("--out-dir", default=None, help=f"default {RESULTS_DIR} (--smoke: a temp dir)")
    p.add_argument("--name", default="host_tier")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="model tiny (fp32) on the CPU: history 64, 8 sessions, 2 rounds, turn 8, new 2",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.dtype, args.history, args.sessions = "tiny", "fp32", 64, 8
        args.rounds, args.turn_tokens, args.new, args.block_size = 2, 8, 2, 16
        args.copy_reps = 2
    return resolve_sizes(args)


# ------------------------------------------------------------------ sizes


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V of one token over every layer of the built-in shape ``model`` in ``dtype``."""
    from flashdec.models import BUILTIN_SHAPES

    shape = BUILTIN_SHAPES.get(model)
    if shape is None:
        raise ValueError(f"unknown built-in shape {model!r}; known: {', '.join(BUILTIN_SHAPES)}")
    c = shape.config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * itemsize


def longest_sequence(args) -> int:
    """A session's last turn, prompt + answer: the most tokens one request holds."""
    return args.history + args.new + (args.rounds - 1) * (args.turn_tokens + args.new)


def working_set_tokens(args) -> int:
    """The sessions' initial histories: the prefix working set the GPU pool is measured by."""
    return args.sessions * args.history


def resolve_sizes(args) -> argparse.Namespace:
    """Fill in ``pool_tokens`` (whole blocks, at least one longest request + a block) and
    ``host_gib``; ValueError for a pool too small for one request."""
    for name in ("sessions", "history", "turn_tokens", "new", "block_size", "max_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.rounds < 2:
        raise ValueError("--rounds must be >= 2 (round 0 builds the histories, unmeasured)")
    block = args.block_size
    least = (-(-longest_sequence(args) // block) + 1) * block
    if args.pool_tokens is None:
        quarter = int(working_set_tokens(args) // (WORKING_SET_TARGET * block)) * block
        args.pool_tokens = max(quarter, least)
    else:
        args.pool_tokens = args.pool_tokens // block * block
        if args.pool_tokens < least:
            raise ValueError(
                f"--pool-tokens {args.pool_tokens} holds no longest request "
                f"({longest_sequence(args)} tokens): at least {least}"
            )
    if args.host_gib is None:
        per_session = -(-longest_sequence(args) // block) * block
        nbytes = args.sessions * per_session * kv_bytes_per_token(args.model, args.dtype)
        args.host_gib = nbytes * HOST_SLACK / 2**30
    if args.host_gib <= 0:
        raise ValueError("--host-gib must be > 0")
    return args


# ------------------------------------------------------------------ the trace


@dataclass(frozen=True)
class ChatTrace:
    """Every session's round-0 prompt and the questions of its later rounds."""

    histories: list[list[int]]  # [session] -> the initial history (round 0's prompt)
    questions: list[list[list[int]]]  # [session][round - 1] -> that round's new question


def chat_trace(args, vocab: int) -> ChatTrace:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    histories = [tokens(args.history) for _ in range(args.sessions)]
    questions = [
        [tokens(args.turn_tokens) for _ in range(args.rounds - 1)] for _ in range(args.sessions)
    ]
    return ChatTrace(histories, questions)


def serve_round(engine, trace: ChatTrace, histories: list, rnd: int, new: int, label: str):
    """Serve round ``rnd`` of ``trace``: every session in order, one request at a time,
    appending prompt + answer to ``histories`` (a copy of ``trace.histories`` at round 0).
    ``engine`` is a ``flashdec.LLM`` or anything with the same ``add_request`` / ``step`` /
    ``has_unfinished`` / ``request_timing`` / ``release`` / ``prefix_cache_stats``
    (vllm_prefix.py's adapter). Returns a record per turn; prints a line per turn."""
    records = []
    for s in range(len(trace.histories)):
        prompt = list(histories[s]) + ([] if rnd == 0 else trace.questions[s][rnd - 1])
        before = engine.prefix_cache_stats()
        submitted = time.perf_counter()
        rid = engine.add_request(prompt, new, ignore_eos=True)
        while engine.has_unfinished():
            engine.step()
        timing = engine.request_timing(rid)
        answer = list(engine.release(rid))
        after = engine.prefix_cache_stats()
        if timing.first_token_at is None or len(answer) != new:
            raise RuntimeError(f"{label}: round {rnd} session {s} gave {len(answer)} of {new}")
        start = getattr(timing, "submitted_at", None) or submitted
        record = {
            "round": rnd,
            "session": s,
            "prompt_tokens": len(prompt),
            "ttft_ms": (timing.first_token_at - start) * 1e3,
            "tokens": len(answer),
        }
        for key in ("queried_tokens", "hit_tokens", "host_hit_tokens"):
            if before.get(key) is not None and after.get(key) is not None:
                record[key] = after[key] - before[key]
        records.append(record)
        histories[s] = prompt + answer
        host = record.get("host_hit_tokens")
        print(
            f"[{label}] round {rnd} session {s + 1}/{len(histories)}: prompt "
            f"{len(prompt)} tokens, TTFT {record['ttft_ms']:.1f} ms, hit "
            f"{record.get('hit_tokens', '?')}" + ("" if host is None else f" (host {host})"),
            flush=True,
        )
    return records


def warm_up(engine, args, vocab: int, label: str) -> None:
    """Two unmeasured turns of another session (seed + 1000): a history from scratch, then a
    follow-up that hits it, so that no measured turn compiles a kernel it is the first to use."""
    rng = random.Random(args.seed + 1000)
    history = [rng.randrange(vocab) for _ in range(args.history)]
    question = [rng.randrange(vocab) for _ in range(args.turn_tokens)]
    trace, histories = ChatTrace([history], [[question]]), [list(history)]
    for rnd in (0, 1):
        serve_round(engine, trace, histories, rnd, args.new, f"{label} warm-up")


def serve_trace(engine, args, trace: ChatTrace, vocab: int, label: str, stats=None):
    """The warm-up, round 0 (unmeasured), then the measured rounds, with ``stats()``
    (default: ``engine.prefix_cache_stats``) read around them. Returns the records of every
    round, the two readings and the measured rounds' wall seconds."""
    stats = stats or engine.prefix_cache_stats
    warm_up(engine, args, vocab, label)
    histories = [list(h) for h in trace.histories]
    records = serve_round(engine, trace, histories, 0, args.new, label)
    before = stats()
    start = time.perf_counter()
    for rnd in range(1, args.rounds):
        records += serve_round(engine, trace, histories, rnd, args.new, label)
    after = stats()
    return records, before, after, time.perf_counter() - start


# ------------------------------------------------------------------ FlashDec


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ttft_summary(records: list[dict]) -> dict:
    """TTFT p50/p90/p99 (ms) of the measured turns (rounds >= 1) and p50 per round."""
    measured = [r["ttft_ms"] for r in records if r["round"] >= 1]
    rounds = sorted({r["round"] for r in records})
    return {
        "turns": len(measured),
        "ttft_p50_ms": percentile(measured, 50),
        "ttft_p90_ms": percentile(measured, 90),
        "ttft_p99_ms": percentile(measured, 99),
        "ttft_p50_by_round_ms": [
            percentile([r["ttft_ms"] for r in records if r["round"] == k], 50) for k in rounds
        ],
    }


def host_pools(llm) -> list:
    """The host tier's pools (one per KV group), none when it is off."""
    cache = llm.engine.cache
    pools = [cache.layout._group(g).block_cache.host for g in range(len(cache.kv_groups))]
    return [p for p in pools if p is not None]


def settled_stats(llm) -> dict:
    """``prefix_cache_stats()`` after every copy enqueued so far completed (timings whole)."""
    for pool in host_pools(llm):
        pool.transfer.synchronize()
    return llm.prefix_cache_stats()


HOST_COUNTERS = (
    "blocks_down",
    "blocks_up",
    "bytes_down",
    "bytes_up",
    "copy_down_s",
    "copy_up_s",
    "dropped_blocks",
    "failed_down",
    "failed_up",
)


def gb_s(nbytes: float, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def mode_row(mode: str, records: list[dict], before: dict, after: dict, wall_s: float) -> dict:
    """A mode's figures over the measured rounds (counter differences around them)."""
    queried = after["queried_tokens"] - before["queried_tokens"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    row = {
        "mode": mode,
        **ttft_summary(records),
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_share": hit / queried if queried else 0.0,
        "gpu_hit_tokens": after["gpu_hit_tokens"] - before["gpu_hit_tokens"],
        "host_hit_tokens": after["host_hit_tokens"] - before["host_hit_tokens"],
        "evicted_blocks": after["evicted_blocks"] - before["evicted_blocks"],
        "measured_wall_s": wall_s,
        "host": None,
    }
    if after.get("host") is not None:
        host = {k: after["host"][k] - before["host"][k] for k in HOST_COUNTERS}
        host["capacity_blocks"] = after["host"]["capacity_blocks"]
        host["cached_blocks"] = after["host"]["cached_blocks"]
        host["down_gb_s"] = gb_s(host["bytes_down"], host["copy_down_s"])
        host["up_gb_s"] = gb_s(host["bytes_up"], host["copy_up_s"])
        host["whole_run"] = after["host"]  # round 0 included
        row["host"] = host
    row["records"] = records
    return row


def make_llm(args, model, host_gib: float):
    import flashdec

    return flashdec.LLM(
        model,
        block_size=args.block_size,
        num_blocks=args.pool_tokens // args.block_size,
        max_batch_size=args.max_batch,
        max_model_len=longest_sequence(args) + 64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        host_kv_cache_gib=host_gib,
    )


def direct_transfer(pools: list, n_blocks: int, reps: int) -> dict:
    """The tier's own ``BlockTransfer`` on ``n_blocks`` blocks (GPU blocks 0.., host slots 0..,
    one contiguous run), down then up: median seconds of the copy alone (the tier's events) and
    of the whole call with its gather/scatter (wall, synchronised), summed over the groups.
    Overwrites those blocks and slots: run it on an LLM about to be freed."""
    out = {"blocks": 0, "bytes": 0}
    for direction in ("down", "up"):
        out[f"copy_{direction}_s"] = out[f"wall_{direction}_s"] = 0.0
    for pool in pools:
        transfer = pool.transfer
        n = min(n_blocks, pool.capacity_blocks)
        ids = list(range(n))
        out["blocks"] += n
        out["bytes"] += n * pool.block_bytes
        for direction in ("down", "up"):
            copies, walls = [], []
            for i in range(reps + 2):  # two warm-up calls
                transfer.synchronize()
                torch.cuda.synchronize()
                base = getattr(transfer, f"seconds_{direction}")
                start = time.perf_counter()
                if direction == "down":
                    transfer.down(ids, ids)
                else:
                    transfer.up(ids, ids)
                transfer.synchronize()
                torch.cuda.synchronize()
                if i >= 2:
                    walls.append(time.perf_counter() - start)
                    copies.append(getattr(transfer, f"seconds_{direction}") - base)
            out[f"copy_{direction}_s"] += statistics.median(copies)
            out[f"wall_{direction}_s"] += statistics.median(walls)
    for direction in ("down", "up"):
        out[f"{direction}_gb_s"] = gb_s(out["bytes"], out[f"copy_{direction}_s"])
        out[f"wall_{direction}_gb_s"] = gb_s(out["bytes"], out[f"wall_{direction}_s"])
    return out


def plain_copy(nbytes: int, reps: int) -> dict:
    """A plain pinned ``copy_(non_blocking=True)`` of ``nbytes`` contiguous bytes each way:
    median seconds (CUDA events on the current stream) and GB/s."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out: dict = {"bytes": nbytes}
    for direction, dst, src in (("down", host, device), ("up", device, host)):
        times = []
        for i in range(reps + 2):
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(begin.elapsed_time(end) / 1e3)
        out[f"{direction}_s"] = statistics.median(times)
        out[f"{direction}_gb_s"] = gb_s(nbytes, out[f"{direction}_s"])
    del device, host
    return out


def run_mode(args, model, mode: str, trace: ChatTrace) -> dict:
    """One LLM serving the whole trace: round 0 (unmeasured), then the measured rounds."""
    label = f"tier {mode}"
    host_gib = args.host_gib if mode == "on" else 0.0
    build = time.perf_counter()
    llm = make_llm(args, model, host_gib)
    build_s = time.perf_counter() - build
    print(f"[{label}] LLM built in {build_s:.1f} s", flush=True)
    vocab = model.config.vocab_size
    records, before, after, wall_s = serve_trace(
        llm, args, trace, vocab, label, stats=functools.partial(settled_stats, llm)
    )
    row = mode_row(mode, records, before, after, wall_s)
    num_blocks = llm.engine.cache.max_blocks
    row.update(host_gib=host_gib, build_s=build_s, num_blocks=num_blocks)
    pools = host_pools(llm)
    row["host_block_bytes"] = sum(p.block_bytes for p in pools) if pools else None
    row["direct"] = None
    if pools and torch.cuda.is_available():
        n = min(args.history // args.block_size, num_blocks)
        try:  # the serving run's figures stand without it
            row["direct"] = direct_transfer(pools, n, args.copy_reps)
        except Exception as exc:
            row["direct_error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{label}] direct BlockTransfer calls failed: {row['direct_error']}", flush=True)
    summary = {k: v for k, v in row.items() if k not in ("records", "host")}
    print(f"[{label}] {json.dumps(summary, default=str)}", flush=True)
    del llm, pools
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run(args) -> tuple[list[dict], dict | None]:
    """Every mode, then the plain-copy reference (CUDA only, None otherwise)."""
    from flashdec.models import build_random_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_random_model(args.model, dtype=DTYPES[args.dtype], device=device, seed=0)
    trace = chat_trace(args, model.config.vocab_size)
    rows = [run_mode(args, model, mode, trace) for mode in args.modes]
    reference = None
    if device == "cuda":
        nbytes = (args.history // args.block_size) * args.block_size
        nbytes *= kv_bytes_per_token(args.model, args.dtype)
        try:
            reference = plain_copy(nbytes, args.copy_reps)
        except Exception as exc:  # reported as such: the copy targets are then not measured
            reference = {"bytes": nbytes, "error": f"{type(exc).__name__}: {exc}"}
        print(f"[plain copy_] {json.dumps(reference)}", flush=True)
    return rows, reference


# ------------------------------------------------------------------ report


def load_vllm(path: str, args) -> dict:
    """vllm_host_tier.py's JSON, checked to have served the same trace as this run."""
    return load_peer_run(path, args, TRACE_ARGS, "records", "vllm_host_tier.py")


def targets(args, rows: list[dict], reference: dict | None) -> list[dict]:
    """The issue's targets: each met (True), missed (False) or not measured (None)."""
    by_mode = {r["mode"]: r for r in rows}
    on, off = by_mode.get("on"), by_mode.get("off")
    goals = []
    ratio = working_set_tokens(args) / args.pool_tokens
    goals.append(
        goal(
            f"working set / GPU pool >= {WORKING_SET_TARGET:g}",
            ratio,
            WORKING_SET_TARGET,
            ratio >= WORKING_SET_TARGET,
            f"{ratio - WORKING_SET_TARGET:+.2f}x",
            f"{ratio:.2f}x",
        )
    )
    name = f"hit share with the tier >= {HIT_SHARE_TARGET:.2f}"
    if on is None:
        goals.append(goal(name, None, HIT_SHARE_TARGET, None, "tier on not run"))
    else:
        share = on["hit_share"]
        margin = f"{(share - HIT_SHARE_TARGET) * 100:+.1f} points"
        met = share >= HIT_SHARE_TARGET
        goals.append(goal(name, share, HIT_SHARE_TARGET, met, margin, f"{share:.3f}"))
    name = f"TTFT p50 tier off / on >= {TTFT_SPEEDUP_TARGET:g}"
    if on is None or off is None or not on["ttft_p50_ms"]:
        goals.append(goal(name, None, TTFT_SPEEDUP_TARGET, None, "needs both modes"))
    else:
        speedup = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        shown = f"{speedup:.2f}x ({off['ttft_p50_ms']:.1f} / {on['ttft_p50_ms']:.1f} ms)"
        met = speedup >= TTFT_SPEEDUP_TARGET
        margin = f"{speedup - TTFT_SPEEDUP_TARGET:+.2f}x"
        goals.append(goal(name, speedup, TTFT_SPEEDUP_TARGET, met, margin, shown))
    for direction, word in (("down", "GPU -> host"), ("up", "host -> GPU")):
        name = f"copy {direction} ({word}) >= {COPY_SHARE_TARGET:.0%} of a plain pinned copy_"
        tier = None if on is None or on["host"] is None else on["host"][f"{direction}_gb_s"]
        plain = None if reference is None else reference.get(f"{direction}_gb_s")
        if reference is None:
            goals.append(goal(name, None, COPY_SHARE_TARGET, None, "no CUDA: no reference"))
        elif not plain:
            goals.append(goal(name, None, COPY_SHARE_TARGET, None, "the reference failed"))
        elif not tier:
            goals.append(goal(name, None, COPY_SHARE_TARGET, None, f"no copy {direction} timed"))
        else:
            share = tier / plain
            margin = f"{(share - COPY_SHARE_TARGET) * 100:+.1f} points"
            shown = f"{share:.1%} ({tier:.1f} / {plain:.1f} GB/s)"
            goals.append(
                goal(name, share, COPY_SHARE_TARGET, share >= COPY_SHARE_TARGET, margin, shown)
            )
    return goals


def size_text(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 0.1 else f"{gib * 1024:.2f} MiB"


def vllm_label(vllm: dict) -> str:
    """vLLM's configuration, short: the offloading form, or "prefix caching only" (the reasons
    are listed beside the report's vLLM line)."""
    config = vllm.get("config") or "?"
    return "prefix caching only" if config.startswith("prefix caching only") else config


def _ms(value) -> str:
    return "—" if value is None else f"{value:.1f}"


def _gb(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _runs_table(rows: list[dict], vllm: dict | None) -> str:
    columns = ["engine", "host tier", "turns", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms"]
    columns += ["hit share", "GPU hit tokens", "host hit tokens", "evicted blocks", "wall s"]
    table = [
        [
            "FlashDec",
            f"on ({size_text(r['host_gib'])})" if r["mode"] == "on" else "off",
            r["turns"],
            _ms(r["ttft_p50_ms"]),
            _ms(r["ttft_p90_ms"]),
            _ms(r["ttft_p99_ms"]),
            f"{r['hit_share']:.3f}",
            r["gpu_hit_tokens"],
            r["host_hit_tokens"],
            r["evicted_blocks"],
            f"{r['measured_wall_s']:.2f}",
        ]
        for r in rows
    ]
    if vllm:
        s = vllm["summary"]
        share = s.get("hit_share")
        table.append(
            [
                f"vLLM {vllm.get('version', '?')}",
                vllm_label(vllm),
                s.get("turns"),
                _ms(s.get("ttft_p50_ms")),
                _ms(s.get("ttft_p90_ms")),
                _ms(s.get("ttft_p99_ms")),
                "—" if share is None else f"{share:.3f}",
                "—",
                "—",
                "—",
                "—" if s.get("measured_wall_s") is None else f"{s['measured_wall_s']:.2f}",
            ]
        )
    return markdown_table(columns, table)


def _copy_table(rows: list[dict], reference: dict | None, reps: int) -> tuple[str, str]:
    """The tier's traffic each way: the serving run's counters, then the direct calls."""
    on = next((r for r in rows if r["mode"] == "on"), None)
    if on is None or on["host"] is None:
        return "", "tier on not run"
    host, direct = on["host"], on["direct"]
    columns = ["copies", "direction", "blocks", "moved", "copy s", "GB/s", "plain copy_ GB/s"]
    columns += ["share of plain", "failed"]
    table = []
    for direction in ("down", "up"):
        plain = None if reference is None else reference.get(f"{direction}_gb_s")
        tier = host[f"{direction}_gb_s"]
        table.append(
            [
                "serving run (prefix_cache_stats)",
                direction,
                host[f"blocks_{direction}"],
                size_text(host[f"bytes_{direction}"] / 2**30),
                f"{host[f'copy_{direction}_s']:.4f}",
                _gb(tier),
                _gb(plain),
                "—" if not (tier and plain) else f"{tier / plain:.1%}",
                host[f"failed_{direction}"],
            ]
        )
    for direction in ("down", "up") if direct else ():
        plain = None if reference is None else reference.get(f"{direction}_gb_s")
        tier = direct[f"{direction}_gb_s"]
        table.append(
            [
                "direct BlockTransfer call (copy only / with gather)",
                direction,
                direct["blocks"],
                size_text(direct["bytes"] / 2**30),
                f"{direct[f'copy_{direction}_s']:.4f}",
                f"{_gb(tier)} / {_gb(direct[f'wall_{direction}_gb_s'])}",
                _gb(plain),
                "—" if not (tier and plain) else f"{tier / plain:.1%}",
                "—",
            ]
        )
    if reference is None:
        note = "No CUDA: the plain pinned copy_ reference and the direct BlockTransfer calls "
        note += "are skipped (CPU copies are synchronous; their GB/s mean little)."
    else:
        note = (
            "Direct BlockTransfer calls: the tier's own transfer on one history's blocks (GPU "
            f"blocks and host slots 0.., one contiguous run), median of {reps}; GB/s of the copy "
            "alone (its events) / of the call with its gather or scatter (wall, synchronised)."
        )
    if on.get("direct_error"):
        note += f" The direct BlockTransfer calls failed: {on['direct_error']}."
    return markdown_table(columns, table), note


def report(args, env: dict, rows: list[dict], reference, vllm: dict | None = None) -> str:
    goals = targets(args, rows, reference)
    kvbpt = kv_bytes_per_token(args.model, args.dtype)
    ws = working_set_tokens(args)
    on = next((r for r in rows if r["mode"] == "on"), None)
    host_line = f"- host tier (mode on): {size_text(args.host_gib)} pinned"
    if on is not None and on["host"] is not None:
        host_line += f" = {on['host']['capacity_blocks']} blocks of {on['host_block_bytes']} B"
        host_line += f" ({on['host']['dropped_blocks']} dropped by its LRU in the measured rounds)"
        measured = on["host_block_bytes"] // args.block_size
        if measured != kvbpt:
            host_line += f" (measured {measured} B/token, expected {kvbpt})"
    host_line += (
        f"; default: every session's longest history ({longest_sequence(args)} tokens) at "
        f"{kvbpt / 1024:g} KiB/token + {HOST_SLACK - 1:.0%}"
    )
    vllm_line = "- vLLM: not given (--vllm-json)"
    if vllm:
        vllm_line = (
            f"- vLLM {vllm.get('version', '?')} on {vllm.get('gpu')}: **{vllm_label(vllm)}**; "
            f"num_gpu_blocks_override {vllm.get('num_gpu_blocks')}, block size "
            f"{vllm.get('block_size')}"
        )
        errors = vllm.get("offload_errors") or []
        if not errors and not vllm.get("offloading", True):
            vllm_line += " (offloading not tried: --offload off)"
        for error in errors:
            vllm_line += f"\n  - offloading tried, failed: {error}"
    reference_line = "- plain pinned copy_ reference: no CUDA (skipped)"
    if reference is not None and "error" in reference:
        reference_line = f"- plain pinned copy_ reference: failed ({reference['error']})"
    elif reference is not None:
        reference_line = (
            f"- plain pinned copy_ reference ({reference['bytes'] / 2**30:.3f} GiB: one history's "
            f"blocks, contiguous; median of {args.copy_reps}): down "
            f"{reference['down_gb_s']:.1f} GB/s, up {reference['up_gb_s']:.1f} GB/s"
        )
    copy_table, copy_note = _copy_table(rows, reference, args.copy_reps)
    rounds_cols = ["engine", "host tier"] + [f"round {k}" for k in range(args.rounds)]
    rounds_rows = [
        ["FlashDec", r["mode"], *[_ms(v) for v in r["ttft_p50_by_round_ms"]]] for r in rows
    ]
    if vllm:
        by_round = vllm["summary"].get("ttft_p50_by_round_ms") or []
        rounds_rows.append([f"vLLM {vllm.get('version', '?')}", vllm_label(vllm)])
        rounds_rows[-1] += [_ms(v) for v in by_round]
    lines = [
        f"# Host tier of prefix caching: a multi-turn chat beyond the GPU pool ({args.model})",
        "",
        environment_markdown(env),
        *(
            [
                "- **smoke run** (CPU, tiny sizes): checks the script end to end; its numbers "
                "judge nothing"
            ]
            if args.smoke
            else []
        ),
        vllm_line,
        f"- model: {args.model}, {args.dtype}, random weights; greedy, EOS ignored, seed "
        f"{args.seed}",
        f"- trace: {args.sessions} sessions, each a {args.history}-token history; round 0 serves "
        f"the histories (unmeasured: builds them, warms up), then {args.rounds - 1} measured "
        f"round(s) visit the sessions round-robin: prompt = history + {args.turn_tokens} new "
        f"tokens, answer {args.new} tokens; one request at a time (TTFT = first token on the "
        "host - submission)",
        f"- GPU pool: {args.pool_tokens // args.block_size} blocks of {args.block_size} = "
        f"{args.pool_tokens} tokens; working set {args.sessions} x {args.history} = {ws} tokens "
        f"= **{ws / args.pool_tokens:.2f}x the pool**",
        host_line,
        "- hit share = hit tokens / prompt tokens looked up over the measured rounds; copy GB/s "
        "= bytes / copy seconds (the tier's CUDA events on its side stream, completed copies)",
        reference_line,
        "",
        "## Runs (measured rounds)",
        "",
        _runs_table(rows, vllm),
        "",
        "TTFT p50 (ms) per round (round 0: the histories, all misses):",
        "",
        markdown_table(rounds_cols, rounds_rows),
        "",
        "## Host tier copies (tier on, measured rounds)",
        "",
        *([copy_table, ""] if copy_table else []),
        copy_note,
        "",
        "## Targets",
        "",
        *goals_section(goals),
    ]
    if vllm and any(r["mode"] == "on" for r in rows) and vllm["summary"].get("ttft_p50_ms"):
        on_p50 = next(r for r in rows if r["mode"] == "on")["ttft_p50_ms"]
        theirs = vllm["summary"]["ttft_p50_ms"]
        lines += [
            "",
            f"Beside vLLM ({vllm_label(vllm)}): FlashDec's TTFT p50 with the tier is "
            f"{on_p50:.1f} ms, vLLM's {theirs:.1f} ms (vLLM's / FlashDec's: "
            f"{theirs / on_p50:.2f}x).",
        ]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], vllm: dict | None) -> Path | None:
    series = {
        f"FlashDec tier {r['mode']}": [r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"]]
        for r in rows
    }
    if vllm:
        s = vllm["summary"]
        series[f"vLLM ({vllm_label(vllm)[:40]})"] = [
            s.get("ttft_p50_ms"),
            s.get("ttft_p90_ms"),
            s.get("ttft_p99_ms"),
        ]
    return bar_plot(path, ["p50", "p90", "p99"], series, "TTFT ms", "TTFT of revisited sessions")


def main(argv: list[str] | None = None) -> None:
    has_gpu = use_interpreter_without_gpu()  # before flashdec imports Triton
    args = parse_args(argv)
    vllm = load_vllm(args.vllm_json, args) if args.vllm_json else None  # before the runs
    if not has_gpu and not args.from_json:
        if not args.smoke:
            raise SystemExit("bench_host_tier.py needs a CUDA GPU (or --smoke)")
        torch.set_num_threads(1)  # tiny tensors: intra-op threads only add contention
    out_dir = Path(args.out_dir or (tempfile.mkdtemp() if args.smoke else RESULTS_DIR))
    if args.from_json:  # the runs of an earlier call: their environment, not this machine's
        earlier = json.loads(Path(args.from_json).read_text())
        env, rows, reference = earlier["environment"], earlier["rows"], earlier["reference"]
        if any(earlier["args"].get(k) != getattr(args, k) for k in TRACE_ARGS):
            raise SystemExit(f"{args.from_json} ran another trace: pass its flags again")
    else:
        env = environment()
        rows, reference = run(args)
    markdown = report(args, env, rows, reference, vllm)
    payload = {"environment": env, "args": vars(args), "rows": rows, "reference": reference}
    payload.update(vllm=vllm, targets=targets(args, rows, reference))
    payload["kv_bytes_per_token"] = kv_bytes_per_token(args.model, args.dtype)
    md_path, _ = write_results(args.name, markdown, payload, out_dir)
    plot(out_dir / f"{args.name}.png", rows, vllm)
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
