"""Shared benchmark utilities: run metadata, timing, physical ceilings, Markdown/JSON/plot output.

Every benchmark in this folder writes ``benchmarks/results/<name>.md`` + ``.json`` (+ ``.png``)
naming the exact command, git commit, GPU and library versions, so a result can be traced back.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashdec.runtime import capture_cuda_graph

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


def _git(*args: str, cwd: Path = ROOT) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_commit() -> str:
    """HEAD's hash, with ``-dirty`` when tracked files differ; ``FLASHDEC_COMMIT`` overrides
    (the GPU machine receives a copy of the tree, sometimes without ``.git``)."""
    if os.environ.get("FLASHDEC_COMMIT"):
        return os.environ["FLASHDEC_COMMIT"]
    head = _git("rev-parse", "--short=12", "HEAD")
    if head == "unknown":
        return head
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty and dirty != "unknown" else "")


def module_version(name: str) -> str | None:
    try:
        module = __import__(name)
    except Exception:  # a peer that fails to import is reported as missing
        return None
    return getattr(module, "__version__", "unknown")


def environment() -> dict[str, Any]:
    """Who/what/where of a run: command, commit, GPU, versions, time."""
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
        }
    return {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": module_version("triton"),
        "flashinfer": module_version("flashinfer"),
    }


def load_peer_run(
    path: str, args, trace_args: Sequence[str], key: str, script: str, peer: str = "vLLM"
) -> dict:
    """``peer``'s JSON (``script``'s ``--json`` output, its runs under ``key``), checked to have
    served the same trace as this run: every name of ``trace_args`` equal in ``args``."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data.get(key), list) or not isinstance(data.get("args"), dict):
        raise ValueError(f"{path} is not {script}'s --json output (no {key}/args)")
    theirs = data["args"]
    differ = [
        f"{k}: ours {getattr(args, k)!r}, {peer}'s {theirs.get(k)!r}"
        for k in trace_args
        if theirs.get(k) != getattr(args, k)
    ]
    if differ:
        raise ValueError(f"{path} served another trace than this run: " + "; ".join(differ))
    return data


def use_interpreter_without_gpu() -> bool:
    """``--smoke`` runs on a CPU-only machine go through Triton's interpreter; the variable must
    be set before Triton is first imported. Returns whether a GPU is present."""
    if torch.cuda.is_available():
        return True
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return False


def import_flashdec(root: str | None) -> tuple[Any, dict[str, str]]:
    """Import ``flashdec`` from ``root`` (e.g. an unpacked copy of an earlier commit's package,
    to measure before and after in one GPU session) or from this tree; returns the module and
    where it came from (path, and the commit when ``root`` is a git checkout or
    ``FLASHDEC_ROOT_COMMIT`` names it)."""
    if "flashdec" in sys.modules:
        raise RuntimeError("import_flashdec must run before anything imports flashdec")
    if root:
        sys.path.insert(0, str(Path(root).resolve()))
    import flashdec

    origin = Path(flashdec.__file__).resolve().parent.parent
    if not root:
        commit = git_commit()
    elif os.environ.get("FLASHDEC_ROOT_COMMIT"):
        commit = os.environ["FLASHDEC_ROOT_COMMIT"]
    elif (origin / ".git").exists():
        commit = _git("rev-parse", "--short=12", "HEAD", cwd=origin)
    else:
        commit = "unknown (set FLASHDEC_ROOT_COMMIT)"
    return flashdec, {"path": str(origin), "commit": commit}


def add_call_cost_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """The options bench_eager and bench_launch share: heads, page and dtype of the problem, a
    CPU ``--smoke`` run, and the before/after plumbing (``--flashdec-root``, ``--label``,
    ``--before``, ``--out-dir``, ``--name``, whose default is ``name``)."""
    p.add_argument("--heads", default="32/8/128")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few calls (CPU: interpreter)")
    p.add_argument("--flashdec-root", help="import flashdec from this directory")
    p.add_argument("--label", default="", help="names this run (e.g. before / after)")
    p.add_argument("--before", help="an earlier run's JSON, shown side by side")
    p.add_argument("--out-dir")
    p.add_argument("--name", default=name)


@dataclass(frozen=True)
class CallCostRun:
    """Where and on what a call-cost benchmark runs, from ``add_call_cost_arguments``'s options."""

    has_gpu: bool
    device: torch.device
    dtype: torch.dtype
    heads: tuple[int, int, int]  # (hq, hkv, head_dim)
    page: int
    origin: dict[str, str]  # where the measured flashdec came from (``import_flashdec``)
    out_dir: Path


