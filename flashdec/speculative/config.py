"""``SpeculativeConfig``: how :class:`flashdec.LLM` drafts and verifies tokens (SPEC §8.8)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashdec._checks import check_choice, check_positive_int, type_name

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 64  # drafts per request per step at most (a verification step's width)
MAX_MIN_SPEEDUP = 4.0  # beyond this the gate would hold nearly every speculation off


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for :class:`flashdec.LLM`.

    ``method="ngram"`` (prompt lookup): each step, the longest n-gram (``max_ngram`` down to
    ``min_ngram`` tokens) that ends the request's context (prompt + generated) and occurred
    earlier in it proposes the up to ``num_tokens`` tokens that followed that occurrence.

    ``method="draft"``: ``draft_model`` — a smaller model of the same tokenizer (a
    transformers model, a local model directory or a built-in name, as ``flashdec.LLM``
    takes) — proposes ``num_tokens`` tokens greedily, from its own paged KV cache on the
    target's device and in its dtype.

    ``min_speedup``: speculation is held off, per batch size, while its measured tokens per
    second fall below this many times plain decoding's (see
    :class:`~flashdec.speculative.adaptive.SpeculationGate`); ``None`` always speculates
    (tests, and measuring the mechanism itself).
    """

    method: str = "ngram"
    num_tokens: int = 4
    min_ngram: int = 1
    max_ngram: int = 4
    draft_model: torch.nn.Module | str | os.PathLike | None = None
    min_speedup: float | None = 1.0

    def __repr__(self) -> str:  # a module's own repr would print its whole architecture
        draft = self.draft_model
        if isinstance(draft, torch.nn.Module):
            draft = f"<{type(draft).__name__}>"
        elif draft is not None:
            draft = repr(draft)
        shown = "" if draft is None else f", draft_model={draft}"
        if self.min_speedup != 1.0:
            shown += f", min_speedup={self.min_speedup!r}"
        return (
            f"SpeculativeConfig(method={self.method!r}, num_tokens={self.num_tokens}, "
            f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}{shown})"
        )

    def __post_init__(self) -> None:
        check_choice("method", self.method, SPECULATIVE_METHODS)
        check_positive_int("num_tokens", self.num_tokens)
        if self.num_tokens > MAX_NUM_TOKENS:
            raise ValueError(f"num_tokens must be <= {MAX_NUM_TOKENS}, got {self.num_tokens}")
        check_positive_int("min_ngram", self.min_ngram)
        check_positive_int("max_ngram", self.max_ngram)
        if self.max_ngram < self.min_ngram:
            raise ValueError(
                f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})"
            )
        speedup = self.min_speedup
        if speedup is not None:
            if isinstance(speedup, bool) or not isinstance(speedup, (int, float)):
                raise TypeError(f"min_speedup must be a number or None, got {type_name(speedup)}")
            if not 0.0 < speedup <= MAX_MIN_SPEEDUP:
                raise ValueError(f"min_speedup must be in (0, {MAX_MIN_SPEEDUP}], got {speedup!r}")
        draft = self.draft_model
        if self.method == "draft":
            if draft is None:
                raise ValueError("method='draft' needs draft_model= (a smaller model)")
            if not isinstance(draft, (torch.nn.Module, str, os.PathLike)):
                raise TypeError(
                    "draft_model must be a transformers model, a local model directory or a "
                    f"built-in name, got {type_name(draft)}"
                )
        elif draft is not None:
            raise ValueError(f"draft_model is used only with method='draft', not {self.method!r}")
