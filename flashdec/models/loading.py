"""Models by name: a local transformers directory (weights and, if present, its tokenizer), a
built-in real model (a GGUF file an installed package ships, with its tokenizer) or a built-in
random-weight shape. Nothing is downloaded: every load is ``local_files_only``, and no code from
a model directory ever runs: every load passes ``trust_remote_code=False``, and a config that
asks for the directory's own code (``auto_map``) is refused before transformers reads it."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from flashdec._checks import FLOAT_DTYPES
from flashdec.models.decoder import DecoderAdapter
from flashdec.models.real import (
    _LOCAL_ONLY,
    REAL_MODELS,
    cache_root,
    converted_dir,
    load_gguf,
    real_model_file,
)
from flashdec.models.shapes import BUILTIN_SHAPES, build_random_model, default_device
from flashdec.models.spec import FAMILIES, ModelSpec, check_supported, config_problems

log = logging.getLogger("flashdec")

# any of these marks a saved tokenizer (fast, sentencepiece or BPE vocab files)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# the weight files transformers' from_pretrained reads from a local directory
_WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


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


def check_model_dir(path: str | os.PathLike) -> PretrainedConfig:
    """The config of a local model directory, checked before any weight is read and without
    running any code the directory holds.

    Raises:
        TypeError: ``path`` is not a path.
        ValueError: each naming the directory: it is missing, has no ``config.json``, or one that
            is not a JSON object; the config asks for the directory's own code (``auto_map``);
            an architecture or feature FlashDec does not run; no weight files.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    directory = Path(path)
    where = repr(str(directory))
    try:
        exists = directory.is_dir()
    except OSError:  # e.g. a name too long for a path
        exists = False
    if not exists:
        raise ValueError(f"model directory {where} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{where} has no config.json: not a transformers model directory")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the config.json in {where} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"the config.json in {where} must hold a JSON object")
    supported = f"supported architectures: {', '.join(FAMILIES)}"
    # checked here, not by transformers: it would ask on stdin whether to run the code, or
    # answer an unknown model_type with a pip hint
    if "auto_map" in raw:
        classes = raw["auto_map"]
        named = ", ".join(map(str, classes.values())) if isinstance(classes, dict) else classes
        raise ValueError(
            f"FlashDec cannot run the model in {where}: its config.json asks to run code from "
            f"the directory (auto_map: {named}), and FlashDec never does; {supported}"
        )
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"FlashDec cannot run the model in {where}: model_type={model_type!r}; {supported}"
        )
    try:
        config = AutoConfig.from_pretrained(directory, **_LOCAL_ONLY)
    except Exception as exc:  # config classes raise anything (hub's validators: Exception)
        reason = " ".join(str(exc).split())
        raise ValueError(f"could not read the config.json in {where}: {reason}") from None
    problems = config_problems(config)
    if problems:
        raise ValueError(
            f"FlashDec cannot run the model in {where}: unsupported " + "; ".join(problems)
        )
    if not any((directory / name).is_file() for name in _WEIGHT_FILES):
        raise ValueError(f"{where} holds no weights: none of {', '.join(_WEIGHT_FILES)} is there")
    return config


def load_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> LoadedModel:
    """Load a model directory written by ``save_pretrained`` (and its tokenizer, if saved), or
    the built-in real model of that name (:data:`~flashdec.models.real.REAL_MODELS`, e.g.
    ``"smollm2"``; a name wins over a directory of the same name).

    ``dtype`` defaults to the checkpoint's own (float32 for a real model), ``device`` to the GPU
    when there is one. The directory (a real model's: the one :func:`~flashdec.models.real.
    converted_dir` writes on first use) is checked by :func:`check_model_dir` before any weight
    is read; none of its code runs.

    Raises:
        TypeError: ``path`` is not a path, or ``dtype`` is not a float dtype.
        ValueError: what :func:`check_model_dir` refuses, weights or a tokenizer transformers
            cannot read (each naming the directory), a built-in real model whose package is not
            installed (naming the package), or an unsupported module (each one named).
    """
    _check_dtype(dtype)
    if isinstance(path, str) and path in REAL_MODELS:
        return _load_real(path, dtype, device)
    config = check_model_dir(path)
    directory = Path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=dtype or "auto", **_LOCAL_ONLY
        )
    except OSError as exc:  # transformers' error for unreadable weight files
        raise ValueError(f"could not load weights from {str(directory)!r}: {exc}") from exc
    # transformers places weights on a device at load time only through accelerate (not a
    # dependency): load on the CPU, then move
    model = model.to(default_device() if device is None else device).eval()
    check_supported(model)
    tokenizer = None
    if has_tokenizer(directory):
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, **_LOCAL_ONLY)
        except (OSError, ValueError) as exc:  # e.g. a tokenizer that needs the folder's code
            raise ValueError(
                f"could not load the tokenizer in {str(directory)!r}: {' '.join(str(exc).split())}"
            ) from None
    return LoadedModel(model, tokenizer, str(directory))


def _load_real(name: str, dtype: torch.dtype | None, device) -> LoadedModel:
    """A built-in real model: from its converted directory (a local model directory like any
    other), or straight from the GGUF file when the cache cannot be written."""
    file = real_model_file(name)
    try:
        directory = converted_dir(file)
    except OSError as exc:
        log.warning(
            "cannot cache %s's float32 weights under %s (%s): reading the GGUF file, which is "
            "slow, on every load (set XDG_CACHE_HOME to a writable directory)",
            name,
            cache_root(),
            exc,
        )
        device = default_device() if device is None else device
        model, tokenizer = load_gguf(file, dtype=dtype, device=device)
        return LoadedModel(model, tokenizer, name)
    loaded = load_model(directory, dtype=dtype, device=device)
    return LoadedModel(loaded.model, loaded.tokenizer, name)


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
        f"model {name!r} is neither a local model directory nor a built-in shape "
        f"({', '.join(BUILTIN_SHAPES)}) or real model ({', '.join(REAL_MODELS)})"
    )


def load_draft_model(draft_model, target: ModelSpec, max_model_len: int) -> DecoderAdapter:
    """The draft model of ``SpeculativeConfig(method="draft")`` on the target's device and in
    its dtype (a module is moved in place, as ``LLM``'s own model is), checked against the
    target (``target``: its ModelSpec): its token ids must be the target's, and it must reach
    ``max_model_len``."""
    to = {"dtype": target.dtype, "device": target.device}
    if isinstance(draft_model, torch.nn.Module):
        draft_model.to(**to)
    else:
        draft_model = resolve_model(draft_model, **to).model
    draft = DecoderAdapter(draft_model)
    spec = draft.spec
    if spec.vocab_size > target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({spec.vocab_size}) is larger than the target's "
            f"({target.vocab_size}): a draft model must share the target's tokenizer"
        )
    if spec.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model's max_position_embeddings ({spec.max_position_embeddings}) is "
            f"below max_model_len ({max_model_len}); pass a smaller max_model_len"
        )
    return draft
