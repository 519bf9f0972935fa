"""Boundary validation shared by every public entry point — the one definition of each check.

Each helper raises the SPEC's error kinds — TypeError for a wrong type/dtype/device, ValueError
for a wrong shape or value — with a message naming the argument and what was expected. They never
mutate anything, so callers can run all checks before touching state. Checks on the hot path
compare the common case first and build detailed messages only on failure.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# FP8 KV caches (e4m3, finite-only): what they store is ``x / scale`` saturated to +-FP8_MAX; the
# queries, new keys/values and outputs beside them are fp16 or bf16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
KV_LAYOUTS = ("token_major", "dim_major")
DEFAULT_ROPE_BASE = 10000.0
INT32_MAX = 2**31 - 1  # block ids and sequence lengths live in int32 tensors


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Device equality that treats ``cuda`` and ``cuda:<current>`` as the same device."""
    if a == b:
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return True
    return a.index == b.index


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | str | None = None,
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


def check_int_tensor(
    name: str, value: object, *, ndim: int, device: torch.device | str | None = None
) -> torch.Tensor:
    return check_tensor(name, value, ndim=ndim, dtypes=INDEX_DTYPES, device=device)


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_fraction(name: str, value: object) -> float:
    """A share in (0, 1] (a memory fraction, ``top_p``): a real number, not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type_name(value)}")
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def type_name(value: object) -> str:
    """``int``, ``list`` for builtins; ``numpy.float64``, ``torch.Tensor`` for the rest."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def check_device(device: object) -> torch.device:
    """A usable torch device, else TypeError (wrong type) / ValueError (not available)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type_name(device)}")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"invalid device {device!r}: {err}") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(device)!r} is not available: this PyTorch has no usable CUDA "
                "device (use device='cpu')"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r} is not available: {torch.cuda.device_count()} CUDA "
                "device(s) present"
            )
    elif device.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    return device


def check_token_ids(name: str, value: object) -> list[int]:
    """Token ids as a list of ints: a list or tuple of integers (numpy integers too) or a 1-D
    integer numpy array or tensor. TypeError names the offending element's or array's type."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        if isinstance(value, np.ndarray):
            integer = np.issubdtype(value.dtype, np.integer)
        else:
            dtype = value.dtype
            integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if not integer:
            raise TypeError(f"{name} must hold integer token ids, got an array of {value.dtype}")
        if value.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        return [int(t) for t in value.tolist()]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of token ids, got {type_name(value)}")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"{name} must hold int token ids, got {type_name(token)} at index {i}")
    return [int(t) for t in value]


def check_token_counts(name: str, value: object, num_requests: int) -> list[int]:
    """Per-request token counts of a step: a list or tuple of ``num_requests`` ints >= 1."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of ints, got {type(value).__name__}")
    if len(value) != num_requests:
        raise ValueError(f"{name} has {len(value)} entries for {num_requests} requests")
    return [check_positive_int(f"{name}[{i}]", n) for i, n in enumerate(value)]


def check_accept_counts(accept: object, counts: Sequence[int]) -> list[int]:
    """How many of each request's ``counts[i]`` new tokens a commit keeps: ``0..counts[i]``."""
    if isinstance(accept, (str, bytes)) or not isinstance(accept, (list, tuple)):
        raise TypeError(f"accept must be a list or tuple of ints, got {type(accept).__name__}")
    if len(accept) != len(counts):
        raise ValueError(f"accept has {len(accept)} entries for {len(counts)} requests")
    kept = [check_positive_int(f"accept[{i}]", a, minimum=0) for i, a in enumerate(accept)]
    for i, (a, n) in enumerate(zip(kept, counts, strict=True)):
        if a > n:
            raise ValueError(f"accept[{i}] = {a} is more than the {n} token(s) request {i} brought")
    return kept


def check_window(window: object) -> int | None:
    """A sliding-window length: ``None`` (full attention) or an int >= 1."""
    return None if window is None else check_positive_int("window", window)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    """A string option (backend, layout, policy): TypeError unless a str, ValueError unless in
    ``allowed``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def check_kv_layout(kv_layout: object) -> str:
    return check_choice("kv_layout", kv_layout, KV_LAYOUTS)


def check_request_id(name: str, value: object) -> str | int:
    """A request (or prefix) id is a ``str`` or an ``int``; ``bool`` is not an id."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a str or an int, got {type(value).__name__}")
    return value


