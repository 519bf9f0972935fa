"""How ``flashdec.LLM`` sizes and builds a model's paged KV cache.

One KV layer group per distinct sliding window of the model (None = full attention), in the
KV dtype; pools sized from the memory left after the weights (``memory_fraction`` of a GPU, a
quarter of the host's available memory on the CPU), or to ``num_blocks`` when given, and
checked against what the device can hold before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdec._blocks import lifetime_blocks
from flashdec.cache import KVGroupSpec, PagedKVCache
from flashdec.kv_scales import KVScales
from flashdec.runtime import available_host_bytes, free_memory_bytes

# bytes of activations per running request the graphs and the eager forward keep, on top of the
# weights and the KV pool (a generous bound: hidden states, q/k/v, MLP intermediates, logits)
ACTIVATION_RESERVE = 256 * 2**20

FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVPoolConfig:
    """What a model's KV cache is built for (``flashdec.LLM``'s arguments, checked)."""

    block_size: int
    num_blocks: int | None  # every group's pool; None: sized from memory
    max_batch_size: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_dtype: torch.dtype  # the model's dtype, or float8_e4m3fn
    kv_scales: KVScales | None  # FP8: the scales of every layer and KV head
    memory_fraction: float
    enable_prefix_caching: bool
    # K/V bytes per token of a second pool sized to as many tokens (a draft model's): the
    # memory budget is shared between the two in proportion
    companion_kv_bytes_per_token: int = 0
    # pinned host memory for the prefix cache's host tier (0: none)
    host_kv_cache_bytes: int = 0


def kv_budget_bytes(device: torch.device, fraction: float) -> float:
    """Bytes the KV pools may take: ``fraction`` of the GPU after the weights and the
    activations, or on the CPU a quarter of the available host memory (at most 4 GiB)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device)
        return fraction * total - used - ACTIVATION_RESERVE
    return min((available_host_bytes() or 0) / 4, 4 * 2**30)


def build_kv_cache(model: torch.nn.Module, spec, config: KVPoolConfig) -> PagedKVCache:
    """The paged KV cache of ``model`` (``spec``: its :class:`~flashdec.models.ModelSpec`)."""
    caching = _caching_kwargs(model, config)
    if spec.windowed or config.kv_cache_dtype == FP8_DTYPE:
        return _grouped_cache(spec, config, caching)
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    num_blocks = config.num_blocks
    if num_blocks is None:
        num_blocks = _default_num_blocks(spec, config, blocks_per_seq)
    else:
        _check_pool_fits(
            spec.device, num_blocks, num_blocks * spec.kv_bytes_per_token * config.block_size
        )
    return PagedKVCache(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        config.block_size,
        num_blocks,
        dtype=spec.dtype,
        device=spec.device,
        max_blocks_per_seq=min(blocks_per_seq, num_blocks),
        **caching,
    )


