"""How a :class:`~flashdec.cache.PagedKVCache` lays its layers out in KV groups, checked at
construction: the groups (from spec text, ``KVGroupSpec`` s or the single-geometry arguments),
which group each layer belongs to, each group's block-table width, and FP8 scales.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashdec._checks import FLOAT_DTYPES, check_device, check_positive_int
from flashdec.cache.group_managers import manager_kind
from flashdec.cache.kv_spec import KVGroupSpec, check_storable, format_kv_spec, parse_kv_spec

GEOMETRY_ARGS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "max_blocks", "dtype")


def legacy_group(num_layers, num_kv_heads, head_dim, block_size, max_blocks, dtype) -> KVGroupSpec:
    """The one group of the single-geometry constructor (its checks and messages as ever)."""
    for name, value in zip(
        GEOMETRY_ARGS[:5], (num_layers, num_kv_heads, head_dim, block_size, max_blocks), strict=True
    ):
        if value is None:
            raise TypeError(f"{name} is required (or pass kv_spec=)")
    check_positive_int("num_layers", num_layers)
    check_positive_int("num_kv_heads", num_kv_heads)
    check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of dims), got {head_dim}")
    check_positive_int("block_size", block_size)
    check_positive_int("max_blocks", max_blocks)
    if dtype is None:
        dtype = torch.float16
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return KVGroupSpec(2, max_blocks, block_size, num_kv_heads, head_dim, dtype, num_layers)


def check_groups(kv_spec: object) -> tuple[KVGroupSpec, ...]:
    """The groups of ``kv_spec`` (text or KVGroupSpecs), refusing what the cache cannot store."""
    if isinstance(kv_spec, str):
        groups = parse_kv_spec(kv_spec)
    elif isinstance(kv_spec, Sequence) and not isinstance(kv_spec, bytes):
        groups = tuple(kv_spec)
        format_kv_spec(groups)  # TypeError / ValueError for a bad sequence
    else:
        raise TypeError(
            f"kv_spec must be a str or a sequence of KVGroupSpec, got {type(kv_spec).__name__}"
        )
    check_storable(groups)
    return groups


def table_widths(
    groups: tuple[KVGroupSpec, ...], max_blocks_per_seq: object, max_seq_len: object
) -> list[int]:
    """Each group's block-table width, from one token limit every group can hold."""
    if max_blocks_per_seq is not None and max_seq_len is not None:
        raise ValueError("pass max_blocks_per_seq or max_seq_len, not both")
    if max_blocks_per_seq is not None:
        check_positive_int("max_blocks_per_seq", max_blocks_per_seq)
        sizes = {g.block_size for g in groups}
        if len(sizes) > 1:
            raise ValueError(
                f"max_blocks_per_seq is ambiguous with block sizes {sorted(sizes)}; pass "
                "max_seq_len (tokens) instead"
            )
        max_seq_len = max_blocks_per_seq * groups[0].block_size
    elif max_seq_len is not None:
        check_positive_int("max_seq_len", max_seq_len)
    else:
        full = [g.num_blocks * g.block_size for g in groups if g.window is None]
        max_seq_len = min(full) if full else max(g.num_blocks * g.block_size for g in groups)
    widths = []
    for index, group in enumerate(groups):
        width = -(-max_seq_len // group.block_size)
        if group.window is None and width > group.num_blocks:
            what = "max_blocks_per_seq" if max_blocks_per_seq is not None else "max_seq_len"
            value = max_blocks_per_seq if max_blocks_per_seq is not None else max_seq_len
            where = "" if len(groups) == 1 else f" (KV group {index})"
            raise ValueError(
                f"{what} ({value}) must not exceed what max_blocks "
                f"({group.num_blocks}) can hold{where}: a request can never hold more "
                "blocks than the pool"
            )
        widths.append(width)
    return widths


def layer_order(groups: tuple[KVGroupSpec, ...], layer_groups: object) -> list[int]:
    """The group of every layer: ``layer_groups`` checked, or the groups in order."""
    if layer_groups is None:
        return [g for g, spec in enumerate(groups) for _ in range(spec.layer_count)]
    if isinstance(layer_groups, (str, bytes)) or not isinstance(layer_groups, Sequence):
        raise TypeError(
            f"layer_groups must be a sequence of ints, got {type(layer_groups).__name__}"
        )
    order = list(layer_groups)
    for i, g in enumerate(order):
        if isinstance(g, bool) or not isinstance(g, int):
            raise TypeError(f"layer_groups[{i}] must be an int, got {type(g).__name__}")
        if not 0 <= g < len(groups):
            raise ValueError(f"layer_groups[{i}] = {g} is not a group in [0, {len(groups)})")
    counts = Counter(order)
    for g, spec in enumerate(groups):
        if counts[g] != spec.layer_count:
            raise ValueError(
                f"layer_groups names group {g} {counts[g]} times but its spec has "
                f"layer_count {spec.layer_count}"
            )
    return order


def check_scales(groups: tuple[KVGroupSpec, ...], kv_scales: object) -> list:
    """Per group None or (k_scale, v_scale) as float32 ``[layers_in_group, Hkv]`` CPU tensors."""
    if kv_scales is None:
        return [None] * len(groups)
    if isinstance(kv_scales, (str, bytes)) or not isinstance(kv_scales, Sequence):
        raise TypeError(
            f"kv_scales must be a sequence (one entry per group), got {type(kv_scales).__name__}"
        )
    if len(kv_scales) != len(groups):
        raise ValueError(f"kv_scales has {len(kv_scales)} entries for {len(groups)} groups")
    result = []
    for g, (spec, pair) in enumerate(zip(groups, kv_scales, strict=True)):
        if pair is None:
            result.append(None)
            continue
        result.append(scale_pair(f"kv_scales[{g}]", spec, pair))
    return result


def scale_pair(name: str, spec: KVGroupSpec, pair: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale, v_scale)`` of an FP8 group as float32 ``[layers_in_group, Hkv]`` CPU tensors,
    checked. Each may be a float (every layer and head), a float32 ``[Hkv]`` tensor (per head,
    every layer) or a float32 ``[layers_in_group, Hkv]`` tensor (per layer and head)."""
    if spec.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: a {spec.dtype} group takes no scales (only float8_e4m3fn)")
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be a (k_scale, v_scale) pair")
    heads, layers = spec.num_kv_heads, spec.layer_count
    out = []
    for which, value in zip(("k_scale", "v_scale"), pair, strict=True):
        if isinstance(value, torch.Tensor):
            shapes = ((heads,), (layers, heads))
            if value.dtype != torch.float32 or tuple(value.shape) not in shapes:
                raise ValueError(
                    f"{name} {which} must be a float or a float32 tensor [{heads}] or "
                    f"[{layers}, {heads}], got {value.dtype} {tuple(value.shape)}"
                )
            tensor = value.detach().to("cpu", copy=True).expand(layers, heads).contiguous()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            tensor = torch.full((layers, heads), float(value), dtype=torch.float32)
        else:
            raise TypeError(
                f"{name} {which} must be a float or a tensor, got {type(value).__name__}"
            )
        if not bool(torch.isfinite(tensor).all()) or not bool((tensor > 0).all()):
            raise ValueError(f"{name} {which} must be finite and > 0")
        out.append(tensor)
    return out[0], out[1]


@dataclass(frozen=True)
class CacheLayout:
    """A cache's checked construction arguments."""

    groups: tuple[KVGroupSpec, ...]
    prefix_capacity: int  # blocks for shared prefixes, per group
    widths: list[int]  # block-table width per group
    order: list[int]  # the group of each global layer
    device: torch.device
    scales: list  # per group None or (k_scale, v_scale)


def resolve_layout(
    geometry: tuple,
    device: object,
    prefix_cache_capacity_blocks: object,
    max_blocks_per_seq: object,
    kv_spec: object,
    layer_groups: object,
    max_seq_len: object,
    kv_scales: object,
    restore_on_abort: object,
) -> CacheLayout:
    """Check every ``PagedKVCache`` constructor argument (in its order, with its messages);
    ``geometry`` is ``(num_layers, num_kv_heads, head_dim, block_size, max_blocks, dtype)``."""
    num_layers = geometry[0]
    if kv_spec is None and (
        isinstance(num_layers, str)
        or (
            isinstance(num_layers, Sequence)
            and num_layers
            and all(isinstance(g, KVGroupSpec) for g in num_layers)
        )
    ):
        kv_spec, num_layers = num_layers, None  # PagedKVCache("(2,...):bfloat16:30;...")
    if kv_spec is None:
        if layer_groups is not None or kv_scales is not None:
            raise ValueError("layer_groups and kv_scales need kv_spec")
        groups = (legacy_group(num_layers, *geometry[1:]),)
    else:
        geometry = (num_layers, *geometry[1:])
        given = [n for n, x in zip(GEOMETRY_ARGS, geometry, strict=True) if x is not None]
        if given:
            raise ValueError(
                f"pass either kv_spec or the geometry arguments, not both (got kv_spec and "
                f"{', '.join(given)})"
            )
        groups = check_groups(kv_spec)
    capacity = check_positive_int(
        "prefix_cache_capacity_blocks", prefix_cache_capacity_blocks, minimum=0
    )
    if capacity > groups[0].num_blocks:
        raise ValueError(
            f"prefix_cache_capacity_blocks ({capacity}) must not exceed max_blocks "
            f"({groups[0].num_blocks})"
        )
    if capacity and (
        not all(manager_kind(g).shares_prefixes for g in groups)
        or len({g.block_size for g in groups}) > 1
    ):
        raise ValueError(
            "shared prefixes need full-attention KV groups of one block size; this cache "
            f"has {format_kv_spec(groups)!r} (use prefix_cache_capacity_blocks=0)"
        )
    if capacity > min(g.num_blocks for g in groups):
        raise ValueError(
            f"prefix_cache_capacity_blocks ({capacity}) must not exceed any group's "
            f"num_blocks ({min(g.num_blocks for g in groups)})"
        )
    widths = table_widths(groups, max_blocks_per_seq, max_seq_len)
    order = layer_order(groups, layer_groups)
    if not isinstance(restore_on_abort, bool):
        raise TypeError("restore_on_abort must be a bool")
    device = check_device(device)
    scales = check_scales(groups, kv_scales)
    return CacheLayout(groups, capacity, widths, order, device, scales)