def check_rope_base(value: object, name: str = "base") -> float:
    """The RoPE base: a real number (not bool), finite and > 1; returned as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"{name} must be finite and > 1, got {value!r}")
    return float(value)


def check_rotary_dim(rotary_dim: object, head_dim: int) -> int:
    """``None`` means the whole head; otherwise an even int in [2, head_dim]."""
    if rotary_dim is None:
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}"
        )
    return rotary_dim


def check_inv_freq(
    inv_freq: object, rotary_dim: int, device: torch.device, base: float
) -> torch.Tensor:
    """A caller's RoPE inverse-frequency table: float32 ``[rotary_dim // 2]`` on ``device``.

    It replaces the base-derived table, so a non-default ``base`` beside it is ambiguous.
    """
    table = check_tensor("inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,), device=device)
    check_shape("inv_freq", table, (rotary_dim // 2,))
    if base != DEFAULT_ROPE_BASE:
        raise ValueError(
            f"pass either inv_freq or a non-default base, not both (base={base!r}); inv_freq "
            "already holds the frequencies"
        )
    return table


def kv_dtype_matches(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether a cache of ``kv_dtype`` serves queries/new tokens of ``dtype``: the same float
    dtype, or an FP8 cache beside fp16/bf16."""
    return kv_dtype == dtype or (kv_dtype == FP8_DTYPE and dtype in FP8_COMPUTE_DTYPES)


def kv_dtypes_for(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cache dtypes :func:`kv_dtype_matches` accepts beside ``dtype``."""
    return (dtype, FP8_DTYPE) if dtype in FP8_COMPUTE_DTYPES else (dtype,)


KVScale = float | torch.Tensor


def check_kv_scales(
    kv_dtype: torch.dtype,
    k_scale: object,
    v_scale: object,
    num_kv_heads: int,
    device: torch.device | str,
) -> tuple[KVScale | None, KVScale | None]:
    """The dequantisation scales of a cache: both required for an FP8 cache (each a positive
    finite float, or a float32 tensor ``[num_kv_heads]`` on the cache's device, whose values are
    the caller's responsibility), neither allowed for a float cache. Floats come back as float."""
    if kv_dtype != FP8_DTYPE:
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"k_scale/v_scale apply only to float8_e4m3fn caches; this cache is {kv_dtype} "
                "(pass no scales)"
            )
        return None, None
    if k_scale is None or v_scale is None:
        missing = " and ".join(
            n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is None
        )
        raise ValueError(
            f"a float8_e4m3fn cache needs k_scale and v_scale (a float or a float32 tensor "
            f"[num_kv_heads]); {missing} missing"
        )
    return (
        _check_kv_scale("k_scale", k_scale, num_kv_heads, device),
        _check_kv_scale("v_scale", v_scale, num_kv_heads, device),
    )


def _check_kv_scale(name: str, value: object, num_kv_heads: int, device) -> KVScale:
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, ndim=1, dtypes=(torch.float32,), device=device)
        check_shape(name, value, (num_kv_heads,))
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a float or a float32 tensor [num_kv_heads], got {type(value).__name__}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def resolve_sm_scale(sm_scale: float | None, head_dim: int) -> float:
    if sm_scale is None:
        return head_dim**-0.5
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not (sm_scale > 0 and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale}")
    return float(sm_scale)


# --------------------------------------------------------------------------------------------
# paged decode
# --------------------------------------------------------------------------------------------
class PagedDecodeDims(NamedTuple):
    """Sizes read off validated paged-decode inputs."""

    batch: int
    num_q_heads: int
    head_dim: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    max_blocks_per_seq: int


def check_paged_decode_inputs(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    kv_layout: str = "token_major",
) -> PagedDecodeDims:
    """Structural checks (no host sync) for one layer's paged decode call."""
    tensor = torch.Tensor
    if not (
        isinstance(q, tensor)
        and isinstance(k_cache, tensor)
        and isinstance(v_cache, tensor)
        and isinstance(block_tables, tensor)
        and isinstance(seq_lens, tensor)
    ):
        _explain_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_layout)
    # common case first: each attribute read once, no message building
    q_shape, k_shape, t_shape, l_shape = q.shape, k_cache.shape, block_tables.shape, seq_lens.shape
    dtype, device = q.dtype, q.device
    if not (
        len(q_shape) == 3
        and len(k_shape) == 4
        and len(t_shape) == 2
        and len(l_shape) == 1
        and type(kv_layout) is str
        and kv_layout in KV_LAYOUTS
        and dtype in FLOAT_DTYPES
        and (k_cache.dtype == dtype or kv_dtype_matches(dtype, k_cache.dtype))
        and v_cache.dtype == k_cache.dtype
        and block_tables.dtype in INDEX_DTYPES
        and seq_lens.dtype in INDEX_DTYPES
        and k_cache.device == device
        and v_cache.device == device
        and block_tables.device == device
        and seq_lens.device == device
        and v_cache.shape == k_shape
    ):
        _explain_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_layout)
    batch, num_q_heads, head_dim = q_shape
    if kv_layout == "token_major":
        num_blocks, num_kv_heads, block_size, cache_dim = k_shape
    else:
        num_blocks, num_kv_heads, cache_dim, block_size = k_shape
    if (
        cache_dim != head_dim
        or num_kv_heads == 0
        or num_q_heads % num_kv_heads
        or t_shape[0] != batch
        or l_shape[0] != batch
    ):
        _explain_paged_decode_sizes(q, k_cache, block_tables, seq_lens, kv_layout)
    return PagedDecodeDims(
        batch, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size, t_shape[1]
    )


