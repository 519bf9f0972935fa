"""How workload results reach a person: rich tables, JSON, and the CLI's workload registry."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flashdec.workloads.config import (
    IntegratedWorkloadConfig,
    SchedulerWorkloadConfig,
    SyntheticWorkloadConfig,
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


def engine_result_tables(result: WorkloadResult) -> list[Table]:
    lat, sched = result.step_latency, result.schedule_latency
    rows = [
        ("device / dtype", f"{result.device} / {result.dtype}"),
        ("backends (append / decode)", f"{result.append_backend} / {result.decode_backend}"),
        ("requests finished", f"{result.finished}/{result.num_requests}"),
        ("requests rejected", str(result.rejected)),
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
    return [_kv_table("FlashDec workload summary", rows)]


def scheduler_result_tables(result: SchedulerWorkloadResult) -> list[Table]:
    table = Table(
        title=f"scheduler workload: trace {result.trace!r} ({result.num_blocks} blocks of "
        f"{result.block_size}, aging {result.aging_threshold}, prefix sharing "
        f"{'on' if result.prefix_sharing else 'off'})"
    )
    columns = ("policy", "done", "fin", "canc", "rej", "stuck", "deadlock", "steps", "tokens",
               "svc wait", "wait", "Jain")  # fmt: skip
    for col in columns:
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
    return [table]


@contextmanager
def progress_bar(label: str):
    """A live bar for long runs; yields the ``progress(done, total)`` callback workloads take."""
    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests done"),
        TimeElapsedColumn(),
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@dataclass(frozen=True)
class WorkloadEntry:
    help: str
    config_cls: type
    runner: Callable
    tables: Callable
    takes_progress: bool

    def run(self, config, progress: bool = False):
        if self.config_cls is SchedulerWorkloadConfig:
            return self.runner(**dataclasses.asdict(config))
        if not (progress and self.takes_progress):
            return self.runner(config)
        with progress_bar("decoding") as update:
            return self.runner(config, progress=update)


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
    }
