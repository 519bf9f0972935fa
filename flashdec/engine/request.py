"""One request of :class:`flashdec.LLM` as the model runner keeps it: its prompt, sampling,
generated tokens and timestamps (:class:`Request`), and the clock those timestamps read
(:func:`now`).
"""

from __future__ import annotations

import time

import torch

from flashdec.engine.sampling import GREEDY, SamplingParams


class Request:
    """One request of :class:`flashdec.LLM`: its prompt, sampling, tokens and timestamps."""

    __slots__ = (
        "error",
        "finished_at",
        "first_token_at",
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
        """Back to before its admission (the step that admitted it was taken back)."""
        self.tokens.clear()
        self.first_token_at = self.finished_at = None


def now(device: torch.device | None = None) -> float:
    """Host time (``perf_counter``); with a CUDA device, once its queued work is done."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
