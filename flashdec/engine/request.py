"""One request of :class:`flashdec.LLM` as the model runner keeps it: its prompt, sampling,
generated tokens and timestamps (:class:`Request`), the clock those timestamps read (:func:`now`)
and the timestamps as a user sees them (:class:`RequestTiming`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flashdec.engine.sampling import GREEDY, SamplingParams


class Request:
    """One request of :class:`flashdec.LLM`: its prompt, sampling, tokens and timestamps."""

    __slots__ = (
        "context",
        "error",
        "finished_at",
        "first_token_at",
        "folded",
        "generator",
        "ignore_eos",
        "max_new_tokens",
        "prompt",
        "sampling",
        "submitted_at",
        "tokens",
    )

    def __init__(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        ignore_eos: bool,
        now: float,
        sampling: SamplingParams | None = None,  # None: greedy
        generator: torch.Generator | None = None,  # None when greedy
    ):
        self.prompt = prompt
        # what its admission imports into the cache: the prompt, or after a swap (preemption)
        # the prompt and the first ``folded`` generated tokens
        self.context = prompt
        self.folded = 0
        self.max_new_tokens = max_new_tokens
        self.ignore_eos = ignore_eos
        self.sampling = sampling or GREEDY
        self.generator = generator
        self.tokens: list[int] = []
        self.submitted_at = now
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.error: str | None = None  # why it never ran (the scheduler rejected it)

    def reset(self) -> None:
        """Back to before its admission (the step that admitted it was taken back): the tokens
        its context holds stay."""
        del self.tokens[self.folded :]
        if not self.tokens:
            self.first_token_at = None
        self.finished_at = None

    def fold(self) -> list[int]:
        """Swapped out: its context becomes the prompt and every token generated so far (it
        resumes by importing them); returns that context's token ids."""
        generated = torch.tensor(self.tokens, dtype=self.prompt.dtype, device=self.prompt.device)
        self.context = torch.cat([self.prompt, generated])
        self.folded = len(self.tokens)
        return self.context.tolist()

    def time_per_output_token(self) -> float:
        """Mean seconds per token after the first (0.0 with fewer than two tokens)."""
        if len(self.tokens) < 2 or self.first_token_at is None or self.finished_at is None:
            return 0.0
        return (self.finished_at - self.first_token_at) / (len(self.tokens) - 1)

    def timing(self) -> RequestTiming:
        return RequestTiming(
            self.submitted_at, self.first_token_at, self.finished_at, len(self.tokens)
        )


def now(device: torch.device | None = None) -> float:
    """Host time (``perf_counter``); with a CUDA device, once its queued work is done."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class RequestTiming:
    """Host timestamps (``time.perf_counter``) of one request added with ``add_request``."""

    submitted_at: float
    first_token_at: float | None  # None until its prompt is prefilled
    finished_at: float | None  # None while it runs
    num_tokens: int
