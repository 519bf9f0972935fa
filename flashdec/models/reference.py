"""A model's logits in float32, the yardstick for bf16 runs (FlashDec's and transformers' own)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


@torch.no_grad()
def float32_logits(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, V]`` of one sequence ``input_ids [T]`` with every weight upcast to float32.

    The model's parameters are swapped for float32 copies during the forward and restored after
    (the model is unchanged on return); this needs room for a float32 copy of the weights.
    """
    originals = {name: p.data for name, p in model.named_parameters()}
    try:
        for p in model.parameters():
            p.data = p.data.float()
        return model(input_ids[None]).logits[0].float()
    finally:
        for name, p in model.named_parameters():
            p.data = originals[name]
