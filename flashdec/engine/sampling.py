"""Sampling: the parameters of one request's token choice and the draw itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashdec._checks import check_fraction, check_positive_int, type_name


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature`` is 0 (the default); else softmax sampling at ``temperature``
    restricted to the ``top_k`` most likely tokens (0 = all) and the ``top_p`` nucleus."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {type_name(self.temperature)}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        check_fraction("top_p", self.top_p)
        check_positive_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            check_positive_int("seed", self.seed, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, s: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits [B, V]``: softmax at ``s.temperature`` over the ``top_k``
    most likely tokens and the ``top_p`` nucleus."""
    return torch.multinomial(probabilities(logits, s), 1, generator=generator).flatten()


def probabilities(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample` draws from, per row of ``logits [B, V]`` (float32)."""
    scores = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(scores, min(s.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs > s.top_p  # keep the smallest prefix reaching top_p
        sorted_scores = sorted_scores.masked_fill(drop, -math.inf)
        scores = torch.full_like(scores, -math.inf).scatter(-1, order, sorted_scores)
    return torch.softmax(scores, dim=-1)