def start_call_cost_run(args: argparse.Namespace, script: str) -> CallCostRun | None:
    """Import flashdec (from ``--flashdec-root`` if given) and resolve the shared options;
    ``--smoke`` shrinks the heads to 4/2/16 with pages of 8 and writes to a temporary folder.
    None (the reason printed) without a GPU unless ``--smoke``."""
    has_gpu = use_interpreter_without_gpu()
    if not has_gpu and not args.smoke:
        print(f"{script} needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return None
    _, origin = import_flashdec(args.flashdec_root)
    hq, hkv, d = (int(x) for x in args.heads.split("/"))
    page = args.page
    if args.smoke:
        hq, hkv, d, page = 4, 2, 16, 8
    return CallCostRun(
        has_gpu=has_gpu,
        device=torch.device("cuda" if has_gpu else "cpu"),
        dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype],
        heads=(hq, hkv, d),
        page=page,
        origin=origin,
        out_dir=Path(args.out_dir or (tempfile.mkdtemp() if args.smoke else RESULTS_DIR)),
    )


def call_cost_report_head(
    title: str, args: argparse.Namespace, env: dict[str, Any], origin: dict[str, str]
) -> list[str]:
    """A call-cost report's first lines: the title (with the run's ``--label``), the
    environment and the flashdec measured."""
    return [
        title + (f" — {args.label}" if args.label else ""),
        "",
        environment_markdown(env),
        f"- flashdec measured: `{origin['path']}` (commit {origin['commit']})",
    ]


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_us_per_call(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    calls: int = 200,
    repeats: int = 7,
    warmup: int = 20,
    setup: Callable[[], Any] | None = None,
) -> float:
    """Wall time per call as a user sees it: ``calls`` back-to-back calls, synchronised once at
    the end, divided by ``calls``; the median of ``repeats`` such runs. ``setup`` (untimed) runs
    before the warm-up and before each repeat (e.g. to provide fresh tensors)."""
    if setup is not None:
        setup()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def host_us_per_call(
    fn: Callable[[], Any], device: torch.device | str, *, calls: int = 2000, block: int = 50
) -> float:
    """Median host time of one call, with no synchronisation per call: calls are timed one by
    one in blocks of ``block``, and the device is drained (untimed) between blocks so that the
    launch queue never fills and blocks the host."""
    for _ in range(min(block, calls)):
        fn()
    times = []
    clock = time.perf_counter_ns
    for _ in range(max(1, calls // block)):
        sync(device)
        for _ in range(block):
            start = clock()
            fn()
            times.append(clock() - start)
    sync(device)
    return statistics.median(times) / 1000.0


def line_events(fn: Callable[[], Any]) -> int:
    """Python lines ``fn()`` executes (loop iterations included): an operation count that the
    machine's speed and load do not move (a traced call runs several times slower)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def bench_us(fn: Callable[[], Any], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median device time of ``fn`` in microseconds (``triton.testing.do_bench``; the L2 is
    flushed before every timed call, so data is read from HBM as in a real decode step)."""
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def cuda_graph_of(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """Capture one call of ``fn`` in a CUDA graph (after a warm-up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_cuda_graph(graph):
        fn()
    return graph


def graph_us(fn: Callable[[], Any], warmup_ms: float = 25, rep_ms: float = 100) -> float | None:
    """Device time of one call replayed from a CUDA graph (no Python launch overhead);
    None when capture fails (the reason is printed)."""
    try:
        return bench_us(cuda_graph_of(fn).replay, warmup_ms, rep_ms)
    except Exception as exc:
        print(f"graph capture failed: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.synchronize()
        return None


def copy_ceiling_tbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e12


def read_ceiling_tbs(nbytes: int = 2 * 2**30) -> float:
    """Read-only bandwidth in TB/s: a large float32 reduction (decode reads far more than it
    writes, so it can exceed the copy figure slightly)."""
    src = torch.randn(nbytes // 4, dtype=torch.float32, device="cuda")
    us = bench_us(lambda: src.sum())
    return nbytes / (us * 1e-6) / 1e12


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += [
        "| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows
    ]
    return "\n".join(lines)


def environment_markdown(env: dict[str, Any]) -> str:
    gpu = env.get("gpu") or {}
    return "\n".join(
        [
            f"- command: `{env['command']}`",
            f"- commit: `{env['commit']}`, date (UTC): {env['date_utc']}",
            f"- GPU: {gpu.get('name', 'none')} ({gpu.get('sm_count', '?')} SMs, "
            f"{gpu.get('memory_gib', '?')} GiB, sm_{gpu.get('capability', '?')})",
            f"- versions: python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), "
            f"triton {env['triton']}, flashinfer {env['flashinfer'] or 'not installed'}",
        ]
    )


def write_results(
    name: str, markdown: str, payload: dict[str, Any], out_dir: Path | None = None
) -> tuple[Path, Path]:
    """Write ``<name>.md`` and ``<name>.json`` under ``out_dir`` (default benchmarks/results)."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / f"{name}.md", out_dir / f"{name}.json"
    md_path.write_text(markdown.rstrip() + "\n")
    json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return md_path, json_path


def bar_plot(
    path: Path,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    ylabel: str,
    title: str,
    hline: float | None = None,
    log: bool = False,
) -> Path | None:
    """Grouped bar chart (matplotlib, Agg); returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = max(1, len(series))
    width = 0.8 / n
    # wide enough to read a few dozen groups, never wider than a screen
    fig, ax = plt.subplots(figsize=(min(22, max(8, 0.16 * len(labels) * n)), 6))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ys = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, ys, width=width, label=name)
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def attach_before(
    rows: list[dict[str, Any]],
    before_path: str | Path | None,
    key: Sequence[str],
    fields: Sequence[str],
) -> dict[str, Any] | None:
    """Copy ``fields`` of the matching rows (same ``key`` values) of an earlier run's JSON into
    ``rows`` as ``before_<field>``; returns that run's environment, its label and the commit of
    the flashdec it measured (None without a file)."""
    if not before_path:
        return None
    before = json.loads(Path(before_path).read_text())
    index = {tuple(r.get(k) for k in key): r for r in before["rows"]}
    for row in rows:
        match = index.get(tuple(row.get(k) for k in key))
        for field in fields:
            row[f"before_{field}"] = match.get(field) if match else None
    env = before.get("environment", {})
    measured = before.get("flashdec", {}).get("commit", env.get("commit"))
    return {**env, "label": before.get("label"), "commit": measured}


def geomean(values: Sequence[float]) -> float | None:
    import math

    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def cuda_graph_of_calls(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """Capture ``calls`` back-to-back calls of ``fn`` in one CUDA graph (after a warm-up on a
    side stream); several calls per graph amortise the replay's own launch cost."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture_cuda_graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_us_per_call(
    fn: Callable[[], Any], calls: int = 20, warmup_ms: float = 10, rep_ms: float = 40
) -> float:
    """Device time of one call: ``calls`` calls captured in one CUDA graph, the median replay
    time (``bench_us``: L2 flushed before each replay) divided by ``calls``. Raises on failure."""
    graph = cuda_graph_of_calls(fn, calls)
    try:
        return bench_us(graph.replay, warmup_ms, rep_ms) / calls
    finally:
        del graph


def run_in_workers(
    fn: Callable[..., int],
    jobs: Sequence[Any],
    workers: int,
    timeout_s: float,
    *extra: Any,
    round_robin: bool = False,
) -> int | None:
    """Sum of ``fn(chunk, *extra)`` over ``workers`` chunks of ``jobs`` (contiguous, or dealt
    round-robin), each in a spawned process (CUDA cannot be forked), e.g. to compile kernel
    variants in parallel before a timing pass; None (the reason printed) on a failure or after
    ``timeout_s``."""
    import multiprocessing as mp

    workers = max(1, min(workers, len(jobs)))
    if round_robin:
        chunks = [list(jobs[i::workers]) for i in range(workers)]
    else:
        size = -(-len(jobs) // workers)
        chunks = [list(jobs[i : i + size]) for i in range(0, len(jobs), size)]
    start = time.time()
    try:
        with mp.get_context("spawn").Pool(len(chunks)) as pool:
            done = pool.starmap_async(fn, [(c, *extra) for c in chunks]).get(timeout=timeout_s)
    except Exception as exc:  # the caller's own pass then does what is missing
        print(f"worker pool failed ({type(exc).__name__}: {exc})", flush=True)
        return None
    print(f"{len(chunks)} workers: {sum(done)} of {len(jobs)} jobs in {time.time() - start:.0f} s")
    return sum(done)


def goal(name: str, value: Any, bar: Any, met: bool | None, margin: str, shown: str = "") -> dict:
    """One target's row for a results file: ``met`` None when it was not measured."""
    return {
        "target": name,
        "value": value,
        "bar": bar,
        "met": met,
        "margin": margin,
        "shown": shown,
    }


def goals_section(goals: list[dict]) -> list[str]:
    """The Markdown lines of a targets table (rows from :func:`goal`): counts, then the table."""
    verdict = {True: "MET", False: "**MISSED**", None: "not measured"}
    counts = {v: sum(g["met"] is k for g in goals) for k, v in verdict.items()}
    table = [
        [g["target"], g["shown"] or "—", f"{g['bar']:g}", verdict[g["met"]], g["margin"]]
        for g in goals
    ]
    return [
        f"{counts['MET']} met, {counts['**MISSED**']} missed, {counts['not measured']} not "
        "measured.",
        "",
        markdown_table(["target", "measured", "bar", "verdict", "margin"], table),
    ]
