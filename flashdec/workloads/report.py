"""How workload results reach a person: rich tables, JSON, and the CLI's workload registry."""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from rich.console import RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from flashdec.workloads.config import (
    TRITON_BACKENDS,
    IntegratedWorkloadConfig,
    SchedulerWorkloadConfig,
    SyntheticWorkloadConfig,
    WindowWorkloadConfig,
)
from flashdec.workloads.engine_workload import (
    IntegratedWorkloadResult,
    WorkloadResult,
    run_integrated_workload,
    run_synthetic_workload,
)
from flashdec.workloads.scheduler_workload import (
    SchedulerWorkloadResult,
    run_scheduler_workload,
)
from flashdec.workloads.window_workload import run_window_workload, window_result_tables


def _plain(value):
    """JSON-ready form of results: dataclasses, enums, dtypes and tuples become plain values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


def result_to_json(result) -> str:
    return json.dumps(_plain(result), indent=2)


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    return table


def engine_result_tables(result: WorkloadResult) -> list[RenderableType]:
    lat, sched = result.step_latency, result.schedule_latency
    rows = [
        ("device / dtype", f"{result.device} / {result.dtype}"),
        ("backends (append / decode)", f"{result.append_backend} / {result.decode_backend}"),
        ("requests finished", f"{result.finished}/{result.num_requests}"),
        ("requests rejected", str(result.rejected)),
    ]
    unfinished = getattr(result, "unfinished", None)
    if unfinished is not None:
        stopped = "yes (max_steps reached; the rest were cancelled)"
        rows += [
            ("stopped early", stopped if result.stopped_early else "no"),
            ("requests unfinished", str(unfinished)),
        ]
    rows += [
        ("completion rate", f"{result.completion_rate:.1%}"),
        ("steps (with decode)", f"{result.steps} ({result.decode_steps})"),
        ("tokens decoded", str(result.tokens_decoded)),
        ("prompt tokens imported", str(result.prompt_tokens_imported)),
        (
            "step latency p50 / p90 / p99",
            f"{lat.p50_ms:.3f} / {lat.p90_ms:.3f} / {lat.p99_ms:.3f} ms",
        ),
        ("scheduling p50 / p99", f"{sched.p50_ms:.3f} / {sched.p99_ms:.3f} ms"),
        ("decode throughput", f"{result.tokens_per_s:,.0f} tok/s"),
        ("max service wait", f"{result.max_service_wait_steps} steps"),
        ("max queueing wait", f"{result.max_waiting_steps} steps"),
        ("Jain index (service rate)", f"{result.jain_service_rate:.3f}"),
        ("peak blocks used", f"{result.peak_used_blocks} ({result.peak_kv_bytes / 2**20:.2f} MiB)"),
        ("blocks in use at the end", str(result.final_used_blocks)),
        ("invariant checks passed", str(result.invariants_checked)),
    ]
    groups = getattr(result, "groups", ())
    if len(groups) > 1 or any(g["window"] is not None for g in groups):
        for g in groups:
            kind = "full" if g["window"] is None else f"window {g['window']}"
            bound = g["block_bound_per_request"]
            rows.append(
                (
                    f"group {g['group']} ({kind}, layers {g['layers']})",
                    f"peak {g['peak_used_blocks']}/{g['num_blocks']} blocks"
                    + ("" if bound is None else f", <= {bound} per request"),
                )
            )
    if isinstance(result, IntegratedWorkloadResult):
        rows += [
            ("prefix hits / misses", f"{result.prefix_hits} / {result.prefix_misses}"),
            (
                "context blocks: shared+private vs alone",
                f"{result.context_blocks_shared}+{result.context_blocks_private} vs "
                f"{result.context_blocks_without_sharing}",
            ),
            (
                "prefix savings",
                f"{result.prefix_savings_blocks} blocks "
                f"({result.prefix_savings_bytes / 2**20:.2f} MiB)",
            ),
            (
                "injected failures / verified rollbacks",
                f"{result.injected_failures} / {result.verified_rollbacks}",
            ),
        ]
    rendered: list[RenderableType] = [_kv_table("FlashDec workload summary", rows)]
    note = _warmup_note(result)
    if note:
        rendered.append(Text(note, style="dim"))
    return rendered


def _warmup_note(result: WorkloadResult) -> str | None:
    """What the latency percentiles say about Triton's first-use compiles (None: no Triton)."""
    if result.config.warmup_run:
        return (
            "Latencies exclude an untimed warm-up run of the same workload (--warmup-run): "
            "Triton's first-use compiles are not in p90/p99."
        )
    if result.decode_backend in TRITON_BACKENDS or result.append_backend in TRITON_BACKENDS:
        return (
            "p90/p99 include Triton's first-use compiles of each launch shape; --warmup-run "
            "excludes them."
        )
    return None


