"""Every step of a saturated serving pass: host wall time against the GPU's busy time (issue 38).

The serving trace of ``bench_serve.py`` (serve_trace.py's arrivals) runs twice on one warm
``flashdec.LLM``: once untimed (kernel builds and captures land there), then under
``torch.profiler`` with each ``LLM.step`` inside a ``record_function`` range. From the trace:

- a step's GPU work = the kernels, copies and memsets whose launches (runtime calls, a CUDA
  graph's launch included) were made inside its range, matched by correlation id;
- **busy** = the union of those intervals (what the GPU spent on the step), **span** = first
  start to last end, **gap** = the GPU's idle time between the end of everything before the step
  and its first kernel (the host was late: the time a faster host, or a step launched earlier,
  could win back); **wall** = the range's host time (the profiler inflates host time; the
  unprofiled step times are ``bench_serve.py``'s).

Reported per kind of step (decode only, or with prompt chunks): medians and sums; for the pass:
its GPU span, busy share and idle. Writes ``<name>.md``, ``.json`` and ``.png`` (default
``benchmarks/results/step_profile``).

    PYTHONPATH=. python3 benchmarks/profile_steps.py --rate 64            # the saturated pass
    PYTHONPATH=. python3 benchmarks/profile_steps.py --max-num-batched-tokens 4096
    python3 benchmarks/profile_steps.py --smoke                         # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    fmt,
    markdown_table,
    write_results,
)

STEP_PREFIX = "flashdec step "
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--rate", type=float, default=64.0, help="Poisson arrivals per second")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=128, help="tokens per request (EOS ignored)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one step brings at most (default: flashdec.LLM's)",
    )
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="step_profile")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small trace")
    args = p.parse_args(argv)
    for name in ("requests", "min_prompt", "max_prompt", "new", "max_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_prompt > args.max_prompt:
        p.error("--min-prompt must be <= --max-prompt")
    if args.smoke:
        args.model, args.requests, args.min_prompt, args.max_prompt = "tiny", 8, 8, 32
        args.new, args.max_batch, args.rate = 8, 8, 50.0
    return args


# ---------------------------------------------------------------------------------------------
# the trace (pure Python: tested on the CPU with synthetic traces)


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[(start, end), ...]``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def step_timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ``record_function`` step range of a Chrome trace (``traceEvents``), in order: its
    index, host ``wall_us``, and its GPU work's ``busy_us``, ``span_us``, ``gap_us`` and
    ``gpu_ops`` (see the module docstring); a step with no GPU work has None for those."""
    steps = sorted(
        (
            (int(e["name"][len(STEP_PREFIX) :]), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in events
            if e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_PREFIX)
        ),
        key=lambda s: s[1],
    )
    starts = [s[1] for s in steps]
    owner: dict[int, int] = {}  # correlation id -> position in steps
    for e in events:
        if e.get("cat") not in LAUNCH_CATEGORIES or "correlation" not in e.get("args", {}):
            continue
        ts = float(e["ts"])
        pos = _position(starts, ts)
        if pos is not None and ts <= steps[pos][2]:
            owner[e["args"]["correlation"]] = pos
    work: list[list[tuple[float, float]]] = [[] for _ in steps]
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        pos = owner.get(e.get("args", {}).get("correlation"))
        if pos is not None:
            start = float(e["ts"])
            work[pos].append((start, start + float(e.get("dur", 0.0))))
    rows, reach = [], None
    for (index, start, end), ops in zip(steps, work, strict=True):
        row: dict[str, Any] = {"step": index, "wall_us": end - start, "gpu_ops": len(ops)}
        if ops:
            first, last = min(s for s, _ in ops), max(e for _, e in ops)
            gap = None if reach is None else max(0.0, first - reach)
            row.update(busy_us=_union(ops), span_us=last - first, gap_us=gap)
            reach = last if reach is None else max(reach, last)
        else:
            row.update(busy_us=None, span_us=None, gap_us=None)
        rows.append(row)
    return rows


def _position(starts: list[float], ts: float) -> int | None:
    """Index of the last range starting at or before ``ts`` (binary search)."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= ts:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1 if lo else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step (``rows[i]["kind"]``): count, medians and sums of wall / busy / gap;
    for the pass: the GPU's busy time over its span, and its idle time."""
    kinds: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        timed = [r for r in rs if r["busy_us"] is not None]
        gaps = [r["gap_us"] for r in timed if r["gap_us"] is not None]
        kinds[kind] = {
            "steps": len(rs),
            "wall_p50_us": statistics.median(r["wall_us"] for r in rs),
            "busy_p50_us": statistics.median(r["busy_us"] for r in timed) if timed else None,
            "gap_p50_us": statistics.median(gaps) if gaps else None,
            "wall_sum_ms": sum(r["wall_us"] for r in rs) / 1e3,
            "busy_sum_ms": sum(r["busy_us"] for r in timed) / 1e3 if timed else None,
            "gap_sum_ms": sum(gaps) / 1e3 if gaps else None,
            "rows_p50": statistics.median(r["rows"] for r in rs),
        }
    timed = [r for r in rows if r["busy_us"] is not None]
    total: dict[str, Any] = {
        "steps": len(rows),
        "wall_sum_ms": sum(r["wall_us"] for r in rows) / 1e3,
    }
    if timed:
        busy = sum(r["busy_us"] for r in timed)
        idle = sum(r["gap_us"] or 0.0 for r in timed)
        total.update(busy_sum_ms=busy / 1e3, gap_sum_ms=idle / 1e3)
    return {"kinds": kinds, "total": total}


