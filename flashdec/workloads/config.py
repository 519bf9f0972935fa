"""Workload configurations: the frozen knobs every workload and the CLI share.

The CLI generates one ``--flag`` per field (with the field's ``help``, bounds and choices), so a
knob added here is a command-line option too. Every config checks the whole configuration in
``__post_init__`` — types, bounds, cross-field rules, the device and the backends it can run —
so a bad configuration fails before anything is allocated. ``memory_estimate()`` says what a run
will hold, so a caller can refuse what cannot fit before starting it.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, fields

import torch

from flashdec._checks import (
    FLOAT_DTYPES,
    FP8_COMPUTE_DTYPES,
    INT32_MAX,
    check_choice,
    check_positive_int,
)
from flashdec.cache.kv_spec import KVGroupSpec, check_storable, format_kv_spec, parse_kv_spec
from flashdec.engine.layer_ops import APPEND_BACKENDS, DECODE_BACKENDS
from flashdec.runtime import triton_mode
from flashdec.scheduler import SchedulerConfig
from flashdec.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from flashdec.speculative.config import MAX_NUM_TOKENS as MAX_SPECULATIVE_TOKENS
from flashdec.workloads.scheduler_workload import TRACE_NAMES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")
TRITON_BACKENDS = ("triton", "fused")  # backends that launch Triton kernels

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
# Far above any real model: they catch typos and keep every product of sizes small.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_BLOCK_SIZE = 1024
MAX_HEAD_DIM = 256  # the decode kernels' limit

# Host bytes a run keeps per request (spec, arrival, loop, engine and cache bookkeeping; the
# block-table row is counted apart) and per step (trajectory record, timings). tracemalloc on
# run_synthetic_workload (CPU, torch backends) at d015b47 measured 1.07 KB per request and
# 0.40 KB per step; these budget about twice that.
HOST_BYTES_PER_REQUEST = 2048
HOST_BYTES_PER_STEP = 800


def _knob(
    default,
    help_text: str,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    why: str = "",
    choices: tuple[str, ...] | None = None,
):
    """A config field; ``minimum``/``maximum`` (inclusive), ``above`` (exclusive, for reals) and
    ``choices`` are checked in ``__post_init__`` and shown by the CLI; ``why`` explains the
    maximum in error messages."""
    metadata = {"help": help_text, "minimum": minimum, "maximum": maximum, "why": why}
    if above is not None:
        metadata["above"] = above
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _check_fields(config) -> None:
    """Each field on its own: type, choices and bounds from its metadata."""
    for f in fields(config):
        name, value, meta = f.name, getattr(config, f.name), f.metadata
        maximum = meta["maximum"]
        if "choices" in meta:
            check_choice(name, value, meta["choices"])
        elif isinstance(f.default, str):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        elif isinstance(f.default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        elif isinstance(f.default, int):
            check_positive_int(name, value, minimum=meta["minimum"])
            if maximum is None:
                maximum = INT32_MAX  # counts reach int32 tensors; nothing sane is larger
        else:
            _check_real(name, value)
            if meta["minimum"] is not None and value < meta["minimum"]:
                raise ValueError(f"{name} must be >= {meta['minimum']}, got {value}")
            if "above" in meta and not value > meta["above"]:
                raise ValueError(f"{name} must be > {meta['above']:g}, got {value}")
        if maximum is not None and value > maximum:
            why = f" ({meta['why']})" if meta["why"] else ""
            raise ValueError(f"{name} must be <= {maximum}{why}, got {value}")


def _check_min_max(config, low: str, high: str) -> None:
    if getattr(config, low) > getattr(config, high):
        raise ValueError(
            f"{low} ({getattr(config, low)}) must not exceed {high} ({getattr(config, high)})"
        )


def _placement(device_name: str, dtype_name: str, append: str, decode: str) -> Placement:
    """``auto`` resolved: the GPU when there is one, bf16 there and fp32 on the CPU, the fused
    and Triton backends on the GPU and torch on the CPU."""
    cuda = torch.cuda.is_available()
    if device_name == "cuda" and not cuda:
        raise ValueError(
            "device 'cuda' was requested, but torch sees no CUDA device "
            "(torch.cuda.is_available() is False); use device 'cpu' or 'auto'"
        )
    device = torch.device(("cuda" if cuda else "cpu") if device_name == "auto" else device_name)
    on_gpu = device.type == "cuda"
    if dtype_name == "auto":
        dtype_name = "bfloat16" if on_gpu else "float32"
    if append == "auto":
        append = "fused" if on_gpu else "torch"
    if decode == "auto":
        decode = "triton" if on_gpu else "torch"
    if not on_gpu and triton_mode() != "interpreted":
        for name, backend in (("append_backend", append), ("decode_backend", decode)):
            if backend in TRITON_BACKENDS:
                raise ValueError(
                    f"{name} {backend!r} launches Triton kernels, which run on CPU tensors "
                    "only through Triton's interpreter: set TRITON_INTERPRET=1 before "
                    "flashdec is imported (the flashdec command does so when there is no "
                    "GPU), or use the torch backend"
                )
    return Placement(device, DTYPES[dtype_name], append, decode)


@dataclass(frozen=True)
class Placement:
    """Where and how an engine workload runs, every ``auto`` resolved."""

    device: torch.device
    dtype: torch.dtype
    append_backend: str
    decode_backend: str

    @property
    def element_bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run holds at its peak, estimated from the config before anything is allocated.

    ``device_bytes`` (KV cache, one step's Q/K/V for every layer, prompt and prefix staging) live
    on ``device``; ``host_bytes`` is the Python bookkeeping, plus ``device_bytes`` when the device
    is the CPU. Kernel workspaces and allocator slack come on top.
    """

    device: torch.device
    kv_cache_bytes: int
    device_bytes: int
    host_bytes: int
    weight_bytes: int = 0  # a model's weights (in device_bytes); the workloads have none