SCHEDULER_COLUMNS = (
    ("policy", "admission policy"),
    ("done", "completion rate: finished / requests"),
    ("fin", "requests finished"),
    ("canc", "requests cancelled to free blocks (cancel baseline)"),
    ("rej", "requests rejected (can never fit)"),
    ("stuck", "requests still active when the run stopped"),
    ("deadlock", "the run stopped because no step changed anything any more"),
    ("steps", "scheduler steps run"),
    ("tokens", "tokens decoded (context import not counted)"),
    ("svc wait", "longest an active runnable request went undecoded (steps)"),
    ("wait", "longest a request waited from arrival to admission (steps)"),
    ("Jain", "Jain index of tokens per step in the system (1 = perfectly fair)"),
)


def scheduler_result_tables(result: SchedulerWorkloadResult) -> list[RenderableType]:
    table = Table(
        title=f"scheduler workload: trace {result.trace!r} ({result.num_blocks} blocks of "
        f"{result.block_size}, aging {result.aging_threshold}, prefix sharing "
        f"{'on' if result.prefix_sharing else 'off'})"
    )
    for col, _ in SCHEDULER_COLUMNS:
        table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
    for run in result.runs:
        table.add_row(
            run.policy,
            f"{run.completion_rate:.0%}",
            str(run.finished),
            str(run.cancelled),
            str(run.rejected),
            str(run.stuck),
            "yes" if run.deadlock else "no",
            str(run.steps),
            str(run.tokens_decoded),
            str(run.max_service_wait_steps),
            str(run.max_waiting_steps),
            f"{run.jain_service_rate:.2f}",
        )
    width = max(len(col) for col, _ in SCHEDULER_COLUMNS)
    legend = Text("\n".join(f"  {col:<{width}}  {meaning}" for col, meaning in SCHEDULER_COLUMNS))
    return [table, legend]


@contextmanager
def progress_bar(label: str, unit: str = "requests done") -> Iterator[Callable[[int, int], None]]:
    """A live bar for a terminal; yields the ``progress(done, total, note="")`` callback
    workloads take (``note``: a short status shown after the bar)."""
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
    ) as bar:
        task = bar.add_task(label, total=None, note="")

        def update(done: int, total: int, note: str = "") -> None:
            bar.update(task, completed=done, total=total, note=note)

        yield update


class ProgressLines:
    """The ``progress(done, total, note="")`` callback for logs and pipes: one line per tenth of
    the work done, or after ``every_s`` seconds without a line, whichever comes first."""

    def __init__(
        self,
        label: str,
        write: Callable[[str], None],
        unit: str = "requests done",
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.unit = unit
        self.write = write
        self.every_s = every_s
        self.clock = clock
        self.start = self.last = clock()
        self.next_tenth = 1
        self.finished = False

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if self.finished or total <= 0:
            return
        now = self.clock()
        tenth = done * 10 // total
        if tenth < self.next_tenth and now - self.last < self.every_s:
            return
        self.next_tenth = tenth + 1
        self.last = now
        self.finished = done >= total
        self.write(
            f"{self.label}: {done}/{total} {self.unit} ({done / total:.0%}, "
            f"{now - self.start:.1f} s)" + (f"; {note}" if note else "")
        )


@dataclass(frozen=True)
class WorkloadEntry:
    """A named workload: its config class, runner and how its result is shown."""

    help: str
    config_cls: type
    runner: Callable
    tables: Callable  # result -> rich renderables (tables, legends, notes)
    takes_progress: bool

    def run(self, config, progress: Callable[[int, int], None] | None = None):
        """Run with ``config``; ``progress(done, total)`` is called as requests finish (for
        runners that report progress)."""
        if self.config_cls is SchedulerWorkloadConfig:
            return self.runner(**dataclasses.asdict(config))
        if progress is None or not self.takes_progress:
            return self.runner(config)
        return self.runner(config, progress=progress)


def registry() -> dict[str, WorkloadEntry]:
    return {
        "integrated": WorkloadEntry(
            "dynamic arrival, prefix hits/misses, multi-layer transactions, injected rollbacks, "
            "cleanup",
            IntegratedWorkloadConfig,
            run_integrated_workload,
            engine_result_tables,
            True,
        ),
        "synthetic": WorkloadEntry(
            "single-layer dynamic engine under the lifetime scheduler",
            SyntheticWorkloadConfig,
            run_synthetic_workload,
            engine_result_tables,
            True,
        ),
        "scheduler": WorkloadEntry(
            "lifetime vs cancel vs greedy admission on a finite trace",
            SchedulerWorkloadConfig,
            run_scheduler_workload,
            scheduler_result_tables,
            False,
        ),
        "window": WorkloadEntry(
            "sliding-window layer groups: a long generation's blocks per group stay flat, and "
            "admitted concurrency with and without the windows on the same pools",
            WindowWorkloadConfig,
            run_window_workload,
            window_result_tables,
            True,
        ),
    }
