"""What a drafter is asked for: :class:`DraftRequest`, one request's context and budget, and
the :class:`Drafter` protocol every method implements (n-gram lookup, a draft model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DraftRequest:
    """One request of a drafting round: its context is ``prompt`` (token ids, on the model's
    device), then ``tokens`` (generated and recorded) and ``tail`` (generated, not recorded
    yet); it wants up to ``num_tokens`` drafts."""

    prompt: torch.Tensor
    tokens: Sequence[int]
    num_tokens: int
    tail: Sequence[int] = ()


class Drafter(Protocol):
    def propose_many(self, wanted: Mapping[object, DraftRequest]) -> dict[object, list[int]]:
        """Each request's drafts (at most its ``num_tokens``; possibly none)."""
        ...

    def forget(self, rid) -> None:
        """Drop what the drafter keeps for request ``rid``."""
        ...