@dataclass(frozen=True)
class SyntheticWorkloadConfig:
    """Knobs of the single-layer dynamic workload (``auto`` = chosen from the device)."""

    num_requests: int = _knob(16, "requests in the trace", minimum=1)
    num_q_heads: int = _knob(8, "query heads", minimum=1, maximum=MAX_HEADS)
    num_kv_heads: int = _knob(2, "KV heads", minimum=1, maximum=MAX_HEADS)
    head_dim: int = _knob(
        32, "head dimension (even)", minimum=2, maximum=MAX_HEAD_DIM, why="the kernels' limit"
    )
    block_size: int = _knob(8, "tokens per KV block", minimum=1, maximum=MAX_BLOCK_SIZE)
    num_blocks: int = _knob(
        48, "blocks in the pool", minimum=1, maximum=INT32_MAX, why="block ids are int32"
    )
    max_batch_size: int = _knob(8, "requests decoded per step at most", minimum=1)
    max_active_requests: int = _knob(12, "requests resident in the cache at most", minimum=1)
    reserve_blocks: int = _knob(0, "blocks kept out of every lifetime commitment", minimum=0)
    aging_threshold: int = _knob(
        8, "overtakes before a waiting request blocks later ones", minimum=0
    )
    arrivals_per_step: float = _knob(0.5, "mean request arrivals per step (> 0)", above=0.0)
    min_context: int = _knob(4, "shortest prompt (tokens)", minimum=0)
    max_context: int = _knob(40, "longest prompt (tokens)", minimum=0)
    min_new_tokens: int = _knob(4, "fewest tokens to generate", minimum=1)
    max_new_tokens: int = _knob(24, "most tokens to generate", minimum=1)
    dtype: str = _knob(
        "auto", "KV and activation dtype (auto: fp32 CPU, bf16 GPU)", choices=("auto", *DTYPES)
    )
    device: str = _knob("auto", "where to run (auto: the GPU if there is one)", choices=DEVICES)
    append_backend: str = _knob(
        "auto", "KV append (auto: torch CPU, fused GPU)", choices=("auto", *APPEND_BACKENDS)
    )
    decode_backend: str = _knob(
        "auto", "paged decode (auto: torch CPU, triton GPU)", choices=("auto", *DECODE_BACKENDS)
    )
    seed: int = _knob(0, "random seed (arrivals, lengths, K/V values)", minimum=0, maximum=SEED_MAX)
    max_steps: int = _knob(5000, "stop after this many steps", minimum=1)
    check_invariants: bool = _knob(True, "validate the cache after every step")
    warmup_run: bool = _knob(
        False, "run the whole workload once untimed first (Triton compiles each new launch shape)"
    )
    kv_spec: str = _knob(
        "",
        "KV layer groups, e.g. '(2,48,8,2,32):float32:1;(2,48,8,2,32):float32:1:window=16' "
        "(flashdec spec SPEC explains it); it sets the layers, KV heads, head_dim, block size, "
        "pool and dtype (leave those knobs at their defaults); empty: one group from the knobs",
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.kv_spec:
            self._check_kv_spec()
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim must be even (RoPE rotates pairs of dims), got {self.head_dim}"
            )
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.reserve_blocks >= self.num_blocks:
            raise ValueError(
                f"reserve_blocks ({self.reserve_blocks}) must be below num_blocks "
                f"({self.num_blocks}): no request could ever be admitted"
            )
        _check_min_max(self, "min_context", "max_context")
        _check_min_max(self, "min_new_tokens", "max_new_tokens")
        if self.max_context + self.max_new_tokens > INT32_MAX:
            raise ValueError(
                f"max_context + max_new_tokens must be <= {INT32_MAX} (sequence lengths are "
                f"int32), got {self.max_context + self.max_new_tokens}"
            )
        self.scheduler_config()  # its own rules, checked once, in one place
        self.placement()

    # knobs a kv_spec replaces (it names every group's geometry, pool and dtype)
    _SPEC_SETS = ("num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")

    def _check_kv_spec(self) -> None:
        groups = parse_kv_spec(self.kv_spec)  # ValueError naming the group and its text
        defaults = {f.name: f.default for f in fields(self)}
        overridden = [n for n in self._SPEC_SETS if getattr(self, n) != defaults[n]]
        if overridden:
            flags = ", ".join("--" + n.replace("_", "-") for n in overridden)
            raise ValueError(
                f"kv_spec sets the KV geometry, pool and dtype: leave {flags} at the default"
            )
        check_storable(groups)
        for g, group in enumerate(groups):
            if group.dtype == torch.float8_e4m3fn:
                raise ValueError(f"kv_spec group {g}: the engine does not run FP8 groups yet")
            if group.head_dim > MAX_HEAD_DIM:
                raise ValueError(
                    f"kv_spec group {g}: head_dim must be <= {MAX_HEAD_DIM} (the kernels' "
                    f"limit), got {group.head_dim}"
                )
            if self.num_q_heads % group.num_kv_heads:
                raise ValueError(
                    f"num_q_heads ({self.num_q_heads}) must be a multiple of kv_spec group "
                    f"{g}'s num_kv_heads ({group.num_kv_heads})"
                )
            if self.reserve_blocks >= group.num_blocks:
                raise ValueError(
                    f"reserve_blocks ({self.reserve_blocks}) must be below kv_spec group {g}'s "
                    f"num_blocks ({group.num_blocks}): no request could ever be admitted"
                )

    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        """The cache's layer groups: ``kv_spec``'s, or one group made from the knobs."""
        if self.kv_spec:
            return parse_kv_spec(self.kv_spec)
        return (
            KVGroupSpec(
                2,
                self.num_blocks,
                self.block_size,
                self.num_kv_heads,
                self.head_dim,
                self.placement().dtype,
                self.layers,
            ),
        )

    def kv_description(self) -> str:
        """What the KV cache is made of, for messages."""
        if self.kv_spec:
            return f"kv_spec {format_kv_spec(self.kv_groups())}"
        return (
            f"2 x {self.layers} layers x {self.num_blocks} blocks x {self.block_size} tokens x "
            f"{self.num_kv_heads} KV heads x {self.head_dim} dims x "
            f"{self.placement().element_bytes} bytes"
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_active_requests=self.max_active_requests,
            max_batch_size=self.max_batch_size,
            reserve_blocks=self.reserve_blocks,
            aging_threshold=self.aging_threshold,
        )

    def placement(self) -> Placement:
        """Device, dtype and backends with ``auto`` resolved; ValueError for a device that is
        not there, or a Triton backend on CPU tensors without Triton's interpreter."""
        return _placement(self.device, self.dtype, self.append_backend, self.decode_backend)

    @property
    def layers(self) -> int:
        """Transformer layers the workload's cache holds."""
        if self.kv_spec:
            return sum(g.layer_count for g in parse_kv_spec(self.kv_spec))
        return 1

    @property
    def registered_prefix_blocks(self) -> int:
        """Blocks of each shared prefix the run registers before the first request (0: none)."""
        return 0

    def memory_estimate(self) -> MemoryEstimate:
        place = self.placement()
        if self.kv_spec:
            return self._grouped_memory_estimate(place)
        elt = place.element_bytes
        token = self.num_kv_heads * self.head_dim  # elements of one token's K (or V), one layer
        batch = min(self.max_batch_size, self.max_active_requests, self.num_requests)
        admitted = min(self.max_active_requests, self.num_requests)
        kv_cache = 2 * self.layers * self.num_blocks * self.block_size * token * elt
        # one step's Q, K and V for every layer, held at once
        step = self.layers * batch * (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        # staged K/V of one step's admitted prompts (one layer) and of one prefix (all layers),
        # drawn in fp32, then cast
        prompts = 2 * admitted * self.max_context * token
        prefix = 2 * self.layers * self.registered_prefix_blocks * self.block_size * token
        device_bytes = kv_cache + step * elt + (prompts + prefix) * (4 + elt)
        expected_steps = math.ceil(self.num_requests / self.arrivals_per_step) + (
            self.num_requests * self.max_new_tokens
        )
        # each request also keeps an int32 host copy of its block-table row (num_blocks wide)
        host = self.num_requests * (HOST_BYTES_PER_REQUEST + 4 * self.num_blocks)
        host += min(self.max_steps, expected_steps) * HOST_BYTES_PER_STEP
        if place.device.type == "cpu":
            host += device_bytes
        return MemoryEstimate(place.device, kv_cache, device_bytes, host)

    def _grouped_memory_estimate(self, place: Placement) -> MemoryEstimate:
        """``memory_estimate`` for a ``kv_spec`` cache: every group's storage, one step's Q/K/V
        for every layer in its group's geometry, one layer's staged prompts."""
        groups = self.kv_groups()
        batch = min(self.max_batch_size, self.max_active_requests, self.num_requests)
        admitted = min(self.max_active_requests, self.num_requests)
        kv_cache = sum(g.nbytes for g in groups)
        step = sum(
            g.layer_count
            * batch
            * (self.num_q_heads + 2 * g.num_kv_heads)
            * g.head_dim
            * g.dtype.itemsize
            for g in groups
        )
        token = max(g.num_kv_heads * g.head_dim for g in groups)
        prompts = 2 * admitted * self.max_context * token * (4 + 4)  # fp32 draw, then cast
        device_bytes = kv_cache + step + prompts
        expected_steps = math.ceil(self.num_requests / self.arrivals_per_step) + (
            self.num_requests * self.max_new_tokens
        )
        widest = max(g.num_blocks for g in groups)
        host = self.num_requests * (HOST_BYTES_PER_REQUEST + 4 * widest * len(groups))
        host += min(self.max_steps, expected_steps) * HOST_BYTES_PER_STEP
        if place.device.type == "cpu":
            host += device_bytes
        return MemoryEstimate(place.device, kv_cache, device_bytes, host)


@dataclass(frozen=True)
class IntegratedWorkloadConfig(SyntheticWorkloadConfig):
    """Knobs of the integrated workload: the synthetic ones plus layers, prefixes and faults."""

    num_layers: int = _knob(
        4, "transformer layers (one token transaction spans all)", minimum=1, maximum=MAX_LAYERS
    )
    num_prefixes: int = _knob(
        2, "shared prefixes registered before the first submission", minimum=0
    )
    prefix_blocks: int = _knob(2, "full blocks per shared prefix", minimum=0)
    prefix_hit_rate: float = _knob(
        0.5, "fraction of requests whose prompt is a shared prefix", minimum=0.0, maximum=1.0
    )
    failure_rate: float = _knob(
        0.1, "fraction of steps hit by an injected failure (retried)", minimum=0.0, maximum=1.0
    )

    _SPEC_SETS = (*SyntheticWorkloadConfig._SPEC_SETS, "num_layers")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_spec and self.prefix_hit_rate > 0:
            groups = parse_kv_spec(self.kv_spec)
            if len(groups) > 1 or groups[0].window is not None:
                raise ValueError(
                    "shared prefixes need a single full-attention KV group: with this kv_spec "
                    "set prefix_hit_rate to 0"
                )
        if self.prefix_hit_rate > 0:
            if self.num_prefixes < 1 or self.prefix_blocks < 1:
                raise ValueError("prefix hits need num_prefixes >= 1 and prefix_blocks >= 1")
            resident = self.num_prefixes * self.prefix_blocks
            if resident >= self.num_blocks:
                raise ValueError(
                    f"num_prefixes x prefix_blocks ({resident}) must be below "
                    f"num_blocks ({self.num_blocks}): resident prefixes would leave no block "
                    "for requests"
                )

    @property
    def layers(self) -> int:
        if self.kv_spec:
            return super().layers
        return self.num_layers

    @property
    def registered_prefix_blocks(self) -> int:
        # the workload registers prefixes only when requests can hit them
        return self.prefix_blocks if self.prefix_hit_rate > 0 else 0

    @classmethod
    def demo_defaults(cls, seed: int = 0) -> IntegratedWorkloadConfig:
        """What ``flashdec demo`` runs: small on the CPU, Llama-like heads on a GPU."""
        if torch.cuda.is_available():
            return cls(
                num_requests=64,
                num_layers=8,
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=128,
                block_size=16,
                num_blocks=2048,
                max_batch_size=32,
                max_active_requests=48,
                arrivals_per_step=2.0,
                min_context=64,
                max_context=512,
                min_new_tokens=16,
                max_new_tokens=64,
                prefix_blocks=16,
                seed=seed,
                warmup_run=True,  # measured on an H200: first-use compiles put p90 at 0.5 s
            )
        return cls(seed=seed)


@dataclass(frozen=True)
class SchedulerWorkloadConfig:
    """CLI knobs of ``run_scheduler_workload`` (all policies are compared on one trace)."""

    trace: str = _knob("boundary", "built-in trace", choices=TRACE_NAMES)
    seed: int = _knob(0, "random seed (K/V values, the mixed trace)", minimum=0, maximum=SEED_MAX)
    prefix_sharing: bool = _knob(True, "share prefixes")
    check_invariants: bool = _knob(True, "validate the cache after each step")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class WindowWorkloadConfig:
    """Knobs of the window workload: a long generation's blocks per group, and admitted
    concurrency with and without the spec's windows on the same pools."""

    # one full-attention layer beside three 64-token window layers, each group its own pool
    kv_spec: str = _knob(
        "(2,512,16,1,16):float32:1;(2,160,16,1,16):float32:3:window=64",
        "KV layer groups with at least one window group (flashdec spec SPEC explains it)",
    )
    num_q_heads: int = _knob(2, "query heads", minimum=1, maximum=MAX_HEADS)
    context_tokens: int = _knob(16, "prompt tokens of every request", minimum=0)
    generation_tokens: int = _knob(768, "tokens the long request generates", minimum=1)
    num_requests: int = _knob(24, "requests arriving at once for the concurrency runs", minimum=1)
    max_new_tokens: int = _knob(240, "tokens each of those generates", minimum=1)
    max_active_requests: int = _knob(64, "requests resident in the cache at most", minimum=1)
    max_batch_size: int = _knob(64, "requests decoded per step at most", minimum=1)
    device: str = _knob("auto", "where to run (auto: the GPU if there is one)", choices=DEVICES)
    append_backend: str = _knob(
        "auto", "KV append (auto: torch CPU, fused GPU)", choices=("auto", *APPEND_BACKENDS)
    )
    decode_backend: str = _knob(
        "auto", "paged decode (auto: torch CPU, triton GPU)", choices=("auto", *DECODE_BACKENDS)
    )
    seed: int = _knob(0, "random seed (K/V values)", minimum=0, maximum=SEED_MAX)
    max_steps: int = _knob(20_000, "stop a concurrency run after this many steps", minimum=1)
    check_invariants: bool = _knob(True, "validate the cache after every step")

    def __post_init__(self) -> None:
        _check_fields(self)
        groups = parse_kv_spec(self.kv_spec)
        if all(g.window is None for g in groups):
            raise ValueError("kv_spec needs at least one window group (':window=N')")
        check_storable(groups)
        for g, group in enumerate(groups):
            if group.dtype == torch.float8_e4m3fn:
                raise ValueError(f"kv_spec group {g}: the engine does not run FP8 groups yet")
            if group.head_dim > MAX_HEAD_DIM:
                raise ValueError(
                    f"kv_spec group {g}: head_dim must be <= {MAX_HEAD_DIM} (the kernels' "
                    f"limit), got {group.head_dim}"
                )
            if self.num_q_heads % group.num_kv_heads:
                raise ValueError(
                    f"num_q_heads ({self.num_q_heads}) must be a multiple of kv_spec group {g}'s "
                    f"num_kv_heads ({group.num_kv_heads})"
                )
        length = self.context_tokens + self.generation_tokens
        for g, group in enumerate(groups):
            if group.window is None and length > group.num_blocks * group.block_size:
                raise ValueError(
                    f"context_tokens + generation_tokens ({length}) do not fit kv_spec group {g} "
                    f"({group.num_blocks} blocks of {group.block_size})"
                )
        self.placement()

    def placement(self) -> Placement:
        dtype = str(parse_kv_spec(self.kv_spec)[0].dtype).removeprefix("torch.")
        return _placement(self.device, dtype, self.append_backend, self.decode_backend)


CUDA_GRAPHS = ("auto", "on", "off")
SPECULATIVE_CHOICES = ("off", *SPECULATIVE_METHODS)
KV_CACHE_DTYPES = ("auto", "fp8")  # flashdec.LLM's kv_cache_dtype


@dataclass(frozen=True)
class ModelRunConfig:
    """Knobs shared by the commands that run a real model (``generate``, ``bench-serve``)."""

    model: str = _knob(
        "tiny",
        "a built-in random-weight shape (tiny, llama3-8b-shape, tiny-qwen2, ...), the built-in "
        "real model smollm2 (SmolLM2-135M-Instruct, with its tokenizer) or a local model "
        "directory",
    )
    dtype: str = _knob(
        "auto",
        "the model's dtype (auto: the shape's or the checkpoint's)",
        choices=("auto", *DTYPES),
    )
    device: str = _knob(
        "auto", "where the model runs (auto: the GPU when there is one)", choices=DEVICES
    )
    cuda_graphs: str = _knob(
        "auto", "capture decode steps in CUDA graphs (auto: on a GPU)", choices=CUDA_GRAPHS
    )
    max_batch_size: int = _knob(64, "requests decoded per step at most", minimum=1, maximum=1024)
    max_num_batched_tokens: int = _knob(
        2048,
        "tokens one step brings at most: the running requests' decode tokens, then prompt chunks",
        minimum=1,
        maximum=1 << 20,
    )
    prefix_caching: bool = _knob(
        True, "reuse the K/V of prompt blocks seen before (automatic prefix caching)"
    )
    seed: int = _knob(
        0, "random seed (weights of a built-in shape, prompts)", minimum=0, maximum=SEED_MAX
    )
    speculative: str = _knob(
        "off",
        "speculative decoding (ngram: prompt lookup drafts; draft: a smaller model's "
        "drafts, --draft-model; verified in one step, greedy output is unchanged)",
        choices=SPECULATIVE_CHOICES,
    )
    draft_model: str = _knob(
        "",
        "with --speculative draft: the draft model, a built-in name or a local model "
        "directory of the target's tokenizer",
    )
    num_speculative_tokens: int = _knob(
        4,
        "drafts per request per step at most (with --speculative ngram)",
        minimum=1,
        maximum=MAX_SPECULATIVE_TOKENS,
        why="a verification step's width",
    )
    ngram_min: int = _knob(
        1, "shortest n-gram the drafter matches (with --speculative ngram)", minimum=1
    )
    ngram_max: int = _knob(
        4, "longest n-gram the drafter matches (with --speculative ngram)", minimum=1
    )
    kv_cache_dtype: str = _knob(
        "auto",
        "KV cache storage (auto: the model's dtype; fp8: float8_e4m3fn with a fixed, "
        "not calibrated, per-head scale of 1.0; needs a float16/bfloat16 model)",
        choices=KV_CACHE_DTYPES,
    )

    def __post_init__(self) -> None:
        _check_fields(self)
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

    _SPECULATIVE_KNOBS = ("num_speculative_tokens", "ngram_min", "ngram_max")

    def _check_speculative(self) -> None:
        if self.draft_model and self.speculative != "draft":
            raise ValueError("--draft-model needs --speculative draft")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model (a smaller model)")
        if self.speculative == "off":
            defaults = {f.name: f.default for f in fields(ModelRunConfig)}
            given = [n for n in self._SPECULATIVE_KNOBS if getattr(self, n) != defaults[n]]
            if given:
                flags = ", ".join("--" + n.replace("_", "-") for n in given)
                raise ValueError(f"{flags} needs --speculative ngram")
            return
        _check_min_max(self, "ngram_min", "ngram_max")
        self.speculative_config()  # SpeculativeConfig's own rules, in one place

    def speculative_config(self) -> SpeculativeConfig | None:
        """What ``flashdec.LLM(speculative=...)`` gets (None: speculation off)."""
        if self.speculative == "off":
            return None
        return SpeculativeConfig(
            method=self.speculative,
            num_tokens=self.num_speculative_tokens,
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
        """The model's transformers config, read alone (no weights, none of a directory's
        code): a built-in shape's, a built-in real model's (from its registry entry, once its
        packages are found) or a directory's that ``check_model_dir`` accepts."""
        from pathlib import Path

        from flashdec.models import BUILTIN_SHAPES, REAL_MODELS
        from flashdec.models.loading import check_model_dir
        from flashdec.models.real import real_model_problem

        if self.model in REAL_MODELS:
            problem = real_model_problem(self.model)
            if problem is not None:
                raise ValueError(problem)
            return REAL_MODELS[self.model].config()
        if self.model in BUILTIN_SHAPES:
            return BUILTIN_SHAPES[self.model].make_config()
        try:
            is_dir = bool(self.model) and Path(self.model).is_dir()  # Path("") is "."
        except OSError:  # e.g. a name too long for a path
            is_dir = False
        if is_dir:
            return check_model_dir(self.model)
        raise ValueError(
            f"model {self.model!r} is neither a built-in shape ({', '.join(BUILTIN_SHAPES)}), "
            f"a built-in real model ({', '.join(REAL_MODELS)}) nor a local model directory"
        )

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
        from transformers import AutoModelForCausalLM

        from flashdec.kv_pool import ACTIVATION_RESERVE  # what LLM reserves, one definition
        from flashdec.llm import LLM
        from flashdec.models import BUILTIN_SHAPES

        block_size = inspect.signature(LLM).parameters["block_size"].default  # load_llm keeps it

        config = self.model_config()
        dtype = self.model_dtype(config)
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
        weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        head_dim = model.model.layers[0].self_attn.head_dim
        kv_itemsize = 1 if self.kv_cache_dtype == "fp8" else dtype.itemsize
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
        kv_cache = -(-self.longest_request() // block_size) * block_size * per_token * kv_itemsize
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

    prompt: str = _knob("", "a text prompt (needs the model's tokenizer); empty: random token ids")
    chat: bool = _knob(False, "send the prompt as a user turn in the tokenizer's chat template")
    prompt_len: int = _knob(32, "tokens of each random prompt", minimum=1, maximum=131072)
    batch: int = _knob(4, "random prompts generated together", minimum=1, maximum=1024)
    max_new_tokens: int = _knob(32, "tokens to generate per prompt", minimum=1, maximum=131072)
    temperature: float = _knob(0.0, "sampling temperature (0: greedy)", minimum=0.0, maximum=100.0)
    top_k: int = _knob(0, "sample among the k most likely tokens (0: all)", minimum=0)
    top_p: float = _knob(
        1.0, "sample within this probability nucleus, in (0, 1]", above=0.0, maximum=1.0
    )
    ignore_eos: bool = _knob(False, "generate max-new-tokens even after EOS")
    compare: bool = _knob(False, "also run transformers' greedy generate: report agreement")
    warmup_run: bool = _knob(
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

    num_requests: int = _knob(64, "requests in the run", minimum=1, maximum=1_000_000)
    request_rate: float = _knob(
        8.0, "mean arrivals per second (Poisson)", minimum=0.001, maximum=1e6
    )
    min_prompt_len: int = _knob(16, "shortest prompt (tokens)", minimum=1, maximum=131072)
    max_prompt_len: int = _knob(128, "longest prompt (tokens)", minimum=1, maximum=131072)
    max_new_tokens: int = _knob(32, "tokens per request (EOS ignored)", minimum=1, maximum=131072)
    compare: bool = _knob(
        False, "check every request's tokens against transformers' greedy generate afterwards"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_min_max(self, "min_prompt_len", "max_prompt_len")
        limit = self.check_model()
        if self.max_prompt_len + self.max_new_tokens > limit:
            raise ValueError(
                f"max_prompt_len + max_new_tokens ({self.max_prompt_len + self.max_new_tokens}) "
                f"exceeds the model's max_position_embeddings ({limit})"
            )

    def longest_request(self) -> int:
        """Tokens the longest request holds: prompt and output."""
        return self.max_prompt_len + self.max_new_tokens