def _grouped_cache(spec, config: KVPoolConfig, caching: dict) -> PagedKVCache:
    """A cache with one KV layer group per distinct sliding window (None = full attention),
    in ``kv_cache_dtype`` (FP8 groups get ``kv_scales``' rows of their layers).

    A window group's requests hold at most ``ceil(window / block_size) + 1`` blocks each, so
    its pool needs only that many per running request, plus room for the blocks a prompt
    chunk's step holds while it is open; the full-attention group gets the rest of the
    budget. ``num_blocks`` (when given) sizes every group's pool.
    """
    block_size = config.block_size
    windows = sorted(set(spec.layer_windows), key=lambda w: (w is not None, w or 0))
    index = {w: g for g, w in enumerate(windows)}
    counts = [spec.layer_windows.count(w) for w in windows]
    dtype = config.kv_cache_dtype
    itemsize = torch.empty((), dtype=dtype).element_size()  # FP8: 1 byte per element
    layer_block_bytes = 2 * spec.num_kv_heads * spec.head_dim * block_size * itemsize
    # a prompt chunk's step holds a window group's blocks from the window before its
    # first token to its last: up to ceil(n / block_size) + 2 blocks past the bound while
    # the step is open, for every request the step imports
    chunk_room = -(-config.max_num_batched_tokens // block_size) + 2 * config.max_batch_size
    wanted = [
        config.max_batch_size * lifetime_blocks(config.max_model_len, block_size, w)
        + 1
        + (0 if w is None else chunk_room)
        for w in windows
    ]
    if config.num_blocks is None:
        budget = _own_budget(spec, config)
        shapes = list(zip(wanted, counts, windows, strict=True))
        fixed = sum(n * c * layer_block_bytes for n, c, w in shapes if w is not None)
        full_layers = sum(c for c, w in zip(counts, windows, strict=True) if w is None)
        sizes = []
        for n, w in zip(wanted, windows, strict=True):
            if w is None:
                n = min(n, int((budget - fixed) // (full_layers * layer_block_bytes)))
            elif full_layers == 0:
                n = min(n, int(budget // (sum(counts) * layer_block_bytes)))
            if n < 1:
                raise ValueError(
                    f"no memory left for a KV cache: budget {budget / 2**30:.2f} GiB after "
                    "the weights; pass num_blocks= or a larger gpu_memory_fraction"
                )
            sizes.append(n)
    else:
        sizes = [config.num_blocks] * len(windows)
        _check_pool_fits(
            spec.device, config.num_blocks, config.num_blocks * sum(counts) * layer_block_bytes
        )
    groups = [
        KVGroupSpec(2, n, block_size, spec.num_kv_heads, spec.head_dim, dtype, c, w)
        for n, c, w in zip(sizes, counts, windows, strict=True)
    ]
    full_pools = [n for n, w in zip(sizes, windows, strict=True) if w is None]
    max_seq_len = config.max_model_len
    if full_pools:  # a request can never hold more than the smallest full pool
        max_seq_len = min(max_seq_len, min(full_pools) * block_size)
    cache = PagedKVCache(
        kv_spec=groups,
        layer_groups=[index[w] for w in spec.layer_windows],
        max_seq_len=max_seq_len,
        device=spec.device,
        **caching,
    )
    if dtype == FP8_DTYPE:
        set_cache_kv_scales(cache, config.kv_scales)
    return cache


def set_cache_kv_scales(cache: PagedKVCache, scales: KVScales) -> None:
    """Give an FP8 cache (holding nothing yet) ``scales``: each group the rows of its layers."""
    layout = cache.layout
    if (scales.num_layers, scales.num_kv_heads) != (cache.num_layers, cache.num_kv_heads):
        raise ValueError(
            f"FP8 scales for {scales.num_layers} layers x {scales.num_kv_heads} KV heads do not "
            f"fit a cache of {cache.num_layers} x {cache.num_kv_heads}"
        )
    pairs = []
    for g, spec in enumerate(cache.kv_groups):
        rows = list(layout.group_layers(g))
        pairs.append((scales.k[rows], scales.v[rows]) if spec.dtype == FP8_DTYPE else None)
    cache.set_kv_scales(pairs)


def _own_budget(spec, config: KVPoolConfig) -> float:
    """This pool's share of the KV budget: all of it, or with a companion pool of as many
    tokens, the share of this model's K/V bytes per token."""
    budget = kv_budget_bytes(spec.device, config.memory_fraction)
    own, other = spec.kv_bytes_per_token, config.companion_kv_bytes_per_token
    return budget * own / (own + other)


def _caching_kwargs(model: torch.nn.Module, config: KVPoolConfig) -> dict:
    """The cache's prefix-caching arguments: the model's identity keys the hash chain (one
    cache serves one model; the cache adds its layout, dtype and scales)."""
    model_config = getattr(model, "config", None)
    name = getattr(model_config, "_name_or_path", "") or type(model).__name__
    host = config.host_kv_cache_bytes
    available = available_host_bytes()
    if host and available is not None and host > available:
        raise ValueError(
            f"a host KV tier of {host / 2**30:.2f} GiB is more than the "
            f"{available / 2**30:.2f} GiB of host memory available; pass a smaller size"
        )
    return {
        "enable_prefix_caching": config.enable_prefix_caching,
        "prefix_caching_key": (name, id(model)),
        "host_kv_cache_bytes": host,
    }


def _check_pool_fits(device: torch.device, num_blocks: int, pool_bytes: int) -> None:
    """ValueError before allocating a pool of ``num_blocks`` that the device cannot hold."""
    free = free_memory_bytes(device)
    if free is not None and pool_bytes > free:
        raise ValueError(
            f"num_blocks={num_blocks} needs a KV pool of {pool_bytes / 2**30:.2f} GiB, more "
            f"than the {free / 2**30:.2f} GiB free on {device}; pass fewer blocks, or "
            "leave num_blocks out to size the pool from memory"
        )


def _default_num_blocks(spec, config: KVPoolConfig, blocks_per_seq: int) -> int:
    per_block = spec.kv_bytes_per_token * config.block_size
    wanted = config.max_batch_size * blocks_per_seq + 1
    budget = _own_budget(spec, config)
    affordable = int(budget // per_block)
    if affordable < 1:
        raise ValueError(
            f"no memory left for a KV cache: budget {budget / 2**30:.2f} GiB after the "
            "weights; pass num_blocks= or a larger gpu_memory_fraction"
        )
    return min(affordable, wanted)


def token_blocks(cache: PagedKVCache) -> int:
    """The blocks that hold as many tokens as ``cache`` can: its full-attention pool (window
    groups hold only their windows), or its largest pool when every group has a window."""
    full = [g.num_blocks for g in cache.kv_groups if g.window is None]
    return max(full or [g.num_blocks for g in cache.kv_groups])
