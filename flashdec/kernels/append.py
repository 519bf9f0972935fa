"""KV append, the host side: scatter one token per request into a paged layer, optionally
fused with RoPE.

- ``kv_append`` scatters ``k, v [B, Hkv, D]`` into a token-major layer ``[num_blocks, Hkv,
  block_size, D]`` at ``(block_ids[b], offsets[b])``; the copy is bitwise.
- ``fused_rope_kv_append`` does, in ONE launch, what a decode layer needs before attention:
  rotate q (all heads) and k at ``positions`` with split-half RoPE (as
  :func:`flashdec.apply_rope`: float32 angles ``position * inv_freq[i]``, ``inv_freq`` derived
  from ``base`` or the model's own table; dims past ``rotary_dim`` unchanged), write the rotated
  k and the plain v into the cache, return the rotated q.

FP8 caches (``torch.float8_e4m3fn``, beside fp16/bf16 inputs): both writers take ``k_scale`` /
``v_scale`` (a float or a float32 tensor ``[num_kv_heads]``) and store ``x / scale`` saturated
to +-448 and rounded to nearest even — bitwise what :func:`flashdec.reference.quantize_fp8`
stores (the fused kernel quantises the float32 rotated k, with no intermediate rounding).

The public functions check every shape, dtype, device and index value and raise before anything
is written; the index values are checked on the device and read back in one small transfer,
cached per metadata tensor like ``decode``'s (:mod:`flashdec.kernels.validation`). The
``launch_*`` variants are for callers that validated their own reservation (the cache, the
engine): no checks, no allocation besides an optional q output, no host sync. They skip the K/V
store of a row whose block id is negative (padding rows of a CUDA-graph batch bucket); the
public functions reject negative ids. The kernels are in :mod:`flashdec.kernels.append_kernel`.
"""

from __future__ import annotations

import torch

from flashdec._checks import (
    DEFAULT_ROPE_BASE,
    FLOAT_DTYPES,
    FP8_DTYPE,
    INDEX_DTYPES,
    check_append_stats,
    check_inv_freq,
    check_kv_scales,
    check_rope_base,
    check_rotary_dim,
    check_tensor,
    kv_dtype_matches,
    kv_dtypes_for,
)
from flashdec.kernels._runtime import INTERPRET, Launcher, check_kernel_device, next_power_of_2
from flashdec.kernels._scales import call_scales, scale_tensor
from flashdec.kernels.append_kernel import _fused_rope_kv_append_kernel, _kv_append_kernel
from flashdec.kernels.dependent_launch import dependent_launch
from flashdec.kernels.validation import append_metadata_stats, lookup, metadata_key, remember

_KV_APPEND = Launcher(_kv_append_kernel)
_FUSED = Launcher(_fused_rope_kv_append_kernel)
_INV_FREQ: dict[tuple[torch.device, int, float], torch.Tensor] = {}
# constexprs per head configuration, built once (the launchers run once per layer per step)
_APPEND_CONSTEXPRS: dict[tuple, tuple] = {}
_FUSED_CONSTEXPRS: dict[tuple, tuple] = {}


def _base_inv_freq(device: torch.device, rotary_dim: int, base: float) -> torch.Tensor:
    """float32 ``base ** (-2i / rotary_dim)`` with the reference's ops, built once per device."""
    key = (device, rotary_dim, base)
    table = _INV_FREQ.get(key)
    if table is None:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device)
        table = _INV_FREQ[key] = 1.0 / (base ** (exponents.float() / rotary_dim))
    return table


