"""FlashDec: a correctness-first single-GPU LLM decode runtime over a paged KV cache.

Public names are resolved lazily so that ``import flashdec`` stays cheap and does not import
Triton (``TRITON_INTERPRET`` must be set before Triton's first import on CPU-only machines).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # references
    "dense_decode_attention_ref": "flashdec.reference",
    "paged_decode_attention_ref": "flashdec.reference",
    "paged_extend_attention_ref": "flashdec.reference",
    "apply_rope": "flashdec.reference",
    # Triton kernels
    "decode": "flashdec.kernels",
    "paged_decode_attention": "flashdec.kernels",
    "plan_decode": "flashdec.kernels",
    "DecodePlan": "flashdec.kernels",
    "DecodeWorkspace": "flashdec.kernels",
    "extend": "flashdec.kernels",
    "paged_extend_attention": "flashdec.kernels",
    "plan_extend": "flashdec.kernels",
    "ExtendPlan": "flashdec.kernels",
    "ExtendWorkspace": "flashdec.kernels",
    "kv_append": "flashdec.kernels",
    "clear_validation_cache": "flashdec.kernels",
    "fused_rope_kv_append": "flashdec.kernels",
    # cache
    "PagedKVCache": "flashdec.cache",
    "RequestState": "flashdec.cache",
    "PrefixState": "flashdec.cache",
    "TokenTransaction": "flashdec.cache",
    "TokenTransactionView": "flashdec.cache",
    "KVGroupSpec": "flashdec.cache",
    "parse_kv_spec": "flashdec.cache",
    "format_kv_spec": "flashdec.cache",
    "rope_paged_kv_append": "flashdec.engine",
    "RopeAppendResult": "flashdec.engine",
    # scheduler
    "RequestSpec": "flashdec.scheduler",
    "SchedulerConfig": "flashdec.scheduler",
    "SchedulingSnapshot": "flashdec.scheduler",
    "SchedulerDecision": "flashdec.scheduler",
    "BlockAwareScheduler": "flashdec.scheduler",
    "GreedyScheduler": "flashdec.scheduler",
    "CancelScheduler": "flashdec.scheduler",
    # engine
    "DecodeEngine": "flashdec.engine",
    "EngineRequestState": "flashdec.engine",
    "StepResult": "flashdec.engine",
    # real models
    "LLM": "flashdec.llm",
    "SamplingParams": "flashdec.llm",
    "SpeculativeConfig": "flashdec.speculative",
    # workloads
    "run_synthetic_workload": "flashdec.workloads",
    "run_scheduler_workload": "flashdec.workloads",
    "run_integrated_workload": "flashdec.workloads",
    "WorkloadResult": "flashdec.workloads",
    "SchedulerWorkloadResult": "flashdec.workloads",
    "IntegratedWorkloadResult": "flashdec.workloads",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__
