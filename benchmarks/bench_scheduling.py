"""Scheduling cost against the length of the waiting queue (scheduler level, CPU).

One round is what a serving loop does each step with 64 requests running and N waiting:

- **snapshot**: an ``ActiveRequest`` for each active request whose length changed (the decoded
  batch; the others are reused), and a ``SchedulingSnapshot`` on ``WaitingQueue.view()``;
- **plan**: ``BlockAwareScheduler.plan``;
- **check**: what an applier does before it mutates anything — rebuild the snapshot from the
  same state, compare it with the caller's, re-plan with the canonical policy, compare decisions;
- **update**: remove the admitted and rejected requests from the queue and ``advance`` it.

Arrivals that keep the queue at N (one ``submit`` each) are timed apart, per submission.

The pool is 4,096 blocks of 16 tokens; about 64 requests run (up to 64 decode per round).
Waiting requests are a mix: 88 % small (32–512 prompt tokens: they fit beside the running ones
and are admitted, by backfilling when needed), 10 % large (2,000–12,000 tokens, hundreds of
blocks: they wait, are overtaken, age, and then hold back later arrivals until they fit), 2 %
larger than the empty pool (rejected). Every request decodes 8–56 tokens, one per round.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_scheduling.py
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    environment,
    environment_markdown,
    markdown_table,
    write_results,
)
from flashdec.scheduler import (
    ActiveRequest,
    BlockAwareScheduler,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
    WaitingQueue,
    lifetime_private_blocks,
)
from flashdec.scheduler.spec import ceil_div

BLOCK_SIZE = 16
TOTAL_BLOCKS = 4096
MAX_BLOCKS_PER_SEQ = 4096
NUM_ACTIVE = 64  # at the start; the pool keeps it near 64 (the mean is reported)
# the pool, not the slot cap, bounds the running requests, so admissions keep happening
CONFIG = SchedulerConfig(max_active_requests=128, max_batch_size=64, reserve_blocks=16)
SMALL, LARGE = 0.88, 0.10  # of arrivals; the rest can never fit
PARTS = ("snapshot", "plan", "check", "update")
TARGET_US = 1000.0  # issue 8: <= 1 ms per round at 10,000 waiting


class Loop:
    """A scheduler-level serving loop over a ``WaitingQueue`` (no cache, no tensors)."""

    def __init__(self, num_waiting: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.order = 0
        self.step = 0
        self.queue = WaitingQueue()
        self.scheduler = BlockAwareScheduler(CONFIG)
        # rid -> [spec, committed tokens, its ActiveRequest (None once stale), lifetime blocks]
        self.active: dict[Any, list] = {}
        self.used_private = 0
        for _ in range(NUM_ACTIVE):
            spec = self._spec(self.rng.randint(32, 512), self.rng.randint(8, 56))
            self._activate(spec, spec.initial_context_tokens + self.rng.randint(0, 7))
        for _ in range(num_waiting):
            self.arrive()

    def _spec(self, context: int, new: int) -> RequestSpec:
        self.order += 1
        return RequestSpec(f"r{self.order}", context, new, self.order)

    def arrive(self) -> None:
        kind = self.rng.random()
        if kind < SMALL:  # fits beside the running requests
            spec = self._spec(self.rng.randint(32, 512), self.rng.randint(8, 56))
        elif kind < SMALL + LARGE:  # waits for room, ages
            spec = self._spec(self.rng.randint(2_000, 12_000), self.rng.randint(8, 56))
        else:  # larger than the empty pool: rejected
            spec = self._spec(80_000, 64)
        self.queue.submit(spec, block_size=BLOCK_SIZE)

    def _activate(self, spec: RequestSpec, tokens: int) -> None:
        lifetime = lifetime_private_blocks(spec, BLOCK_SIZE, {})
        self.active[spec.request_id] = [spec, tokens, None, lifetime]
        self.used_private += ceil_div(tokens, BLOCK_SIZE)

    def snapshot(self) -> SchedulingSnapshot:
        rows = []
        self.new_rows = 0
        for entry in self.active.values():
            if entry[2] is None:  # new or decoded since the last round
                spec, tokens, _, lifetime = entry
                blocks = ceil_div(tokens, BLOCK_SIZE)
                entry[2] = ActiveRequest(spec.request_id, spec, tokens, blocks, blocks, lifetime)
                self.new_rows += 1
            rows.append(entry[2])
        return SchedulingSnapshot(
            step=self.step,
            cache_version=self.step,
            block_size=BLOCK_SIZE,
            total_blocks=TOTAL_BLOCKS,
            free_blocks=TOTAL_BLOCKS - self.used_private,
            max_blocks_per_seq=MAX_BLOCKS_PER_SEQ,
            active=tuple(rows),
            waiting=self.queue.view(),
        )

    def round(self) -> dict[str, float]:
        """One timed round (µs per part), then the untimed decode step and the arrivals."""
        t0 = time.perf_counter_ns()
        snapshot = self.snapshot()
        new_rows = self.new_rows
        t1 = time.perf_counter_ns()
        decision = self.scheduler.plan(snapshot)
        t2 = time.perf_counter_ns()
        live = self.snapshot()
        if live != snapshot:
            raise RuntimeError("stale snapshot")
        if BlockAwareScheduler(CONFIG).plan(live) != decision:
            raise RuntimeError("decision is not canonical")
        t3 = time.perf_counter_ns()
        waiting = snapshot.waiting_view
        newest = None
        admitted = []
        for rid in decision.admit:
            admitted.append(self.queue.remove(rid))
            newest = admitted[-1].submission_order
        for rid in decision.reject:
            self.queue.remove(rid)
        self.queue.advance(newest)
        t4 = time.perf_counter_ns()

        # the decode step: admitted requests import their context, the batch decodes a token
        for spec in admitted:
            self._activate(spec, spec.initial_context_tokens)
        for rid in decision.batch:
            entry = self.active[rid]
            if entry[1] % BLOCK_SIZE == 0:
                self.used_private += 1
            entry[1] += 1
            entry[2] = None
            if entry[1] == entry[0].total_tokens:
                del self.active[rid]
                self.used_private -= ceil_div(entry[1], BLOCK_SIZE)
        self.step += 1
        t5 = time.perf_counter_ns()
        for _ in range(len(decision.admit) + len(decision.reject)):
            self.arrive()
        t6 = time.perf_counter_ns()
        arrivals = len(decision.admit) + len(decision.reject)
        return {
            "snapshot": (t1 - t0) / 1e3,
            "plan": (t2 - t1) / 1e3,
            "check": (t3 - t2) / 1e3,
            "update": (t4 - t3) / 1e3,
            "round": (t4 - t0) / 1e3,
            "submit": (t6 - t5) / 1e3 / arrivals if arrivals else None,
            "admitted": len(decision.admit),
            "rejected": len(decision.reject),
            "aged": waiting.first_aged(0, CONFIG.aging_threshold) is not None,
            "active": len(snapshot.active),
            "new_rows": new_rows,
        }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(num_waiting: int, warmup: int, rounds: int, seed: int) -> dict[str, Any]:
    loop = Loop(num_waiting, seed)
    for _ in range(warmup):
        loop.round()
    samples = [loop.round() for _ in range(rounds)]
    submits = [s["submit"] for s in samples if s["submit"] is not None]
    rounds_us = [s["round"] for s in samples]
    p99 = percentile(rounds_us, 0.99)
    return {
        "waiting": num_waiting,
        "rounds": rounds,
        **{f"{p}_us": statistics.median(s[p] for s in samples) for p in PARTS},
        "round_us": statistics.median(rounds_us),
        "round_p90_us": percentile(rounds_us, 0.90),
        "round_p99_us": p99,
        "admitted_in_slowest_1pct": statistics.fmean(
            s["admitted"] for s in samples if s["round"] >= p99
        ),
        "submit_us": statistics.median(submits) if submits else None,
        "admitted_per_round": statistics.fmean(s["admitted"] for s in samples),
        "rejected_per_round": statistics.fmean(s["rejected"] for s in samples),
        "aged_rounds": statistics.fmean(s["aged"] for s in samples),
        "active_mean": statistics.fmean(s["active"] for s in samples),
        "new_rows_mean": statistics.fmean(s["new_rows"] for s in samples),
        "waiting_after": len(loop.queue),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[100, 1_000, 10_000, 100_000])
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    rows = []
    for n in args.waiting:
        gc.collect()
        result = measure(n, args.warmup, args.rounds, args.seed)
        rows.append(result)
        print(
            f"N={n:>7}: round {result['round_us']:7.1f} us (p99 {result['round_p99_us']:7.1f}) "
            + " ".join(f"{p} {result[p + '_us']:6.1f}" for p in PARTS),
            flush=True,
        )

    env = environment()
    env["cpu"] = {"processor": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    table = markdown_table(
        (
            "waiting",
            "round µs (median)",
            "p90 / p99 µs",
            *(f"{p} µs" for p in PARTS),
            "submit µs",
            "running / new rows (mean)",
            "admitted / rejected per round",
            "rounds with an aged request",
        ),
        [
            (
                f"{r['waiting']:,}",
                f"{r['round_us']:.0f}",
                f"{r['round_p90_us']:.0f} / {r['round_p99_us']:.0f}",
                *(f"{r[p + '_us']:.0f}" for p in PARTS),
                f"{r['submit_us']:.1f}" if r["submit_us"] is not None else "—",
                f"{r['active_mean']:.0f} / {r['new_rows_mean']:.0f}",
                f"{r['admitted_per_round']:.2f} / {r['rejected_per_round']:.2f}",
                f"{100 * r['aged_rounds']:.0f}%",
            )
            for r in rows
        ],
    )
    markdown = "\n".join(
        [
            "# Scheduling cost against the waiting queue (scheduler level, CPU)",
            "",
            environment_markdown(env),
            f"- CPU: {env['cpu']['processor']}, {env['cpu']['cores']} cores; "
            f"{args.warmup} warm-up rounds, {args.rounds} timed rounds per queue length",
            "",
            "One round with 64 running requests and N waiting: **snapshot** (new "
            "`ActiveRequest` rows for the decoded batch, a `SchedulingSnapshot` on "
            "`WaitingQueue.view()`), **plan** (`BlockAwareScheduler.plan`), **check** (what an "
            "applier does: rebuild the snapshot, compare, re-plan canonically, compare), "
            "**update** (remove the admitted and rejected, `advance`). Arrivals that keep the "
            "queue at N are timed apart (**submit**, per request). Target (issue 8): "
            f"≤ {TARGET_US:.0f} µs per round at 10,000 waiting.",
            "",
            table,
            "",
            "The queue holds 88 % small requests, 10 % large ones (they age and then hold back "
            "later arrivals until they fit) and 2 % that can never fit (rejected); see the "
            "module docstring. Most of a round is per running request: the new `ActiveRequest` "
            "rows of the decoded batch (column *new rows*) and their checks. The slowest rounds "
            "are those that admit many requests at once (the slowest 1 % admitted "
            + ", ".join(f"{r['admitted_in_slowest_1pct']:.0f}" for r in rows)
            + " on average, by queue length): the cost follows what is admitted, not N.",
            "",
            "Before this change the same round, measured at the engine level (snapshot + plan + "
            "apply, 64 running), took 1.5 ms at 100 waiting, 8.4 ms at 1,000 and 85 ms at "
            "10,000 (issue 8); those numbers include the engine's own work and are not from "
            "this script.",
        ]
    )
    write_results("scheduling", markdown, {"environment": env, "rows": rows}, args.out_dir)
    bar_plot(
        Path(args.out_dir) / "scheduling.png",
        [f"{r['waiting']:,}" for r in rows],
        {p: [r[p + "_us"] for r in rows] for p in (*PARTS, "round")},
        "µs per round (median)",
        "Scheduling round vs waiting requests (64 running, CPU)",
        hline=TARGET_US,
    )


if __name__ == "__main__":
    main()