def _explain_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_layout) -> None:
    check_kv_layout(kv_layout)
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    kv_dtypes = kv_dtypes_for(q.dtype)
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=kv_dtypes, device=q.device)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=q.device)
    check_int_tensor("block_tables", block_tables, ndim=2, device=q.device)
    check_int_tensor("seq_lens", seq_lens, ndim=1, device=q.device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )


def _explain_paged_decode_sizes(q, k_cache, block_tables, seq_lens, kv_layout) -> None:
    batch, num_q_heads, head_dim = q.shape
    if kv_layout == "token_major":
        _, num_kv_heads, _, cache_dim = k_cache.shape
    else:
        _, num_kv_heads, cache_dim, _ = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(
            f"cache head_dim ({cache_dim}, {kv_layout} layout) must equal q's head_dim ({head_dim})"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    raise ValueError(
        f"block_tables [{block_tables.shape[0]}, *] and seq_lens [{seq_lens.shape[0]}] "
        f"must have q's batch size {batch}"
    )


class PagedDecodeStats(NamedTuple):
    """What the range checks of a paged decode read off its metadata.

    ``min_id`` / ``max_id`` cover the *used* table entries only (the first
    ``ceil(seq_len / block_size)`` of each row, at most the table's width; with a sliding window
    only those from the window's first block on); both are None when no entry is used.
    """

    min_len: int
    max_len: int
    total_len: int  # tokens the call attends to (with a window, each length capped at it)
    min_id: int | None
    max_id: int | None


def paged_decode_stats(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: PagedDecodeDims,
    window: int | None = None,
    query_lens: torch.Tensor | None = None,
) -> PagedDecodeStats:
    """The stats computed with torch on the host (the reference; the Triton kernels compute the
    same on the device). With a sliding ``window`` only the blocks holding a request's last
    ``window`` tokens are read, so only those table entries must be valid.

    ``query_lens`` (extend: the new tokens of each request, the last ones of its ``seq_len``)
    moves the first block read back to the first new token's window: a request reads its last
    ``window + query_len - 1`` tokens (one query is a decode's ``window``)."""
    if dims.batch == 0:
        return PagedDecodeStats(0, 0, 0, None, None)
    lens = seq_lens.to("cpu", torch.int64)
    used = (lens.clamp(min=0) + dims.block_size - 1) // dims.block_size  # [B] blocks read
    used = used.clamp(max=dims.max_blocks_per_seq)
    columns = torch.arange(dims.max_blocks_per_seq)[None, :]
    mask = columns < used[:, None]
    attended = lens
    if window is not None:
        reach = torch.full_like(lens, window)
        if query_lens is not None:
            reach += query_lens.to("cpu", torch.int64) - 1
        first = (lens - reach).clamp(min=0) // dims.block_size  # [B] first block in the window
        mask &= columns >= first[:, None]
        attended = torch.minimum(lens, reach)
    ids = block_tables.to("cpu", torch.int64)[mask]
    min_id, max_id = (int(ids.min()), int(ids.max())) if ids.numel() else (None, None)
    return PagedDecodeStats(int(lens.min()), int(lens.max()), int(attended.sum()), min_id, max_id)


def check_paged_decode_stats(stats: PagedDecodeStats, dims: PagedDecodeDims) -> None:
    """Lengths fit the table and every used block id is in range."""
    if dims.batch == 0:
        return
    if stats.min_len < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {stats.min_len}")
    capacity = dims.max_blocks_per_seq * dims.block_size
    if stats.max_len > capacity:
        raise ValueError(
            f"seq_lens must be <= max_blocks_per_seq * block_size = {capacity}, "
            f"got max {stats.max_len}"
        )
    if stats.min_id is not None and (stats.min_id < 0 or stats.max_id >= dims.num_blocks):
        raise ValueError(
            f"block_tables holds a used block id outside [0, {dims.num_blocks}): "
            f"min {stats.min_id}, max {stats.max_id}"
        )


def check_paged_decode_values(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: PagedDecodeDims,
    window: int | None = None,
    query_lens: torch.Tensor | None = None,
) -> PagedDecodeStats:
    """Value checks on the host (copies the metadata: for references and tests)."""
    stats = paged_decode_stats(block_tables, seq_lens, dims, window, query_lens)
    check_paged_decode_stats(stats, dims)
    return stats


# --------------------------------------------------------------------------------------------
# paged extend (several new tokens per request)
# --------------------------------------------------------------------------------------------
def check_paged_extend_inputs(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    seq_lens: object,
    query_lens: object,
    kv_layout: str = "token_major",
) -> tuple[PagedDecodeDims, int]:
    """Structural checks (no host sync) for one layer's extend call: ``q [total_q, Hq, D]``
    packed request by request, ``query_lens [B]``. Returns the dims of the batch (``batch`` =
    ``len(query_lens)``) and ``total_q``. Each query_len is >= 1, so fewer rows than requests
    is already a ValueError here; the values themselves are :func:`check_query_len_stats`'s."""
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    query_lens = check_int_tensor("query_lens", query_lens, ndim=1, device=q.device)
    batch, total_q = query_lens.shape[0], q.shape[0]
    for name, meta, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
        if isinstance(meta, torch.Tensor) and meta.dim() == ndim and meta.shape[0] != batch:
            raise ValueError(
                f"{name} has {meta.shape[0]} rows but query_lens {batch}: one per request"
            )
    if total_q < batch or (batch == 0 and total_q):
        raise ValueError(
            f"q has {total_q} rows but query_lens has {batch} entries, each >= 1: q must be "
            "[sum(query_lens), num_q_heads, head_dim]"
        )
    dims = check_paged_decode_inputs(q[:batch], k_cache, v_cache, block_tables, seq_lens, kv_layout)
    return dims, total_q


class QueryLenStats(NamedTuple):
    """What the checks of an extend call read off its ``query_lens`` (batch > 0)."""

    min_len: int
    max_len: int
    max_excess: int  # largest query_len - seq_len: > 0 means a query longer than its request
    total: int


def query_len_stats(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> QueryLenStats:
    """The stats computed with torch on the host (batch > 0; the device kernel's reference)."""
    qls = query_lens.to("cpu", torch.int64)
    excess = qls - seq_lens.to("cpu", torch.int64)
    return QueryLenStats(int(qls.min()), int(qls.max()), int(excess.max()), int(qls.sum()))


def check_query_len_stats(stats: QueryLenStats, total_q: int) -> None:
    """Every request brings at least one and at most ``seq_len`` new tokens (``seq_lens``
    count them), and the new tokens are q's rows."""
    if stats.min_len < 1:
        raise ValueError(f"query_lens must each be >= 1, got min {stats.min_len}")
    if stats.max_excess > 0:
        raise ValueError(
            "each query_len must be <= its request's seq_len (seq_lens include the new tokens); "
            f"one exceeds it by {stats.max_excess}"
        )
    if stats.total != total_q:
        raise ValueError(f"query_lens must sum to q's {total_q} rows, got {stats.total}")


# --------------------------------------------------------------------------------------------
# KV append
# --------------------------------------------------------------------------------------------
class AppendStats(NamedTuple):
    """What the range checks of a KV append read off its slot metadata (batch > 0)."""

    min_id: int
    max_id: int
    min_offset: int
    max_offset: int
    min_position: int | None  # None when the call has no positions
    duplicate_slots: int  # ordered pairs of distinct rows that target the same slot


def check_append_stats(stats: AppendStats, num_blocks: int, block_size: int) -> None:
    """Every row writes a distinct in-range slot, at a non-negative position."""
    if stats.min_id < 0 or stats.max_id >= num_blocks:
        raise ValueError(
            f"block_ids must lie in [0, {num_blocks}), got min {stats.min_id}, max {stats.max_id}"
        )
    if stats.min_offset < 0 or stats.max_offset >= block_size:
        raise ValueError(
            f"offsets must lie in [0, {block_size}), got min {stats.min_offset}, "
            f"max {stats.max_offset}"
        )
    if stats.min_position is not None and stats.min_position < 0:
        raise ValueError(f"positions must be >= 0, got min {stats.min_position}")
    if stats.duplicate_slots:
        raise ValueError("two rows target the same (block_id, offset) slot; each must be distinct")
