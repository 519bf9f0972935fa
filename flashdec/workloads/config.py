"""The engine workloads' configurations (synthetic, integrated, scheduler, window); the
configs of commands that run a real model are in :mod:`flashdec.workloads.model_config`, the
pieces both are made of in :mod:`flashdec.workloads.knobs`.

The CLI generates one ``--flag`` per field (with the field's ``help``, bounds and choices), so a
knob added here is a command-line option too. Every config checks the whole configuration in
``__post_init__`` — types, bounds, cross-field rules, the device and the backends it can run —
so a bad configuration fails before anything is allocated. ``memory_estimate()`` says what a run
will hold, so a caller can refuse what cannot fit before starting it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from flashdec._checks import INT32_MAX
from flashdec.cache.kv_spec import KVGroupSpec, check_storable, format_kv_spec, parse_kv_spec
from flashdec.engine.layer_ops import APPEND_BACKENDS, DECODE_BACKENDS
from flashdec.runtime import triton_mode
from flashdec.scheduler import SchedulerConfig
from flashdec.workloads.knobs import (
    DEVICES,
    DTYPES,
    HOST_BYTES_PER_REQUEST,
    HOST_BYTES_PER_STEP,
    MAX_BLOCK_SIZE,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    SEED_MAX,
    TRITON_BACKENDS,
    MemoryEstimate,
    check_fields,
    check_min_max,
    knob,
)
from flashdec.workloads.scheduler_workload import TRACE_NAMES


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
class SyntheticWorkloadConfig:
    """Knobs of the single-layer dynamic workload (``auto`` = chosen from the device)."""

    num_requests: int = knob(16, "requests in the trace", minimum=1)
    num_q_heads: int = knob(8, "query heads", minimum=1, maximum=MAX_HEADS)
    num_kv_heads: int = knob(2, "KV heads", minimum=1, maximum=MAX_HEADS)
    head_dim: int = knob(
        32, "head dimension (even)", minimum=2, maximum=MAX_HEAD_DIM, why="the kernels' limit"
    )
    block_size: int = knob(8, "tokens per KV block", minimum=1, maximum=MAX_BLOCK_SIZE)
    num_blocks: int = knob(
        48, "blocks in the pool", minimum=1, maximum=INT32_MAX, why="block ids are int32"
    )
    max_batch_size: int = knob(8, "requests decoded per step at most", minimum=1)
    max_active_requests: int = knob(12, "requests resident in the cache at most", minimum=1)
    reserve_blocks: int = knob(0, "blocks kept out of every lifetime commitment", minimum=0)
    aging_threshold: int = knob(
        8, "overtakes before a waiting request blocks later ones", minimum=0
    )
    arrivals_per_step: float = knob(0.5, "mean request arrivals per step (> 0)", above=0.0)
    min_context: int = knob(4, "shortest prompt (tokens)", minimum=0)
    max_context: int = knob(40, "longest prompt (tokens)", minimum=0)
    min_new_tokens: int = knob(4, "fewest tokens to generate", minimum=1)
    max_new_tokens: int = knob(24, "most tokens to generate", minimum=1)
    dtype: str = knob(
        "auto", "KV and activation dtype (auto: fp32 CPU, bf16 GPU)", choices=("auto", *DTYPES)
    )
    device: str = knob("auto", "where to run (auto: the GPU if there is one)", choices=DEVICES)
    append_backend: str = knob(
        "auto", "KV append (auto: torch CPU, fused GPU)", choices=("auto", *APPEND_BACKENDS)
    )
    decode_backend: str = knob(
        "auto", "paged decode (auto: torch CPU, triton GPU)", choices=("auto", *DECODE_BACKENDS)
    )
    seed: int = knob(0, "random seed (arrivals, lengths, K/V values)", minimum=0, maximum=SEED_MAX)
    max_steps: int = knob(5000, "stop after this many steps", minimum=1)
    check_invariants: bool = knob(True, "validate the cache after every step")
    warmup_run: bool = knob(
        False, "run the whole workload once untimed first (Triton compiles each new launch shape)"
    )
    kv_spec: str = knob(
        "",
        "KV layer groups, e.g. '(2,48,8,2,32):float32:1;(2,48,8,2,32):float32:1:window=16' "
        "(flashdec spec SPEC explains it); it sets the layers, KV heads, head_dim, block size, "
        "pool and dtype (leave those knobs at their defaults); empty: one group from the knobs",
    )

    def __post_init__(self) -> None:
        check_fields(self)
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
        check_min_max(self, "min_context", "max_context")
        check_min_max(self, "min_new_tokens", "max_new_tokens")
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

    num_layers: int = knob(
        4, "transformer layers (one token transaction spans all)", minimum=1, maximum=MAX_LAYERS
    )
    num_prefixes: int = knob(2, "shared prefixes registered before the first submission", minimum=0)
    prefix_blocks: int = knob(2, "full blocks per shared prefix", minimum=0)
    prefix_hit_rate: float = knob(
        0.5, "fraction of requests whose prompt is a shared prefix", minimum=0.0, maximum=1.0
    )
    failure_rate: float = knob(
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

    trace: str = knob("boundary", "built-in trace", choices=TRACE_NAMES)
    seed: int = knob(0, "random seed (K/V values, the mixed trace)", minimum=0, maximum=SEED_MAX)
    prefix_sharing: bool = knob(True, "share prefixes")
    check_invariants: bool = knob(True, "validate the cache after each step")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class WindowWorkloadConfig:
    """Knobs of the window workload: a long generation's blocks per group, and admitted
    concurrency with and without the spec's windows on the same pools."""

    # one full-attention layer beside three 64-token window layers, each group its own pool
    kv_spec: str = knob(
        "(2,512,16,1,16):float32:1;(2,160,16,1,16):float32:3:window=64",
        "KV layer groups with at least one window group (flashdec spec SPEC explains it)",
    )
    num_q_heads: int = knob(2, "query heads", minimum=1, maximum=MAX_HEADS)
    context_tokens: int = knob(16, "prompt tokens of every request", minimum=0)
    generation_tokens: int = knob(768, "tokens the long request generates", minimum=1)
    num_requests: int = knob(24, "requests arriving at once for the concurrency runs", minimum=1)
    max_new_tokens: int = knob(240, "tokens each of those generates", minimum=1)
    max_active_requests: int = knob(64, "requests resident in the cache at most", minimum=1)
    max_batch_size: int = knob(64, "requests decoded per step at most", minimum=1)
    device: str = knob("auto", "where to run (auto: the GPU if there is one)", choices=DEVICES)
    append_backend: str = knob(
        "auto", "KV append (auto: torch CPU, fused GPU)", choices=("auto", *APPEND_BACKENDS)
    )
    decode_backend: str = knob(
        "auto", "paged decode (auto: torch CPU, triton GPU)", choices=("auto", *DECODE_BACKENDS)
    )
    seed: int = knob(0, "random seed (K/V values)", minimum=0, maximum=SEED_MAX)
    max_steps: int = knob(20_000, "stop a concurrency run after this many steps", minimum=1)
    check_invariants: bool = knob(True, "validate the cache after every step")

    def __post_init__(self) -> None:
        check_fields(self)
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
