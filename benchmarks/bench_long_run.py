"""Long-running cost (CPU): does a serving round or the memory grow with every request served?

Issue 19 §1. Two measurements, both on a one-layer CPU cache of tiny heads (what a round costs
on the host does not depend on the K/V size):

(a) **Round cost after F finished requests.** F requests are first admitted and finished (0 /
    10k / 100k), then 64 requests run and 1,000 wait that never fit beside them. One round =
    ``scheduling_snapshot`` + ``plan`` + apply, timed two ways: the serving loop's (trusted
    apply + ``advance_fairness``) and the public one (``apply_scheduler_decision``, which
    rebuilds the snapshot and re-plans before it admits). Between rounds the 64 decode one token
    (untimed). Also timed: ``validate_invariants()``; and the memory the F finished requests
    keep (``tracemalloc``: Python and NumPy allocations still live after the fill, per request).

(b) **Soak**, run first (so its resident memory is its own). At least 200,000 requests (int
    ids, as ``flashdec.LLM`` numbers them; ``--soak-ids str`` for str ids) through
    :class:`ServingLoop` with the cheapest executor (zero K/V appended through the cache, no
    attention); the backlog is topped up to 64 running + ``--backlog`` waiting; invariants
    every 1,000 steps. Reported: the step's p50 (and the round's, ``schedule_s``) in the first
    and the last tenth of the steps, and the resident memory (RSS) over time.

    PYTHONPATH=. python benchmarks/bench_long_run.py                     # both parts
    PYTHONPATH=. python benchmarks/bench_long_run.py --flashdec-root /tmp/before --label before \
        --out-dir /tmp/long_run_before                                   # an earlier tree
    PYTHONPATH=. python benchmarks/bench_long_run.py --before /tmp/long_run_before/long_run.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    import_flashdec,
    line_events,
    markdown_table,
    write_results,
)

BLOCK_SIZE = 16
POOL_BLOCKS = 2048
TABLE_WIDTH = 128  # blocks per request (2,048 tokens)
RUNNING = 64
HEADS, DIM = 1, 2
TRACED_STEPS = 20  # of every --check-every soak steps: Python lines counted, not timed


def rss_mib() -> float:
    """Resident memory of this process now (Linux), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_engine(fd, num_blocks: int, width: int):
    cache = fd.PagedKVCache(
        1,
        HEADS,
        DIM,
        BLOCK_SIZE,
        num_blocks,
        dtype=torch.float32,
        device="cpu",
        max_blocks_per_seq=width,
    )
    return fd.DecodeEngine(cache, append_backend="torch", decode_backend="torch")


def fill_finished(fd, engine, count: int, *, first_order: int = 0) -> int:
    """Admit and finish ``count`` one-token requests, 1,000 at a time; returns the next order."""
    scheduler = fd.BlockAwareScheduler(
        fd.SchedulerConfig(max_active_requests=1000, max_batch_size=1000)
    )
    order = first_order
    while count > 0:
        n = min(1000, count)
        for _ in range(n):
            engine.submit_request(fd.RequestSpec(f"done{order}", 1, 1, order))
            order += 1
        decision = scheduler.plan(engine.scheduling_snapshot(0))
        engine.submissions.apply_trusted_decision(decision)
        assert len(decision.admit) == n
        for rid in decision.admit:
            engine.finish_request(rid)
        count -= n
    return order


