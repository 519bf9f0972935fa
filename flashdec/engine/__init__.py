"""DecodeEngine: one request lifecycle over the cache, layer operations, the serving loop."""

from flashdec.engine.engine import DecodeEngine
from flashdec.engine.layer_ops import RopeAppendResult, rope_paged_kv_append
from flashdec.engine.snapshot import snapshot_from_cache
from flashdec.engine.states import EngineRequestState
from flashdec.engine.step import CapturedStep, StepResult

__all__ = [
    "CapturedStep",
    "DecodeEngine",
    "EngineRequestState",
    "RopeAppendResult",
    "StepResult",
    "rope_paged_kv_append",
    "snapshot_from_cache",
]
