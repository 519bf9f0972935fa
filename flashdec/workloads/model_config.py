"""The configs of the commands that run a real model through :class:`flashdec.LLM`:
:class:`ModelRunConfig` (the model, its placement, batching, caching, speculation, KV dtype),
:class:`GenerateConfig` (``flashdec generate``) and :class:`ServeConfig` (``flashdec
bench-serve``). Each checks the whole configuration in ``__post_init__`` and estimates its
memory before anything loads.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from flashdec._checks import FLOAT_DTYPES, FP8_COMPUTE_DTYPES
from flashdec.runtime import available_host_bytes
from flashdec.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from flashdec.speculative.config import MAX_NUM_TOKENS as MAX_SPECULATIVE_TOKENS
from flashdec.workloads.knobs import (
    DEVICES,
    DTYPES,
    SEED_MAX,
    MemoryEstimate,
    check_fields,
    check_min_max,
    knob,
)

CUDA_GRAPHS = ("auto", "on", "off")
SPECULATIVE_CHOICES = ("off", *SPECULATIVE_METHODS)
KV_CACHE_DTYPES = ("auto", "fp8")  # flashdec.LLM's kv_cache_dtype
KV_SCALE_MODES = ("dynamic", "static")  # flashdec.LLM's kv_scales, or a path
_DEFAULT_SPECULATIVE_TOKENS = SpeculativeConfig.num_tokens


@dataclass(frozen=True)
class ModelRunConfig:
    """Knobs shared by the commands that run a real model (``generate``, ``bench-serve``)."""

    model: str = knob(
        "tiny",
        "a built-in random-weight shape (tiny, llama3-8b-shape, tiny-qwen2, ...), the built-in "
        "real model smollm2 (SmolLM2-135M-Instruct, with its tokenizer) or a local model "
        "directory",
    )
    dtype: str = knob(
        "auto",
        "the model's dtype (auto: the shape's or the checkpoint's)",
        choices=("auto", *DTYPES),
    )
    device: str = knob(
        "auto", "where the model runs (auto: the GPU when there is one)", choices=DEVICES
    )
    cuda_graphs: str = knob(
        "auto", "capture decode steps in CUDA graphs (auto: on a GPU)", choices=CUDA_GRAPHS
    )
    max_batch_size: int = knob(64, "requests decoded per step at most", minimum=1, maximum=1024)
    max_num_batched_tokens: int = knob(
        2048,
        "tokens one step brings at most: the running requests' decode tokens, then prompt chunks",
        minimum=1,
        maximum=1 << 20,
    )
    prefix_caching: bool = knob(
        True, "reuse the K/V of prompt blocks seen before (automatic prefix caching)"
    )
    host_kv_gib: float = knob(
        0.0,
        "GiB of pinned host memory for the prefix cache's host tier: cached KV blocks the GPU "
        "pool evicts are copied there and back up on a hit instead of recomputed (0: off)",
        minimum=0.0,
    )
    seed: int = knob(
        0, "random seed (weights of a built-in shape, prompts)", minimum=0, maximum=SEED_MAX
    )
    speculative: str = knob(
        "off",
        "speculative decoding: off, ngram (prompt lookup drafts) or draft (a smaller model's "
        "drafts, --draft-model), optionally with the drafts per step as ngram:K / draft:K; "
        "verified in one step, greedy output is unchanged",
    )
    draft_model: str = knob(
        "",
        "with --speculative draft: the draft model, a built-in name or a local model "
        "directory of the target's tokenizer",
    )
    num_speculative_tokens: int = knob(
        _DEFAULT_SPECULATIVE_TOKENS,
        "drafts per request per step at most (with --speculative ngram)",
        minimum=1,
        maximum=MAX_SPECULATIVE_TOKENS,
        why="a verification step's width",
    )
    ngram_min: int = knob(
        1, "shortest n-gram the drafter matches (with --speculative ngram)", minimum=1
    )
    ngram_max: int = knob(
        4, "longest n-gram the drafter matches (with --speculative ngram)", minimum=1
    )
    kv_cache_dtype: str = knob(
        "auto",
        "KV cache storage (auto: the model's dtype; fp8: float8_e4m3fn with a scale per layer "
        "and KV head, see --kv-scales; needs a float16/bfloat16 model)",
        choices=KV_CACHE_DTYPES,
    )
    kv_scales: str = knob(
        "dynamic",
        "with --kv-cache-dtype fp8, where the scales come from: dynamic (calibrated per layer "
        "and KV head from the first prompt's K/V), static (1.0 everywhere) or the path of a "
        ".safetensors file or checkpoint directory with k_scale / v_scale fields",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_speculative()
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "device 'cuda' was requested, but torch sees no CUDA device; use 'cpu' or 'auto'"
            )
        if self.cuda_graphs == "on" and not self.on_gpu:
            raise ValueError("cuda_graphs 'on' needs a GPU (use 'auto' or 'off')")
        config = self.model_config()
        dtype = self.model_dtype(config)
        if self.kv_cache_dtype == "fp8" and dtype not in FP8_COMPUTE_DTYPES:
            where = "--dtype float32" if self.dtype != "auto" else f"the dtype of {self.model!r}"
            raise ValueError(
                f"kv_cache_dtype fp8 needs a float16 or bfloat16 model; this one would run in "
                f"{str(dtype).removeprefix('torch.')} ({where}): add --dtype bfloat16"
            )
        if self.kv_scales not in KV_SCALE_MODES:
            if self.kv_cache_dtype != "fp8":
                raise ValueError("--kv-scales needs --kv-cache-dtype fp8")
            if not Path(self.kv_scales).exists():
                raise ValueError(
                    f"--kv-scales: {self.kv_scales!r} is neither dynamic, static nor an existing "
                    "file or directory"
                )
        elif self.kv_scales == "static" and self.kv_cache_dtype != "fp8":
            raise ValueError("--kv-scales needs --kv-cache-dtype fp8")
        self.draft_config()  # an unknown draft model fails here, before anything loads
        if self.host_kv_gib and not self.prefix_caching:
            raise ValueError("--host-kv-gib needs prefix caching (drop --no-prefix-caching)")
        available = available_host_bytes()
        if available is not None and self.host_kv_gib * 2**30 > available:
            raise ValueError(
                f"--host-kv-gib {self.host_kv_gib:g} is more than the "
                f"{available / 2**30:.1f} GiB of host memory available"
            )

    _SPECULATIVE_KNOBS = ("num_speculative_tokens", "ngram_min", "ngram_max")

    def speculation(self) -> tuple[str, int]:
        """``(method, drafts per step)`` of ``speculative`` (``METHOD[:K]``; without ``:K``,
        ``num_speculative_tokens``)."""
        method, colon, count = self.speculative.partition(":")
        if method not in SPECULATIVE_CHOICES or (colon and method == "off"):
            raise ValueError(
                "speculative must be one of 'off', 'ngram', 'draft' (or 'ngram:K', 'draft:K': "
                f"K drafts per step), got {self.speculative!r}"
            )
        if not colon:
            return method, self.num_speculative_tokens
        if not count.isdigit():
            raise ValueError(f"speculative {self.speculative!r}: K must be a whole number")
        if self.num_speculative_tokens != _DEFAULT_SPECULATIVE_TOKENS:
            raise ValueError(
                f"give the drafts per step once: --speculative {self.speculative} or "
                "--num-speculative-tokens"
            )
        return method, int(count)

    def _check_speculative(self) -> None:
        method, _ = self.speculation()
        if self.draft_model and method != "draft":
            raise ValueError("--draft-model needs --speculative draft")
        if method == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model (a smaller model)")
        if method == "off":
            defaults = {f.name: f.default for f in fields(ModelRunConfig)}
            given = [n for n in self._SPECULATIVE_KNOBS if getattr(self, n) != defaults[n]]
            if given:
                flags = ", ".join("--" + n.replace("_", "-") for n in given)
                raise ValueError(f"{flags} needs --speculative ngram")
            return
        check_min_max(self, "ngram_min", "ngram_max")
        self.speculative_config()  # SpeculativeConfig's own rules, in one place

    def speculative_config(self) -> SpeculativeConfig | None:
        """What ``flashdec.LLM(speculative=...)`` gets (None: speculation off)."""
        method, num_tokens = self.speculation()
        if method == "off":
            return None
        return SpeculativeConfig(
            method=method,
            num_tokens=num_tokens,
            min_ngram=self.ngram_min,
            max_ngram=self.ngram_max,
            draft_model=self.draft_model or None,
        )

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.on_gpu else "cpu")

    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype == "auto" else DTYPES[self.dtype]

    def graphs(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.cuda_graphs]

    def model_config(self):
        """The model's transformers config, read alone (see :func:`read_model_config`)."""
        return read_model_config(self.model, "model")

    def draft_config(self):
        """The draft model's config (with ``--speculative draft``), else None."""
        return read_model_config(self.draft_model, "draft_model") if self.draft_model else None

    def check_model(self) -> int:
        """The model's max positions, from its config alone (see ``model_config``)."""
        return int(self.model_config().max_position_embeddings)

    def model_dtype(self, config) -> torch.dtype:
        """What the model runs in: ``dtype``, else the built-in shape's, else the checkpoint's
        (float32, transformers' default, when its config names none)."""
        from flashdec.models import BUILTIN_SHAPES

        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.model in BUILTIN_SHAPES:
            return BUILTIN_SHAPES[self.model].dtype
        saved = getattr(config, "dtype", None)
        saved = getattr(torch, saved, None) if isinstance(saved, str) else saved
        return saved if saved in FLOAT_DTYPES else torch.float32

    def kv_description(self) -> str:
        """What the estimated KV cache is made of, for messages."""
        return f"one request of {self.longest_request():,} tokens, the least the pool must hold"

    def memory_estimate(self) -> MemoryEstimate:
        """What the run needs at least, on its device: the weights (every parameter once, in
        the run's dtype), a KV pool that holds the longest request (``flashdec.LLM`` sizes its
        pool to what is free: more requests run at once when memory allows) and the LLM's
        activation reserve. A directory's or a real model's weights load on the host first; a
        built-in shape's are made in place."""
        from flashdec.kv_pool import ACTIVATION_RESERVE  # what LLM reserves, one definition
        from flashdec.llm import LLM
        from flashdec.models import BUILTIN_SHAPES

        block_size = inspect.signature(LLM).parameters["block_size"].default  # load_llm keeps it

        config = self.model_config()
        dtype = self.model_dtype(config)
        weights, per_token = _weights_and_kv_per_token(config, dtype)
        per_token *= 1 if self.kv_cache_dtype == "fp8" else dtype.itemsize
        draft = self.draft_config()
        if draft is not None:  # the draft's weights and its pool of as many tokens, in dtype
            draft_weights, draft_per_token = _weights_and_kv_per_token(draft, dtype)
            weights += draft_weights
            per_token += draft_per_token * dtype.itemsize
        kv_cache = -(-self.longest_request() // block_size) * block_size * per_token
        device_bytes = weights + kv_cache + ACTIVATION_RESERVE
        device = self.torch_device()
        if device.type == "cpu":
            host = device_bytes
        else:
            host = 0 if self.model in BUILTIN_SHAPES else weights
        return MemoryEstimate(device, kv_cache, device_bytes, host, weight_bytes=weights)


@dataclass(frozen=True)
class GenerateConfig(ModelRunConfig):
    """Knobs of ``flashdec generate``."""

    prompt: str = knob("", "a text prompt (needs the model's tokenizer); empty: random token ids")
    chat: bool = knob(False, "send the prompt as a user turn in the tokenizer's chat template")
    prompt_len: int = knob(32, "tokens of each random prompt", minimum=1, maximum=131072)
    batch: int = knob(4, "random prompts generated together", minimum=1, maximum=1024)
    max_new_tokens: int = knob(32, "tokens to generate per prompt", minimum=1, maximum=131072)
    temperature: float = knob(0.0, "sampling temperature (0: greedy)", minimum=0.0, maximum=100.0)
    top_k: int = knob(0, "sample among the k most likely tokens (0: all)", minimum=0)
    top_p: float = knob(
        1.0, "sample within this probability nucleus, in (0, 1]", above=0.0, maximum=1.0
    )
    ignore_eos: bool = knob(False, "generate max-new-tokens even after EOS")
    compare: bool = knob(False, "also run transformers' greedy generate: report agreement")
    warmup_run: bool = knob(
        False,
        "generate once untimed first (first-use kernel compiles and CUDA-graph captures are "
        "then out of the speed figures)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compare and self.temperature > 0:
            raise ValueError("compare needs greedy decoding (temperature 0)")
        if self.prompt and self.batch != 1 and self.batch != GenerateConfig.batch:
            raise ValueError("a text prompt is one request: drop --batch")
        if self.prompt and self.prompt_len != GenerateConfig.prompt_len:
            raise ValueError("a text prompt sets its own length: drop --prompt-len")
        if self.chat and not self.prompt:
            raise ValueError("chat needs a text prompt (--prompt)")
        from flashdec.models import REAL_MODELS
        from flashdec.models.loading import has_tokenizer

        if self.prompt and self.model not in REAL_MODELS and not has_tokenizer(self.model):
            raise ValueError(
                f"a text prompt needs the model's tokenizer, and {self.model!r} has none (a "
                "built-in shape, or a directory without tokenizer files): use --prompt-len"
            )
        limit = self.check_model()
        length = (0 if self.prompt else self.prompt_len) + self.max_new_tokens
        if length > limit:
            raise ValueError(
                f"prompt_len + max_new_tokens ({length}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )

    def longest_request(self) -> int:
        """Tokens the longest request holds: prompt and output."""
        if self.prompt:
            return self.text_token_bound(self.prompt) + self.max_new_tokens
        return self.prompt_len + self.max_new_tokens

    @staticmethod
    def text_token_bound(text: str) -> int:
        """At most how many tokens ``text`` takes as a prompt: a token is at least one byte;
        room for special tokens and a chat template."""
        return len(text.encode()) + 64

    @classmethod
    def demo_defaults(cls, seed: int = 0) -> GenerateConfig:
        """What ``flashdec demo`` generates: the tiny model on the CPU, the Llama-3-8B shape on a
        GPU, each checked token for token against transformers."""
        if torch.cuda.is_available():
            return cls(
                model="llama3-8b-shape",
                batch=8,
                prompt_len=512,
                max_new_tokens=64,
                compare=True,
                ignore_eos=True,
                seed=seed,
                warmup_run=True,
            )
        return cls(
            model="tiny",
            batch=4,
            prompt_len=32,
            max_new_tokens=32,
            compare=True,
            ignore_eos=True,
            seed=seed,
        )


@dataclass(frozen=True)
class ServeConfig(ModelRunConfig):
    """Knobs of ``flashdec bench-serve``: Poisson arrivals through the serving loop."""

    num_requests: int = knob(64, "requests in the run", minimum=1, maximum=1_000_000)
    request_rate: float = knob(
        8.0, "mean arrivals per second (Poisson)", minimum=0.001, maximum=1e6
    )
    min_prompt_len: int = knob(16, "shortest prompt (tokens)", minimum=1, maximum=131072)
    max_prompt_len: int = knob(128, "longest prompt (tokens)", minimum=1, maximum=131072)
    max_new_tokens: int = knob(32, "tokens per request (EOS ignored)", minimum=1, maximum=131072)
    compare: bool = knob(
        False, "check every request's tokens against transformers' greedy generate afterwards"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_min_max(self, "min_prompt_len", "max_prompt_len")
        limit = self.check_model()
        if self.max_prompt_len + self.max_new_tokens > limit:
            raise ValueError(
                f"max_prompt_len + max_new_tokens ({self.max_prompt_len + self.max_new_tokens}) "
                f"exceeds the model's max_position_embeddings ({limit})"
            )

    def longest_request(self) -> int:
        """Tokens the longest request holds: prompt and output."""
        return self.max_prompt_len + self.max_new_tokens


def read_model_config(name: str, label: str):
    """The transformers config of model ``name`` (``label``: the option, for messages), read
    alone (no weights, none of a directory's code): a built-in shape's, a built-in real
    model's (from its registry entry, once its packages are found) or a directory's that
    ``check_model_dir`` accepts."""
    from pathlib import Path

    from flashdec.models import BUILTIN_SHAPES, REAL_MODELS
    from flashdec.models.loading import check_model_dir
    from flashdec.models.real import real_model_problem

    if name in REAL_MODELS:
        problem = real_model_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return REAL_MODELS[name].config()
    if name in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[name].make_config()
    try:
        is_dir = bool(name) and Path(name).is_dir()  # Path("") is "."
    except OSError:  # e.g. a name too long for a path
        is_dir = False
    if is_dir:
        return check_model_dir(name)
    raise ValueError(
        f"{label} {name!r} is neither a built-in shape ({', '.join(BUILTIN_SHAPES)}), "
        f"a built-in real model ({', '.join(REAL_MODELS)}) nor a local model directory"
    )


def _weights_and_kv_per_token(config, dtype: torch.dtype) -> tuple[int, int]:
    """A model's weight bytes in ``dtype`` and its K/V elements per token, from its config."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: nothing is allocated
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    head_dim = model.model.layers[0].self_attn.head_dim
    return weights, 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