def launch_kv_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Trusted scatter of ``k, v [B, Hkv, D]`` into the cache: no checks, no host sync. Rows
    with a negative block id write nothing. An FP8 cache needs ``k_scale``/``v_scale`` as
    contiguous float32 device tensors ``[Hkv]``."""
    batch, num_kv_heads, head_dim = k.shape
    if batch == 0:
        return
    quantize = k_cache.dtype == FP8_DTYPE
    pdl = dependent_launch(k.device)
    key = (num_kv_heads, head_dim, quantize, pdl)
    consts = _APPEND_CONSTEXPRS.get(key)
    if consts is None:
        consts = _APPEND_CONSTEXPRS[key] = (
            num_kv_heads,
            head_dim,
            next_power_of_2(num_kv_heads),
            next_power_of_2(head_dim),
            quantize,
            pdl,
        )
    if not quantize:  # never read: block_ids stands in for the scale pointers
        k_scale = v_scale = block_ids
    _KV_APPEND(
        batch,
        (k, v, k_cache, v_cache, block_ids, offsets, k_scale, v_scale),
        (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride()),
        consts,
        4,
        pdl=pdl,
    )


def _fused_launch(
    q,
    k,
    v,
    k_cache,
    v_cache,
    block_ids,
    offsets,
    positions,
    rotary_dim,
    base,
    q_out,
    inv_freq,
    k_scale,
    v_scale,
    backup=None,
    backup_v=0,
) -> tuple[tuple, bool]:
    """The positional arguments of one fused RoPE + append launch (``backup``: see
    :class:`BoundFusedRopeKVAppend`) and whether it is a dependent launch."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if rotary_dim is None:
        rotary_dim = head_dim
    if inv_freq is None:
        inv_freq = _base_inv_freq(q.device, rotary_dim, base)
    quantize = k_cache.dtype == FP8_DTYPE
    if not quantize:  # never read: positions stands in for the scale pointers
        k_scale = v_scale = positions
    has_backup = backup is not None
    if not has_backup:  # never read
        backup = positions
    pdl = dependent_launch(q.device)
    key = (num_q_heads, num_kv_heads, head_dim, rotary_dim, quantize, has_backup, pdl)
    consts = _FUSED_CONSTEXPRS.get(key)
    if consts is None:
        consts = _FUSED_CONSTEXPRS[key] = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            next_power_of_2(num_q_heads),
            next_power_of_2(num_kv_heads),
            next_power_of_2(head_dim),
            not INTERPRET,
            quantize,
            has_backup,
            pdl,
        )
    launch = (
        batch,
        (
            q,
            k,
            v,
            k_cache,
            v_cache,
            block_ids,
            offsets,
            positions,
            inv_freq,
            q_out,
            k_scale,
            v_scale,
            backup,
        ),
        (
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *q_out.stride(),
            inv_freq.stride(0),
            backup.stride(0) if has_backup else 0,
            backup_v,
        ),
        consts,
        4,
    )
    return launch, pdl