def decode_step(engine, batch: tuple) -> None:
    zeros = torch.zeros(len(batch), HEADS, DIM)
    engine.step(list(batch), zeros, zeros, zeros)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_rounds(fd, finished: int, waiting: int, rounds: int) -> dict:
    engine = make_engine(fd, POOL_BLOCKS, TABLE_WIDTH)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    order = fill_finished(fd, engine, finished)
    fill_s = time.perf_counter() - t0
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # 64 running of 31 lifetime blocks (1,984 of 2,048 committed), then waiting requests of 100
    # blocks each: they fit an empty pool, never beside the running ones
    scheduler = fd.BlockAwareScheduler(
        fd.SchedulerConfig(max_active_requests=128, max_batch_size=RUNNING)
    )
    for i in range(RUNNING):
        engine.submit_request(fd.RequestSpec(f"run{i}", 16, 480, order))
        order += 1
    engine.submissions.apply_trusted_decision(scheduler.plan(engine.scheduling_snapshot(0)))
    for i in range(waiting):
        engine.submit_request(fd.RequestSpec(f"wait{i}", 1000, 600, order))
        order += 1
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
        assert not decision.admit and len(decision.batch) == RUNNING, decision
        decode_step(engine, decision.batch)
    checks = []
    for _ in range(max(3, rounds // 10)):
        start = time.perf_counter()
        engine.cache.validate_invariants()
        checks.append(time.perf_counter() - start)
    return {
        "finished": finished,
        "waiting": waiting,
        "fill_s": fill_s,
        "kept_bytes_per_finished": kept / finished if finished else None,
        "loop_round_ms": statistics.median(loop) * 1e3,
        "loop_round_p90_ms": percentile(loop, 0.9) * 1e3,
        "public_round_ms": statistics.median(public) * 1e3,
        "validate_ms": statistics.median(checks) * 1e3,
    }


class ZeroKV:
    """The cheapest executor: zero K/V appended through the cache's token transactions (one
    layer, tiny heads), no attention computed — a round's bookkeeping is what is measured."""

    def __init__(self, engine) -> None:
        self.cache = engine.cache
        self.zeros = torch.zeros(4096, HEADS, DIM)

    def _append(self, tx, rows: int) -> None:
        kv = self.zeros[:rows]
        self.cache.write_token_layer(tx, 0, kv, kv)
        self.cache.commit_token(tx)

    def prefill(self, requests) -> None:
        counts = [n for _, n in requests]
        self._append(self.cache.begin_tokens([rid for rid, _ in requests], counts), sum(counts))

    def decode(self, batch) -> tuple:
        self._append(self.cache.begin_token(list(batch)), len(batch))
        return ()

    def run(self, batch, chunks) -> tuple:
        # the loop's one call per step (StepExecutor.run), written out: the "before" run imports
        # a flashdec that has no StepExecutor to inherit it from
        done = set(self.prefill(chunks) or ()) if chunks else set()
        return done, (self.decode(batch) if batch else ())


def traced_step(loop):
    """One loop step and the Python lines it executed."""
    out = []
    lines = line_events(lambda: out.append(loop.step()))
    return out[0], lines


def soak(
    fd, total: int, backlog: int, check_every: int, seed: int, progress_every: int, ids: str
) -> dict:
    from flashdec.engine.loop import ServingLoop

    engine = make_engine(fd, 1024, 8)  # requests of at most 8 blocks (128 tokens)
    scheduler = fd.BlockAwareScheduler(
        fd.SchedulerConfig(max_active_requests=RUNNING, max_batch_size=RUNNING)
    )
    loop = ServingLoop(engine, scheduler, ZeroKV(engine))
    rng = random.Random(seed)
    submitted = finished = 0
    step_s, step_cpu_s, schedule_s, samples, checks = [], [], [], [], []
    traced: list[tuple[int, int]] = []  # (lines, admitted) of the traced steps since a sample
    start = time.perf_counter()
    rss0 = rss_mib()
    while finished < total:
        while submitted < total and loop.num_live < RUNNING + backlog:
            # int ids (as flashdec.LLM numbers its requests) or str ids; int orders
            ctx, new = rng.randint(1, 32), rng.randint(1, 8)
            rid = submitted if ids == "int" else f"req-{submitted}"
            loop.submit(fd.RequestSpec(rid, ctx, new, submitted))
            submitted += 1
        if loop.step_index % check_every < TRACED_STEPS:  # counted, not timed
            record, lines = traced_step(loop)
            traced.append((lines, len(record.admitted)))
        else:
            t0, c0 = time.perf_counter(), time.thread_time()
            record = loop.step()
            step_s.append(time.perf_counter() - t0)
            step_cpu_s.append(time.thread_time() - c0)  # not counting time other processes took
            schedule_s.append(record.schedule_s)
        finished += len(record.finished)
        if record.rejected or record.cancelled:
            raise RuntimeError(f"soak step {record.step} rejected/cancelled: {record}")
        if loop.step_index % check_every == 0:
            t0 = time.perf_counter()
            engine.cache.validate_invariants()
            checks.append(time.perf_counter() - t0)
            samples.append(
                {
                    "step": loop.step_index,
                    "finished": finished,
                    "rss_mib": rss_mib(),
                    "validate_ms": checks[-1] * 1e3,
                    "step_p50_ms": statistics.median(step_s[-check_every:]) * 1e3,
                    "lines_per_step": statistics.mean(n for n, _ in traced),
                    "admitted_per_step": statistics.mean(a for _, a in traced),
                }
            )
            traced.clear()
        if loop.step_index % progress_every == 0:
            print(
                f"  soak step {loop.step_index:>6}: {finished:>7} finished, step p50 "
                f"{statistics.median(step_s[-progress_every:]) * 1e3:.2f} ms, "
                f"RSS {rss_mib():.1f} MiB, {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    engine.cache.validate_invariants()
    n = len(step_s)
    tenth = max(1, n // 10)
    first, last = slice(0, tenth), slice(n - tenth, n)
    return {
        "requests": total,
        "ids": ids,
        "steps": n,
        "backlog": backlog,
        "check_every": check_every,
        "wall_s": time.perf_counter() - start,
        "step_p50_first_tenth_ms": statistics.median(step_s[first]) * 1e3,
        "step_p50_last_tenth_ms": statistics.median(step_s[last]) * 1e3,
        "step_cpu_p50_first_tenth_ms": statistics.median(step_cpu_s[first]) * 1e3,
        "step_cpu_p50_last_tenth_ms": statistics.median(step_cpu_s[last]) * 1e3,
        "round_p50_first_tenth_ms": statistics.median(schedule_s[first]) * 1e3,
        "round_p50_last_tenth_ms": statistics.median(schedule_s[last]) * 1e3,
        "validate_first_ms": checks[0] * 1e3 if checks else None,
        "validate_last_ms": checks[-1] * 1e3 if checks else None,
        "lines_per_step_first": samples[0]["lines_per_step"] if samples else None,
        "lines_per_step_last": samples[-1]["lines_per_step"] if samples else None,
        "rss_start_mib": rss0,
        "rss_end_mib": rss_mib(),
        "samples": samples,
    }


def report(payload: dict, before: dict | None) -> str:
    env = payload["environment"]
    lines = [
        "# Long-running cost: round, invariant check and memory vs requests served (CPU)"
        + (f" — {payload['label']}" if payload.get("label") else ""),
        "",
        environment_markdown(env),
        f"- machine: {payload['machine']}",
        f"- flashdec measured: `{payload['flashdec']['path']}` (commit "
        f"{payload['flashdec']['commit']})",
    ]
    if before:
        lines.append(
            f"- before: flashdec commit {before['flashdec']['commit']}, command "
            f"`{before['environment']['command']}` ({before['environment']['date_utc']} UTC)"
        )
    lines += [
        "",
        "## (a) One round with 64 running and 1,000 waiting, after F finished requests",
        "",
        "Round = `scheduling_snapshot` + `plan` + apply (the serving loop's trusted apply and "
        "fairness step; public = `apply_scheduler_decision`, which snapshots and plans twice). "
        "Medians in ms. *kept B/req*: Python/NumPy memory the finished requests (str ids "
        "`done<i>`) still hold (tracemalloc, after a garbage collection), per request.",
        "",
    ]
    by_f = {r["finished"]: r for r in (before or {}).get("rounds", [])}
    columns = ["F finished", "loop round ms", "public round ms", "validate_invariants ms"]
    columns.append("kept B/req")
    if before:
        columns = [columns[0]] + [f"{c} (before → after)" for c in columns[1:]]
    rows = []
    for r in payload["rounds"]:
        b = by_f.get(r["finished"])
        cells = [f"{r['finished']:,}"]
        for key, digits in (
            ("loop_round_ms", 3),
            ("public_round_ms", 3),
            ("validate_ms", 3),
            ("kept_bytes_per_finished", 0),
        ):
            now = "—" if r[key] is None else f"{r[key]:.{digits}f}"
            if before:
                was = "—" if not b or b[key] is None else f"{b[key]:.{digits}f}"
                now = f"{was} → {now}"
            cells.append(now)
        rows.append(cells)
    lines += [markdown_table(columns, rows), ""]
    s = payload.get("soak")
    if s:
        lines += [
            f"## (b) Soak: {s['requests']:,} requests through ServingLoop",
            "",
            f"{s['steps']:,} steps, {s.get('ids', 'int')} ids, 64 running + {s['backlog']} "
            f"waiting kept, contexts 1–32 and 1–8 new tokens, invariants every "
            f"{s['check_every']:,} steps; the "
            "executor appends zero K/V through the cache (no attention); wall "
            f"{s['wall_s']:.0f} s.",
            "",
        ]
        bs = (before or {}).get("soak")
        fields = [
            ("step p50, first tenth (ms)", "step_p50_first_tenth_ms", 3),
            ("step p50, last tenth (ms)", "step_p50_last_tenth_ms", 3),
            ("step CPU time p50, first tenth (ms)", "step_cpu_p50_first_tenth_ms", 3),
            ("step CPU time p50, last tenth (ms)", "step_cpu_p50_last_tenth_ms", 3),
            ("round p50, first tenth (ms)", "round_p50_first_tenth_ms", 3),
            ("round p50, last tenth (ms)", "round_p50_last_tenth_ms", 3),
            ("Python lines per step, first sample", "lines_per_step_first", 0),
            ("Python lines per step, last sample", "lines_per_step_last", 0),
            ("validate_invariants, first check (ms)", "validate_first_ms", 2),
            ("validate_invariants, last check (ms)", "validate_last_ms", 2),
            ("RSS at start (MiB)", "rss_start_mib", 1),
            ("RSS at end (MiB)", "rss_end_mib", 1),
        ]
        head = ["", "before", "after"] if bs else ["", "value"]
        rows = []
        for name, key, digits in fields:
            row = [name]
            if bs:
                row.append(f"{bs[key]:.{digits}f}" if bs.get(key) is not None else "—")
            row.append(f"{s[key]:.{digits}f}" if s.get(key) is not None else "—")
            rows.append(row)
        lines += [markdown_table(head, rows), ""]

        def ratios(run: dict) -> str:
            parts = []
            for name, key in (("step wall", "step"), ("step CPU", "step_cpu"), ("round", "round")):
                last, first = (
                    run.get(f"{key}_p50_last_tenth_ms"),
                    run.get(f"{key}_p50_first_tenth_ms"),
                )
                parts.append(f"{name} {last / first:.2f}" if last and first else f"{name} —")
            return ", ".join(parts)

        lines += [
            "Last tenth / first tenth p50: "
            + ratios(s)
            + (f" (before: {ratios(bs)})" if bs else "")
            + ". Wall times on this shared machine move with other processes' load, CPU times "
            "(`time.thread_time`) less; the Python lines a step executes (counted with "
            f"`sys.settrace` over {TRACED_STEPS} steps of every {s['check_every']:,}, which are "
            "left out of the timings) not at all.",
            "",
            "Python lines per step over time (mean of the counted steps of each block, labelled "
            "by the requests finished at the block's end; admitted per step in brackets, the "
            "load that moves them):",
            "",
        ]
        series = [("after" if bs else "this run", s)] + ([("before", bs)] if bs else [])
        for name, run in series:
            picks = [p for p in run["samples"] if "lines_per_step" in p]
            picks = picks[:: max(1, len(picks) // 12)]
            lines.append(
                f"- {name}: "
                + ", ".join(
                    f"{p['finished'] // 1000}k → {p['lines_per_step']:,.0f} "
                    f"({p['admitted_per_step']:.1f})"
                    for p in picks
                )
            )
        lines += ["", f"RSS over time (every {s['check_every']:,} steps; MiB):", ""]
        for name, run in series:
            picks = run["samples"][:: max(1, len(run["samples"]) // 12)]
            lines.append(
                f"- {name}: "
                + ", ".join(f"{p['finished'] // 1000}k → {p['rss_mib']:.0f}" for p in picks)
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description="Round cost, invariant-check cost and memory vs requests served (CPU).",
        epilog="Writes benchmarks/results/<name>.md and .json (or under --out-dir).",
    )
    p.add_argument("--finished", type=int, nargs="+", default=[0, 10_000, 100_000])
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=200, help="rounds of each kind per F")
    p.add_argument("--soak-requests", type=int, default=200_000, help="0 skips the soak")
    p.add_argument("--backlog", type=int, default=256, help="waiting requests kept in the soak")
    p.add_argument("--soak-ids", choices=["int", "str"], default="int", help="request id type")
    p.add_argument("--check-every", type=int, default=1000)
    p.add_argument("--progress-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flashdec-root", help="import flashdec from this directory")
    p.add_argument("--label", default="", help="names this run (e.g. before / after)")
    p.add_argument("--before", help="an earlier run's JSON, shown side by side")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="long_run")
    args = p.parse_args()
    fd, origin = import_flashdec(args.flashdec_root)
    torch.set_num_threads(1)
    soak_result = None
    if args.soak_requests:  # first: its resident memory is then the soak's own
        print(f"soak of {args.soak_requests:,} requests ...", flush=True)
        soak_result = soak(
            fd,
            args.soak_requests,
            args.backlog,
            args.check_every,
            args.seed,
            args.progress_every,
            args.soak_ids,
        )
    rounds = []
    for f in args.finished:
        print(f"round cost after {f:,} finished requests ...", flush=True)
        row = measure_rounds(fd, f, args.waiting, args.rounds)
        rounds.append(row)
        print(
            f"  loop round {row['loop_round_ms']:.3f} ms, public round "
            f"{row['public_round_ms']:.3f} ms, validate_invariants {row['validate_ms']:.2f} ms, "
            f"kept {row['kept_bytes_per_finished'] or 0:.0f} B per finished request "
            f"(fill {row['fill_s']:.1f} s)",
            flush=True,
        )
    payload = {
        "environment": environment(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "label": args.label,
        "flashdec": origin,
        "rounds": rounds,
        "soak": soak_result,
    }
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if before:
        payload["before"] = before
    markdown = report(payload, before)
    md, js = write_results(args.name, markdown, payload, args.out_dir)
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
