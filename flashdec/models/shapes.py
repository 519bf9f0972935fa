"""Built-in model shapes with random weights, built directly on the target device.

``tiny`` (the default) is small enough for CPU demos and CI; ``llama3-8b-shape`` is the issue's
benchmark model (Llama-3-8B geometry and RoPE scaling, bf16); ``mistral-7b-window-shape`` is its
sliding-window counterpart (Mistral-7B-v0.1 geometry, a 4096-token window); ``tiny-<family>``
are small shapes that exercise each family's features (llama3 RoPE scaling; Qwen2 q/k/v bias
and tied embeddings; Mistral; Qwen3 q/k norm with head_dim != hidden / heads).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from flashdec._checks import FLOAT_DTYPES
from flashdec.models.spec import config_problems

_LLAMA3_ROPE_8B = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class ModelShape:
    """A transformers config for one family, by name; weights are random."""

    family: str  # transformers model_type
    dtype: torch.dtype  # default weight dtype
    description: str
    config: dict[str, Any] = field(hash=False)  # keyword arguments of the family's config

    def make_config(self) -> PretrainedConfig:
        return AutoConfig.for_model(self.family, **copy.deepcopy(self.config))


# Tiny shapes use a larger init scale than transformers' 0.02 so that attention, not the
# embedding alone, decides the next token (the exactness tests would be weak otherwise).
_TINY = {"initializer_range": 0.2, "max_position_embeddings": 512, "vocab_size": 256}

BUILTIN_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(
        "llama",
        torch.float32,
        "Llama, 4 layers, hidden 128, 4/2 heads of 32, vocab 512, llama3 RoPE scaling",
        {
            **_TINY,
            "vocab_size": 512,
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                **_LLAMA3_ROPE_8B,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 256,
            },
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "llama3-8b-shape": ModelShape(
        "llama",
        torch.bfloat16,
        "Llama-3-8B geometry: 32 layers, hidden 4096, 32/8 heads of 128, intermediate 14336, "
        "vocab 128256, llama3 RoPE scaling",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": _LLAMA3_ROPE_8B,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
        },
    ),
    "mistral-7b-window-shape": ModelShape(
        "mistral",
        torch.bfloat16,
        "Mistral-7B-v0.1 geometry: 32 layers, hidden 4096, 32/8 heads of 128, intermediate "
        "14336, vocab 32000, a 4096-token sliding window in every layer",
        {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "tiny-llama": ModelShape(
        "llama",
        torch.float32,
        "Llama, 2 layers, hidden 64, 4/2 heads of 16, llama3 RoPE scaling over short contexts",
        {
            **_TINY,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {
                **_LLAMA3_ROPE_8B,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
            },
            "eos_token_id": 2,
        },
    ),
    "tiny-qwen2": ModelShape(
        "qwen2",
        torch.float32,
        "Qwen2, 2 layers, hidden 64, 4/1 heads of 16 (MQA), q/k/v bias, tied embeddings",
        {
            **_TINY,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "eos_token_id": 3,
        },
    ),
    "tiny-mistral": ModelShape(
        "mistral",
        torch.float32,
        "Mistral, 2 layers, hidden 96, 6/2 heads of 16, no sliding window",
        {
            **_TINY,
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "sliding_window": None,
            "eos_token_id": 2,
        },
    ),
    "tiny-qwen2-swa": ModelShape(
        "qwen2",
        torch.float32,
        "Qwen2, 4 layers alternating a 16-token sliding window and full attention, 4/2 heads of 16",
        {
            **_TINY,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "eos_token_id": 3,
        },
    ),
    "tiny-mistral-swa": ModelShape(
        "mistral",
        torch.float32,
        "Mistral, 2 layers, hidden 96, 6/2 heads of 16, a 16-token sliding window",
        {
            **_TINY,
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "sliding_window": 16,
            "eos_token_id": 2,
        },
    ),
    "tiny-qwen3": ModelShape(
        "qwen3",
        torch.float32,
        "Qwen3, 2 layers, hidden 64, 4/2 heads of 32 (q dim 128 != hidden), q/k RMSNorm",
        {
            **_TINY,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "eos_token_id": 4,
        },
    ),
}
DEFAULT_SHAPE = "tiny"


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_model(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> PreTrainedModel:
    """A causal LM of ``config`` with random weights (transformers' own init), created directly
    on ``device`` in ``dtype`` (no CPU copy first); the global RNG state is left as it was.

    Raises ValueError naming every unsupported feature of ``config`` before allocating.
    """
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    problems = config_problems(config)
    if problems:
        raise ValueError("FlashDec cannot run this config: unsupported " + "; ".join(problems))
    device = torch.device(device)
    cuda_devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def build_random_model(
    name: str = DEFAULT_SHAPE,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """The built-in shape ``name`` (a key of :data:`BUILTIN_SHAPES`) with random weights.

    ``dtype`` defaults to the shape's (float32 for the tiny ones, bfloat16 for
    ``llama3-8b-shape``), ``device`` to the GPU when there is one.
    """
    shape = BUILTIN_SHAPES.get(name)
    if shape is None:
        raise ValueError(
            f"unknown built-in model shape {name!r}; known: {', '.join(BUILTIN_SHAPES)}"
        )
    return random_model(
        shape.make_config(),
        dtype=shape.dtype if dtype is None else dtype,
        device=default_device() if device is None else device,
        seed=seed,
    )
