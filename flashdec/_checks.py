"""Boundary validation shared by every public entry point.

Each helper raises the SPEC's error kinds — TypeError for a wrong type/dtype/device, ValueError
for a wrong shape or value — with a message naming the argument and what was expected. They never
mutate anything, so callers can run all checks before touching state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_LAYOUTS = ("token_major", "dim_major")


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor with the given rank, dtype set and device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if value.dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must have dtype in ({names}), got {value.dtype}")
    if device is not None and not same_device(value.device, device):
        raise TypeError(f"{name} must be on {device}, got {value.device}")
    return value


def check_shape(name: str, value: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(value.shape)}")


def check_int_tensor(name: str, value: object, *, ndim: int, device=None) -> torch.Tensor:
    return check_tensor(name, value, ndim=ndim, dtypes=(torch.int32, torch.int64), device=device)


def check_request_id(name: str, value: object):
    """A request or prefix id is a ``str`` or an ``int`` (``bool`` is not an id)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a str or int, got {type(value).__name__}")
    return value


def check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    """A string from a closed set (backends, layouts, policies)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_rotary_dim(rotary_dim: int | None, head_dim: int) -> int:
    """``None`` rotates the whole head; else an even int in ``[2, head_dim]``."""
    if rotary_dim is None:
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}"
        )
    return rotary_dim


def check_rope_base(value: object, name: str = "base") -> float:
    """The RoPE frequency base: a real number, finite and > 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not 1.0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite float > 1, got {value!r}")
    return float(value)


def check_kv_layout(kv_layout: object) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout  # type: ignore[return-value]


def same_device(a: torch.device, b: torch.device | str) -> bool:
    """Device equality that treats ``cuda`` and ``cuda:<current>`` as the same device."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return True
    return a.index == b.index


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def resolve_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    if sm_scale is None:
        return head_dim**-0.5
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not sm_scale > 0 or sm_scale != sm_scale or sm_scale == float("inf"):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}")
    return float(sm_scale)


class PagedDecodeDims:
    """Sizes read off validated paged-decode inputs."""

    __slots__ = (
        "batch",
        "block_size",
        "head_dim",
        "max_blocks_per_seq",
        "num_blocks",
        "num_kv_heads",
        "num_q_heads",
    )

    def __init__(self, **sizes: int) -> None:
        for key, val in sizes.items():
            setattr(self, key, val)


def check_paged_decode_inputs(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    kv_layout: str = "token_major",
) -> PagedDecodeDims:
    """Structural checks (no host sync) for one layer's paged decode call."""
    check_kv_layout(kv_layout)
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=(q.dtype,), device=q.device)
    block_tables = check_int_tensor("block_tables", block_tables, ndim=2, device=q.device)
    seq_lens = check_int_tensor("seq_lens", seq_lens, ndim=1, device=q.device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    if kv_layout == "token_major":
        num_blocks, num_kv_heads, block_size, cache_dim = k_cache.shape
    else:
        num_blocks, num_kv_heads, cache_dim, block_size = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(
            f"cache head_dim ({cache_dim}, {kv_layout} layout) must equal q's head_dim ({head_dim})"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables [{block_tables.shape[0]}, *] and seq_lens [{seq_lens.shape[0]}] "
            f"must have q's batch size {batch}"
        )
    return PagedDecodeDims(
        batch=batch,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        max_blocks_per_seq=block_tables.shape[1],
    )


def check_paged_decode_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, dims: PagedDecodeDims
) -> None:
    """Value checks (host sync): lengths fit the table and every used block id is in range."""
    if dims.batch == 0:
        return
    lens = seq_lens.to("cpu", torch.int64)
    if int(lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    capacity = dims.max_blocks_per_seq * dims.block_size
    if int(lens.max()) > capacity:
        raise ValueError(
            f"seq_lens must be <= max_blocks_per_seq * block_size = {capacity}, "
            f"got max {int(lens.max())}"
        )
    used = (lens + dims.block_size - 1) // dims.block_size  # [B] blocks read per request
    table = block_tables.to("cpu", torch.int64)
    mask = torch.arange(dims.max_blocks_per_seq)[None, :] < used[:, None]
    ids = table[mask]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= dims.num_blocks):
        raise ValueError(
            f"block_tables holds a used block id outside [0, {dims.num_blocks}): "
            f"min {int(ids.min())}, max {int(ids.max())}"
        )
