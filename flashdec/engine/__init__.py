"""DecodeEngine: scheduler decisions, cache transactions and kernels for one decode step."""

from flashdec.engine.engine import DecodeEngine, EngineRequestState, StepResult

__all__ = ["DecodeEngine", "EngineRequestState", "StepResult"]