# ---------------------------------------------------------------------------------------------
# the run


def profile_pass(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The warm-up pass, then the profiled one: ``(rows, info)``, one row per step."""
    from benchmarks.bench_serve import build_llm, trace_config
    from flashdec.workloads.serving import run_serve_benchmark

    llm, device = build_llm(args)
    config = trace_config(args, args.rate, device)
    run_serve_benchmark(llm, config)  # warm: what builds or captures lands here
    records: list[Any] = []
    step = llm.step

    def marked_step():
        with torch.profiler.record_function(f"{STEP_PREFIX}{len(records)}"):
            record = step()
        records.append(record)
        return record

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    llm.step = marked_step  # the trace's own loop calls it
    try:
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            result = run_serve_benchmark(llm, config).as_dict()
        elapsed = time.perf_counter() - started
    finally:
        del llm.step
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    rows = step_timeline(events)
    for row in rows:
        record = records[row["step"]] if row["step"] < len(records) else None
        prefilled = bool(record is not None and record.prefilled)
        row["kind"] = "with prompt chunks" if prefilled else "decode only"
        row["decode_rows"] = 0 if record is None else len(record.served)
        row["prompt_requests"] = 0 if record is None else len(record.prefilled)
        row["rows"] = row["decode_rows"] + row["prompt_requests"]
    info = {
        "device": device,
        "budget": llm.max_num_batched_tokens,
        "pass_s": elapsed,
        "serve": {k: result[k] for k in ("ttft_p50_ms", "tpot_p50_ms", "output_tok_s")},
    }
    return rows, info


def render(payload: dict[str, Any]) -> str:
    args, info, summary = payload["args"], payload["info"], payload["summary"]
    lines = [
        f"# Steps of a serving pass at {args['rate']:g} req/s: host wall vs GPU busy "
        f"({args['model']})",
        "",
        environment_markdown(payload["environment"]),
        f"- trace: {args['requests']} requests, prompts {args['min_prompt']}-{args['max_prompt']}"
        f" random tokens, {args['new']} new tokens, max batch {args['max_batch']}, step token "
        f"budget {info['budget']}, seed {args['seed']}; the profiled pass took "
        f"{info['pass_s']:.2f} s (the profiler slows the host)",
        "- busy = union of the step's kernels, copies and memsets (matched to the step's "
        "launches by correlation id); gap = the GPU's idle time before the step's first one; "
        "wall = the step's host time under the profiler; rows = decode rows + requests with "
        "a prompt chunk",
        f"- the profiled pass served TTFT p50 {info['serve']['ttft_p50_ms']:.1f} ms, TPOT p50 "
        f"{info['serve']['tpot_p50_ms']:.2f} ms, {info['serve']['output_tok_s']:,.0f} output "
        "tok/s (under the profiler)",
        "",
    ]
    body = [
        [
            kind,
            k["steps"],
            k["rows_p50"],
            fmt(k["wall_p50_us"] / 1e3, 2),
            fmt(None if k["busy_p50_us"] is None else k["busy_p50_us"] / 1e3, 2),
            fmt(None if k["gap_p50_us"] is None else k["gap_p50_us"] / 1e3, 2),
            fmt(k["wall_sum_ms"], 1),
            fmt(k["busy_sum_ms"], 1),
            fmt(k["gap_sum_ms"], 1),
        ]
        for kind, k in summary["kinds"].items()
    ]
    lines.append(
        markdown_table(
            [
                "steps",
                "count",
                "rows p50",
                "wall p50 ms",
                "busy p50 ms",
                "gap p50 ms",
                "wall sum ms",
                "busy sum ms",
                "gap sum ms",
            ],
            body,
        )
    )
    total = summary["total"]
    lines.append("")
    if total.get("busy_sum_ms") is None:
        lines.append("No GPU work in the trace (a CPU run): host times only.")
    else:
        lines.append(
            f"Whole pass: {total['steps']} steps, host wall {total['wall_sum_ms']:.1f} ms, GPU "
            f"busy {total['busy_sum_ms']:.1f} ms, GPU idle between steps "
            f"{total['gap_sum_ms']:.1f} ms."
        )
    worst = sorted(
        (r for r in payload["rows"] if r["gap_us"]), key=lambda r: r["gap_us"], reverse=True
    )[:10]
    if worst:
        lines += ["", "The ten longest GPU gaps before a step:", ""]
        lines.append(
            markdown_table(
                ["step", "kind", "rows", "gap ms", "wall ms", "busy ms"],
                [
                    [
                        r["step"],
                        r["kind"],
                        r["rows"],
                        fmt(r["gap_us"] / 1e3, 2),
                        fmt(r["wall_us"] / 1e3, 2),
                        fmt(r["busy_us"] / 1e3, 2),
                    ]
                    for r in worst
                ],
            )
        )
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[dict[str, Any]]) -> Path | None:
    """Wall and busy time of every step, in order."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.5))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["wall_us"] / 1e3 for r in rows], label="host wall", linewidth=0.8)
    busy = [(r["step"], r["busy_us"] / 1e3) for r in rows if r["busy_us"] is not None]
    if busy:
        ax.plot(*zip(*busy, strict=True), label="GPU busy", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("steps of a serving pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, info = profile_pass(args)
    payload = {
        "environment": environment(),
        "args": vars(args),
        "info": info,
        "summary": summarize(rows),
        "rows": rows,
    }
    out_dir = Path(args.out_dir)
    md_path, _ = write_results(args.name, render(payload), payload, out_dir)
    plot(out_dir / f"{args.name}.png", rows)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