def launch_fused_rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int | None,
    base: float,
    q_out: torch.Tensor | None,
    inv_freq: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Trusted fused RoPE + append: no checks, no host sync; returns the rotated q. Rows with a
    negative block id rotate q but write nothing to the cache. ``inv_freq`` (float32
    ``[rotary_dim // 2]``) replaces the table derived from ``base``. An FP8 cache needs
    ``k_scale``/``v_scale`` as contiguous float32 device tensors ``[Hkv]``."""
    if q_out is None:
        q_out = torch.empty_like(q)
    if q.shape[0] == 0:
        return q_out
    args, pdl = _fused_launch(
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_ids,
        offsets,
        positions,
        rotary_dim,
        base,
        q_out,
        inv_freq,
        k_scale,
        v_scale,
    )
    _FUSED(*args, pdl=pdl)
    return q_out


class BoundFusedRopeKVAppend:
    """:func:`launch_fused_rope_kv_append` bound to one step's slots and RoPE table: a call takes
    the layer's ``q, k, v, k_cache, v_cache, q_out`` (and ``backup``) — with the dtypes and
    strides of the ones it was bound with — and launches with no per-call argument building. An
    FP8 cache's ``k_scale``/``v_scale`` are per-call too (each layer has its own scales; the
    ones bound serve a call that passes none).

    ``backup`` (``[rows * Hkv, D]`` in the cache's dtype, rows of ``D`` contiguous elements):
    before storing, the kernel copies each slot's old K bytes to row ``b * Hkv + h`` and its old
    V bytes ``backup_v`` elements further on — what an abort of the transaction puts back.
    """

    # positions of the per-call tensors among the launch's tensors
    DYNAMIC = (0, 1, 2, 3, 4, 9)
    K_SCALE, V_SCALE = 10, 11
    BACKUP = 12

    __slots__ = ("_has_backup", "_scales", "launch")

    def __init__(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_ids,
        offsets,
        positions,
        rotary_dim,
        base,
        q_out,
        inv_freq=None,
        k_scale=None,
        v_scale=None,
        backup=None,
        backup_v=0,
    ) -> None:
        args, pdl = _fused_launch(
            q,
            k,
            v,
            k_cache,
            v_cache,
            block_ids,
            offsets,
            positions,
            rotary_dim,
            base,
            q_out,
            inv_freq,
            k_scale,
            v_scale,
            backup,
            backup_v,
        )
        self._has_backup = backup is not None
        dynamic = (*self.DYNAMIC, self.BACKUP) if self._has_backup else self.DYNAMIC
        fp8 = k_cache.dtype == FP8_DTYPE
        self._scales = (k_scale, v_scale) if fp8 else None
        if fp8:
            dynamic = (*dynamic, self.K_SCALE, self.V_SCALE)
        self.launch = _FUSED.bind(*args, dynamic=dynamic, pdl=pdl)

    def __call__(
        self, q, k, v, k_cache, v_cache, q_out, backup=None, k_scale=None, v_scale=None
    ) -> torch.Tensor:
        scales = call_scales(self._scales, k_scale, v_scale)
        if self._has_backup:
            self.launch(q, k, v, k_cache, v_cache, q_out, backup, *scales)
        else:
            self.launch(q, k, v, k_cache, v_cache, q_out, *scales)
        return q_out


def _check_append_inputs(
    k_cache: object,
    v_cache: object,
    k: object,
    v: object,
    block_ids: object,
    offsets: object,
    k_scale: object = None,
    v_scale: object = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Structural checks of a scatter (no host sync); returns the scales as device tensors
    (None for a float cache)."""
    if not _append_inputs_ok(k_cache, v_cache, k, v, block_ids, offsets):
        _explain_append_inputs(k_cache, v_cache, k, v, block_ids, offsets)
    check_kernel_device("k_cache", k_cache)  # type: ignore[arg-type]
    dtype = k_cache.dtype  # type: ignore[union-attr]
    if k_scale is None and v_scale is None and dtype != FP8_DTYPE:
        return None, None
    heads, device = k_cache.shape[1], k_cache.device  # type: ignore[union-attr]
    k_scale, v_scale = check_kv_scales(dtype, k_scale, v_scale, heads, device)
    return scale_tensor(k_scale, heads, device), scale_tensor(v_scale, heads, device)


def _append_inputs_ok(k_cache, v_cache, k, v, block_ids, offsets) -> bool:
    tensor = torch.Tensor
    if not (
        isinstance(k_cache, tensor)
        and isinstance(v_cache, tensor)
        and isinstance(k, tensor)
        and isinstance(v, tensor)
        and isinstance(block_ids, tensor)
        and isinstance(offsets, tensor)
    ):
        return False
    dtype, device = k_cache.dtype, k_cache.device
    cache_shape, k_shape = k_cache.shape, k.shape
    if len(cache_shape) != 4 or len(k_shape) != 3:
        return False
    rows = (k_shape[0],)
    return (
        k.dtype in FLOAT_DTYPES
        and (k.dtype == dtype or kv_dtype_matches(k.dtype, dtype))
        and v.dtype == k.dtype
        and v_cache.dtype == dtype
        and block_ids.dtype in INDEX_DTYPES
        and offsets.dtype in INDEX_DTYPES
        and k.device == device
        and v.device == device
        and v_cache.device == device
        and block_ids.device == device
        and offsets.device == device
        and k_shape[1] == cache_shape[1]
        and k_shape[2] == cache_shape[3]
        and v.shape == k_shape
        and v_cache.shape == cache_shape
        and block_ids.shape == rows
        and offsets.shape == rows
    )


def _explain_append_inputs(k_cache, v_cache, k, v, block_ids, offsets) -> None:
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    device = k_cache.device
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    _, num_kv_heads, _, head_dim = k_cache.shape
    # beside an FP8 cache, k and v are fp16 or bf16 (quantised on the way in)
    k_dtypes = tuple(d for d in FLOAT_DTYPES if k_cache.dtype in kv_dtypes_for(d))
    k = check_tensor("k", k, ndim=3, dtypes=k_dtypes, device=device)
    v = check_tensor("v", v, ndim=3, dtypes=(k.dtype,), device=device)
    batch = k.shape[0]
    for name, value, shape in (
        ("k", k, (batch, num_kv_heads, head_dim)),
        ("v", v, (batch, num_kv_heads, head_dim)),
    ):
        if value.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    for name, value in (("block_ids", block_ids), ("offsets", offsets)):
        value = check_tensor(name, value, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")


def _check_append_values(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor | None,
) -> None:
    """Range and distinctness of the slots (and positions >= 0): one small device read, none
    when these metadata tensors were validated before, unmodified."""
    if block_ids.shape[0] == 0:
        return
    shape = k_cache.shape
    try:
        key = (
            "append",
            metadata_key(block_ids),
            metadata_key(offsets),
            None if positions is None else metadata_key(positions),
            shape[0],
            shape[2],
        )
    except RuntimeError:  # inference tensors have no version counter: never cached
        key = None
    if key is not None and lookup(key, block_ids, offsets, positions):
        return
    check_append_stats(append_metadata_stats(block_ids, offsets, positions), shape[0], shape[2])
    if key is not None:
        remember(key, True, block_ids, offsets, positions)


def kv_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write ``k, v [B, Hkv, D]`` into token-major ``k/v_cache [num_blocks, Hkv, block_size, D]``
    at block ``block_ids[b]``, offset ``offsets[b]`` (bitwise). Validates everything first; a
    rejected call writes nothing. Slot metadata is validated once per unmodified tensor (see
    :func:`flashdec.decode` for the rule).

    FP8 caches (k, v fp16/bf16) need ``k_scale`` and ``v_scale`` (a float or a float32 tensor
    ``[num_kv_heads]``) and store ``x / scale`` saturated to +-448; float caches take none.
    """
    k_scale, v_scale = _check_append_inputs(
        k_cache, v_cache, k, v, block_ids, offsets, k_scale, v_scale
    )
    _check_append_values(k_cache, block_ids, offsets, None)
    launch_kv_append(k_cache, v_cache, k, v, block_ids, offsets, k_scale, v_scale)


def fused_rope_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    positions: torch.Tensor,
    rotary_dim: int | None = None,
    base: float = DEFAULT_ROPE_BASE,
    *,
    q_out: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """One kernel: rotate ``q [B, Hq, D]`` and ``k`` at ``positions [B]``, write rotated k and v
    into the cache slots, return rotated q (in ``q_out`` when given; it may be ``q`` itself).

    ``inv_freq`` (float32 ``[rotary_dim // 2]``, e.g. a model's rotary ``inv_freq`` with its
    scaling) replaces the frequencies derived from ``base``. Validates everything first; a
    rejected call writes nothing. Slot metadata is validated once per unmodified tensor (see
    :func:`flashdec.decode` for the rule).

    FP8 caches (q, k, v fp16/bf16) need ``k_scale`` and ``v_scale`` (a float or a float32
    tensor ``[num_kv_heads]``): the float32 rotated k and v are stored as ``x / scale``
    saturated to +-448; rotated q comes back in q's dtype. Float caches take no scales.
    """
    k_scale, v_scale = _check_append_inputs(
        k_cache, v_cache, k, v, block_ids, offsets, k_scale, v_scale
    )
    device = k_cache.device
    q = check_tensor("q", q, ndim=3, dtypes=(k.dtype,), device=device)
    batch, _, head_dim = q.shape
    if batch != k.shape[0] or head_dim != k.shape[2]:
        raise ValueError(
            f"q must be [batch={k.shape[0]}, num_q_heads, head_dim={k.shape[2]}], "
            f"got {tuple(q.shape)}"
        )
    positions = check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if positions.shape != (batch,):
        raise ValueError(f"positions must have shape ({batch},), got {tuple(positions.shape)}")
    rotary_dim = check_rotary_dim(rotary_dim, head_dim)
    base = check_rope_base(base)
    if inv_freq is not None:
        inv_freq = check_inv_freq(inv_freq, rotary_dim, device, base)
    if q_out is not None:
        q_out = check_tensor("q_out", q_out, ndim=3, dtypes=(q.dtype,), device=device)
        if q_out.shape != q.shape:
            raise ValueError(
                f"q_out must have q's shape {tuple(q.shape)}, got {tuple(q_out.shape)}"
            )
    _check_append_values(k_cache, block_ids, offsets, positions)
    return launch_fused_rope_kv_append(
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_ids,
        offsets,
        positions,
        rotary_dim,
        base,
        q_out,
        inv_freq,
        k_scale,
        v_scale,
    )
