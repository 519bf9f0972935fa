"""Scheduler matrix: lifetime vs cancel vs greedy admission on every built-in trace.

Each scenario (a trace, with aging on/off or prefix sharing on/off where that is the point)
runs every policy through ``run_scheduler_workload`` on a real ``PagedKVCache`` (CPU, fp32,
one tiny layer): completion, deadlock, throughput, complete-step latency and fairness. CPU only,
a few seconds. Writes ``benchmarks/results/scheduler_matrix.{md,json,png}``.

    PYTHONPATH=. .venv/bin/python benchmarks/run_scheduler_matrix.py
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    markdown_table,
    write_results,
)
from flashdec.workloads.scheduler_workload import (
    BIG_AGING_REQUEST,
    SchedulerWorkloadResult,
    build_trace,
    run_scheduler_workload,
)

POLICIES = ("lifetime", "cancel", "greedy")
STYLES = {"lifetime": "-", "cancel": "--", "greedy": ":"}  # overlapping lines stay visible
# (label, trace, run_scheduler_workload overrides)
SCENARIOS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("boundary", "boundary", {}),
    ("aging (threshold 8)", "aging", {}),
    ("aging off", "aging", {"aging_threshold": None}),
    ("prefix shared", "prefix", {}),
    ("prefix unshared", "prefix", {"prefix_sharing": False}),
    ("mixed", "mixed", {}),
    ("mixed, aging off", "mixed", {"aging_threshold": None}),
)
COLUMNS = (
    "scenario",
    "policy",
    "completion",
    "fin/canc/rej/stuck/unserved",
    "deadlock",
    "steps",
    "tokens",
    "tok/s",
    "step p50/p99 ms",
    "peak active",
    "stalls",
    "max svc wait",
    "max wait",
    "big req wait",
    "Jain",
)


def row(label: str, result: SchedulerWorkloadResult, policy: str) -> list[str]:
    r = result.run(policy)
    big = r.waiting_steps_of(BIG_AGING_REQUEST) if result.trace == "aging" else None
    return [
        label,
        policy,
        f"{100 * r.completion_rate:.0f}%",
        f"{r.finished}/{r.cancelled}/{r.rejected}/{r.stuck}/{r.never_admitted}",
        "yes" if r.deadlock else "no",
        str(r.steps),
        str(r.tokens_decoded),
        f"{r.tokens_per_s:,.0f}",
        f"{r.step_latency.p50_ms:.2f}/{r.step_latency.p99_ms:.2f}",
        str(r.peak_active),
        str(r.stall_events),
        str(r.max_service_wait_steps),
        str(r.max_waiting_steps),
        "—" if big is None else str(big),
        f"{r.jain_service_rate:.3f}",
    ]


def print_table(rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown_table(COLUMNS, rows))
        return
    table = Table(title="FlashDec scheduler matrix", show_lines=False)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("scenario", "policy") else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=220).print(table)


def plot(path: Path, results: list[tuple[str, SchedulerWorkloadResult]]) -> Path | None:
    """Completion rate per scenario and policy; tokens decoded over time on the boundary trace
    (greedy flat-lines in its deadlock, cancel stops at half); free blocks per step on the
    mixed trace."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(18, 5))
    labels = [label for label, _ in results]
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        xs = [j + (i - (len(POLICIES) - 1) / 2) * width for j in range(len(labels))]
        ys = [100 * res.run(policy).completion_rate for _, res in results]
        left.bar(xs, ys, width=width, label=policy)
    left.set_xticks(range(len(labels)))
    left.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("completion rate (%)")
    left.set_ylim(0, 105)
    left.set_title("requests finished, per scenario")
    left.legend(fontsize=8)
    by_label = dict(results)
    boundary, mixed = by_label["boundary"], by_label["mixed"]
    for policy in POLICIES:
        total, cumulative = 0, []
        for n in boundary.run(policy).batch_trajectory:
            total += n
            cumulative.append(total)
        mid.step(
            range(1, len(cumulative) + 1),
            cumulative,
            where="post",
            label=policy,
            linestyle=STYLES[policy],
            linewidth=2,
        )
        traj = mixed.run(policy).free_blocks_trajectory
        right.step(range(len(traj)), traj, where="post", label=policy, linewidth=1)
    mid.set_xlabel("step")
    mid.set_ylabel("tokens decoded (cumulative)")
    mid.set_title("boundary trace: decode progress")
    mid.legend(fontsize=8)
    right.set_xlabel("step")
    right.set_ylabel("free blocks (end of step)")
    right.set_title(f"mixed trace: free blocks of a {mixed.num_blocks}-block pool")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def dirty_files() -> list[str]:
    """Tracked files that differ from the commit at run time (why a commit reads ``-dirty``)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def describe_traces(seed: int) -> str:
    lines = []
    for name in ("boundary", "aging", "prefix", "mixed"):
        t = build_trace(name, seed)
        c = t.config
        lines.append(
            f"- **{name}**: {t.description}; block_size {t.block_size}, "
            f"{len(t.requests)} requests, max_active {c.max_active_requests}, "
            f"max_batch {c.max_batch_size}, reserve {c.reserve_blocks}, "
            f"aging_threshold {c.aging_threshold}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    env = environment()
    reproduce = " ".join(
        ["PYTHONPATH=. .venv/bin/python benchmarks/run_scheduler_matrix.py"]
        + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)]
    )
    dirty = dirty_files()
    env = {**env, "exact_command": reproduce, "modified_tracked_files": dirty}
    results: list[tuple[str, SchedulerWorkloadResult]] = []
    rows = []
    for label, trace, overrides in SCENARIOS:
        result = run_scheduler_workload(trace, POLICIES, seed=args.seed, **overrides)
        results.append((label, result))
        rows += [row(label, result, p) for p in POLICIES]
    print_table(rows)
    png = None if args.no_plot else plot(args.out_dir / "scheduler_matrix.png", results)

    md = [
        "# Scheduler matrix: lifetime vs cancel vs greedy",
        "",
        environment_markdown(env),
        f"- exact command: `{reproduce}`",
        f"- tracked files modified at run time: {', '.join(dirty) or 'none'}",
        "- device: CPU (a real `PagedKVCache`: 1 layer, 1 KV head, head_dim 4, fp32, torch append)",
        "",
        "Every policy shares the rejection rule (a request that cannot fit an empty pool, or whose",
        "prefix is missing, is rejected) and the batch rule (longest service wait first). They",
        "differ only in admission: **lifetime** reserves each request's whole lifetime of blocks;",
        "**greedy** admits in FIFO order while the context fits now; **cancel** admits like greedy",
        "and, when batch requests find no block at a boundary, cancels the newest active requests.",
        "",
        markdown_table(COLUMNS, rows),
        "",
        "Columns: completion = finished / submitted; fin/canc/rej/stuck/unserved = finished, "
        "cancelled, rejected, still active at the end, never admitted; deadlock = no progress for "
        "4 steps with work left; stalls = (request, step) pairs where a batch request found no "
        "free block; max svc wait = longest run of steps an active request went undecoded; max "
        "wait = longest arrival-to-admission wait (steps); big req wait = wait of the 8-block "
        f"request `{BIG_AGING_REQUEST}` on the aging trace; Jain = Jain index of per-request "
        "tokens per step in the system. tok/s and step latency are CPU wall time of the whole "
        "step (snapshot, plan, admission with context import, append, finish) — they compare "
        "policies on this machine only.",
        "",
        "## Traces",
        "",
        describe_traces(args.seed),
    ]
    if png is not None:
        md += ["", f"![completion and free blocks]({png.name})"]
    payload = {
        "environment": env,
        "seed": args.seed,
        "scenarios": [{"label": label, "result": result.as_dict()} for label, result in results],
    }
    md_path, json_path = write_results("scheduler_matrix", "\n".join(md), payload, args.out_dir)
    print(f"wrote {md_path}, {json_path}" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
