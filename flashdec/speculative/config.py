"""``SpeculativeConfig``: how :class:`flashdec.LLM` drafts and verifies tokens (SPEC §8.8)."""

from __future__ import annotations

from dataclasses import dataclass

from flashdec._checks import check_choice, check_positive_int

SPECULATIVE_METHODS = ("ngram",)  # built; "draft" (a second model) is not yet
MAX_NUM_TOKENS = 64  # drafts per request per step at most (a verification step's width)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for :class:`flashdec.LLM`.

    ``method="ngram"`` (prompt lookup): each step, the longest n-gram (``max_ngram`` down to
    ``min_ngram`` tokens) that ends the request's context (prompt + generated) and occurred
    earlier in it proposes the up to ``num_tokens`` tokens that followed that occurrence.
    """

    method: str = "ngram"
    num_tokens: int = 4
    min_ngram: int = 1
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if self.method == "draft":
            raise ValueError(
                "method='draft' (a second, smaller model) is not built yet; the methods "
                f"available are {', '.join(map(repr, SPECULATIVE_METHODS))}"
            )
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
