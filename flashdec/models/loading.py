"""Models by name: a local transformers directory (weights and, if present, its tokenizer), a
built-in real model (a GGUF file an installed package ships, with its tokenizer) or a built-in
random-weight shape. Nothing is downloaded: every load is ``local_files_only``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from flashdec._checks import FLOAT_DTYPES
from flashdec.models.real import REAL_MODELS, load_gguf, real_model_file
from flashdec.models.shapes import BUILTIN_SHAPES, build_random_model, default_device
from flashdec.models.spec import check_supported, config_problems

# any of these marks a saved tokenizer (fast, sentencepiece or BPE vocab files)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a saved tokenizer."""
    return Path(directory).is_dir() and any(
        (Path(directory) / name).is_file() for name in _TOKENIZER_FILES
    )


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel  # eval mode, on its target device
    tokenizer: PreTrainedTokenizerBase | None  # None: no tokenizer saved, or a built-in shape
    source: str  # the directory, or the built-in model's or shape's name


def _check_dtype(dtype: object) -> None:
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be None or one of float32, float16, bfloat16, got {dtype}")


def load_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> LoadedModel:
    """Load a model directory written by ``save_pretrained`` (and its tokenizer, if saved), or
    the built-in real model of that name (:data:`~flashdec.models.real.REAL_MODELS`, e.g.
    ``"smollm2"``; a name wins over a directory of the same name).

    ``dtype`` defaults to the checkpoint's own (float32 for a GGUF file), ``device`` to the GPU
    when there is one. The config is checked before any weight is read.

    Raises:
        TypeError: ``path`` is not a path, or ``dtype`` is not a float dtype.
        ValueError: a missing directory, no ``config.json`` or no weights in it (each naming the
            directory), a built-in real model whose package is not installed (naming the
            package), or an unsupported architecture or feature (each one named).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    _check_dtype(dtype)
    if isinstance(path, str) and path in REAL_MODELS:
        device = default_device() if device is None else device
        model, tokenizer = load_gguf(real_model_file(path), dtype=dtype, device=device)
        return LoadedModel(model, tokenizer, path)
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"model directory {str(directory)!r} does not exist")
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"{str(directory)!r} has no config.json: not a transformers model directory"
        )
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    problems = config_problems(config)
    if problems:
        raise ValueError(
            f"FlashDec cannot run the model in {str(directory)!r}: unsupported "
            + "; ".join(problems)
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, config=config, local_files_only=True, dtype=dtype or "auto"
        )
    except OSError as exc:  # transformers' error for a directory without weight files
        raise ValueError(f"could not load weights from {str(directory)!r}: {exc}") from exc
    # transformers places weights on a device at load time only through accelerate (not a
    # dependency): load on the CPU, then move
    model = model.to(default_device() if device is None else device).eval()
    check_supported(model)
    tokenizer = None
    if has_tokenizer(directory):
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return LoadedModel(model, tokenizer, str(directory))


def resolve_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """``flashdec generate --model``: a built-in shape name (random weights from ``seed``, no
    tokenizer), a built-in real model name or a local model directory."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"model must be a str or os.PathLike, got {type(name_or_path).__name__}")
    name = str(name_or_path)
    if name in BUILTIN_SHAPES:
        _check_dtype(dtype)
        return LoadedModel(
            build_random_model(name, dtype=dtype, device=device, seed=seed), None, name
        )
    if name in REAL_MODELS or Path(name).is_dir():
        return load_model(name, dtype=dtype, device=device)
    raise ValueError(
        f"model {name!r} is neither a local model directory nor a built-in model "
        f"({', '.join(REAL_MODELS)}) or shape ({', '.join(BUILTIN_SHAPES)})"
    )
