"""One scheduling round through the engine's public API, against the waiting queue's length (CPU).

Issue 8's measurement: 64 requests running, N waiting, and one round =
``engine.scheduling_snapshot`` + ``BlockAwareScheduler.plan`` + ``engine.apply_scheduler_decision``
(which rebuilds the snapshot from the live engine, compares, re-plans with the canonical policy
and compares again before it admits anything). Also timed: the serving loop's round — the same
snapshot and plan, then ``apply_trusted_decision`` and ``advance_fairness`` (it planned the
decision itself from the live state, so it does not plan twice). Between rounds the 64 running
requests decode one token (a real engine step on a one-layer CPU cache: untimed), so every
round sees changed lengths, as in serving.

Waiting requests need more blocks than are free, so they stay queued (the round's cost is then
the queue's, not an admission's). Median, p90 and p99 of the round in ms.

    PYTHONPATH=. python3 benchmarks/bench_engine_scheduling.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    environment,
    environment_markdown,
    markdown_table,
    write_results,
)
from flashdec import BlockAwareScheduler, DecodeEngine, PagedKVCache, RequestSpec, SchedulerConfig

BLOCK_SIZE = 16
POOL_BLOCKS = 2048
RUNNING = 64


def build(num_waiting: int) -> tuple[DecodeEngine, BlockAwareScheduler]:
    cache = PagedKVCache(
        1,
        1,
        2,
        BLOCK_SIZE,
        POOL_BLOCKS,
        dtype=torch.float32,
        device="cpu",
        max_blocks_per_seq=POOL_BLOCKS,
    )
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    scheduler = BlockAwareScheduler(SchedulerConfig(max_active_requests=128, max_batch_size=64))
    # 64 running requests of 16 lifetime blocks each (1,024 blocks committed), admitted first
    for i in range(RUNNING):
        engine.submit_request(RequestSpec(f"run{i}", 16, 240, i))
    snapshot = engine.scheduling_snapshot(0)
    engine.submissions.apply_trusted_decision(scheduler.plan(snapshot))
    # waiting requests of 1,100 blocks: they fit an empty pool, never beside the running ones
    for i in range(num_waiting):
        engine.submit_request(RequestSpec(f"wait{i}", 17_000, 600, RUNNING + i))
    return engine, scheduler


def decode_step(engine: DecodeEngine, batch: tuple) -> None:
    n = len(batch)
    zeros = torch.zeros(n, 1, 2)
    engine.step(list(batch), zeros, zeros, zeros)


def measure(num_waiting: int, rounds: int) -> dict:
    engine, scheduler = build(num_waiting)
    public, loop = [], []
    for step in range(1, 2 * rounds + 1):
        start = time.perf_counter()
        snapshot = engine.scheduling_snapshot(step)
        decision = scheduler.plan(snapshot)
        if step % 2:
            engine.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snapshot)
            public.append(time.perf_counter() - start)
        else:
            engine.submissions.apply_trusted_decision(decision)
            engine.submissions.advance_fairness(decision, served=set(decision.batch), departed=())
            loop.append(time.perf_counter() - start)
        assert not decision.admit and len(decision.batch) == RUNNING
        decode_step(engine, decision.batch)

    def stats(times: list[float]) -> dict:
        ordered = sorted(times)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
        return {
            "median_ms": statistics.median(times) * 1e3,
            "p90_ms": pick(0.9),
            "p99_ms": pick(0.99),
        }

    return {"waiting": num_waiting, "public": stats(public), "loop": stats(loop)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[100, 1_000, 10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="engine_scheduling")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in args.waiting:
        row = measure(n, args.rounds)
        rows.append(row)
        print(
            f"N={n:>7}: public round {row['public']['median_ms']:.3f} ms "
            f"(p99 {row['public']['p99_ms']:.3f}), loop round "
            f"{row['loop']['median_ms']:.3f} ms",
            flush=True,
        )
    env = environment()
    table = markdown_table(
        [
            "waiting",
            "snapshot + plan + apply: median ms",
            "p90 ms",
            "p99 ms",
            "loop round (trusted apply + counters): median ms",
            "p99 ms",
        ],
        [
            [
                r["waiting"],
                r["public"]["median_ms"],
                r["public"]["p90_ms"],
                r["public"]["p99_ms"],
                r["loop"]["median_ms"],
                r["loop"]["p99_ms"],
            ]
            for r in rows
        ],
    )
    at_10k = next((r for r in rows if r["waiting"] == 10_000), None)
    verdict = (
        f"At 10,000 waiting and 64 running: {at_10k['public']['median_ms']:.3f} ms per round "
        f"({'meets' if at_10k['public']['median_ms'] <= 1 else 'misses'} the ≤ 1 ms target; "
        f"p99 {at_10k['public']['p99_ms']:.3f} ms). Before this work the same round took 1.5 / "
        "8.4 / 85 ms at 100 / 1,000 / 10,000 waiting (issue 8)."
        if at_10k
        else ""
    )
    markdown = f"""# Scheduling round through the engine vs waiting-queue length (CPU)

{environment_markdown(env)}
- {RUNNING} running requests decoding one token per round, N waiting requests that do not fit
  beside them; {args.rounds} rounds of each kind per N.

{verdict}

{table}
"""
    out_dir = Path(args.out_dir)
    md, js = write_results(args.name, markdown, {"env": env, "rows": rows}, out_dir)
    bar_plot(
        out_dir / f"{args.name}.png",
        [f"N={r['waiting']:,}" for r in rows],
        {
            "snapshot + plan + apply (public)": [r["public"]["median_ms"] for r in rows],
            "loop round": [r["loop"]["median_ms"] for r in rows],
        },
        "ms per round (median)",
        "Scheduling round vs waiting requests (64 running)",
        hline=1.0,
    )
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
