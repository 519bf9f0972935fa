"""Workloads that exercise the whole runtime and report step latency, fairness and memory."""

from flashdec.workloads.config import (
    IntegratedWorkloadConfig,
    SchedulerWorkloadConfig,
    SyntheticWorkloadConfig,
    WindowWorkloadConfig,
)
from flashdec.workloads.engine_workload import (
    IntegratedWorkloadResult,
    StepRecord,
    WorkloadResult,
    run_integrated_workload,
    run_synthetic_workload,
)
from flashdec.workloads.report import registry, result_to_json
from flashdec.workloads.scheduler_workload import (
    PolicyRunResult,
    SchedulerWorkloadResult,
    WorkloadTrace,
    build_trace,
    run_scheduler_workload,
)
from flashdec.workloads.stats import LatencyStats, SpeculationStats, jain_index
from flashdec.workloads.window_workload import (
    ConcurrencyRun,
    WindowWorkloadResult,
    run_window_workload,
)

__all__ = [
    "ConcurrencyRun",
    "IntegratedWorkloadConfig",
    "IntegratedWorkloadResult",
    "LatencyStats",
    "PolicyRunResult",
    "SchedulerWorkloadConfig",
    "SchedulerWorkloadResult",
    "SpeculationStats",
    "StepRecord",
    "SyntheticWorkloadConfig",
    "WindowWorkloadConfig",
    "WindowWorkloadResult",
    "WorkloadResult",
    "WorkloadTrace",
    "build_trace",
    "jain_index",
    "registry",
    "result_to_json",
    "run_integrated_workload",
    "run_scheduler_workload",
    "run_synthetic_workload",
    "run_window_workload",
]
