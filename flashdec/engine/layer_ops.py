"""One layer's attention operations and their backends: RoPE + append, then paged decode.

This is where the cache and the kernels meet. The cache owns the reservation of a token's slots
and the layer order; the functions here store K/V into those slots (``torch`` index_put,
``triton`` scatter kernel, or ``fused`` RoPE + append kernel) and decode over them (``torch``
gather + dense math, or the ``triton`` split-KV kernel with a plan + workspace made once per step:
``flashdec.engine.decode_state``).
The Triton calls are the *trusted* launchers: the cache validated its own reservation, so no
index check (and no host sync) is repeated per layer.

With KV layer groups each layer runs in its group's storage, with its group's slots, geometry and
sliding window (``group=`` below; group 0 is the only group of a classic cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashdec._checks import (
    check_choice,
    check_rope_base,
    check_rotary_dim,
    check_tensor,
)
from flashdec.cache import PagedKVCache, TransactionSlots
from flashdec.cache.paged_kv_cache import torch_scatter
from flashdec.kernels import (
    ExtendWorkspace,
    extend,
    launch_fused_rope_kv_append,
    launch_kv_append,
    plan_extend,
)
from flashdec.reference import (
    apply_rope,
    apply_rope_inv_freq,
    dense_decode_attention_ref,
    dequantize_fp8,
    paged_extend_attention_ref,
    quantize_fp8,
)

APPEND_BACKENDS = ("torch", "triton", "fused")
DECODE_BACKENDS = ("torch", "triton")


@dataclass(frozen=True, eq=False)
class Rope:
    """How q and k are rotated: the first ``rotary_dim`` dims, split-half, at each token's
    position, with ``inv_freq`` (a model's own float32 table) or ``base ** (-2i / rotary_dim)``."""

    rotary_dim: int
    base: float = 10000.0
    inv_freq: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        head_dim: int,
        rotary_dim: int | None,
        base: float,
        inv_freq: torch.Tensor | None,
        device: torch.device,
    ) -> Rope:
        rotary_dim = check_rotary_dim(rotary_dim, head_dim)
        base = check_rope_base(base, "rope_base")
        if inv_freq is not None:
            inv_freq = check_tensor("rope_inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,))
            if inv_freq.shape[0] != rotary_dim // 2:
                raise ValueError(
                    f"rope_inv_freq must have rotary_dim // 2 = {rotary_dim // 2} entries, got "
                    f"{inv_freq.shape[0]}"
                )
            inv_freq = inv_freq.to(device).contiguous()
        return cls(rotary_dim, base, inv_freq)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Reference rotation (float32 math, one rounding) — the torch backends' path."""
        if self.inv_freq is None:
            return apply_rope(x, positions, self.rotary_dim, self.base)
        return apply_rope_inv_freq(x, positions, self.inv_freq)


def write_rope_layer(
    backend: str,
    rope: Rope,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: TransactionSlots,
    q_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k at the reserved positions, store rotated k and v; returns rotated q.

    ``q, k, v`` have one row per slot row (padding rows included: their K/V are not stored).
    An FP8 layer quantizes with its group's fixed ``k_scale, v_scale`` (float32 ``[Hkv]``).
    """
    if backend == "fused":
        return launch_fused_rope_kv_append(
            q,
            k,
            v,
            k_layer,
            v_layer,
            slots.block_ids,
            slots.offsets,
            slots.positions,
            rope.rotary_dim,
            rope.base,
            q_out,
            rope.inv_freq,
            k_scale,
            v_scale,
        )
    positions = slots.positions
    q_rot = rope.apply(q, positions)
    k_rot = rope.apply(k, positions)
    write_plain_layer(backend, k_rot, v, k_layer, v_layer, slots, k_scale, v_scale)
    if q_out is not None:
        q_out.copy_(q_rot)
        return q_out
    return q_rot


def write_plain_layer(
    backend: str,
    k: torch.Tensor,
    v: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: TransactionSlots,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k, v`` in the reserved slots (``torch`` or the ``triton`` scatter): bitwise in a
    float layer, quantized with ``k_scale, v_scale`` in an FP8 one.

    ``k, v`` hold one row per token of the transaction; a window group's prompt import stores
    only the rows its window keeps (``slots.token_rows``).
    """
    rows = slots.token_rows
    if backend == "torch":
        if rows is None:
            count = slots.num_tokens
            k, v = k[:count], v[:count]
        if k_scale is not None:  # scattered as bytes: float8 index_put is not everywhere
            k = quantize_fp8(k, k_scale).view(torch.uint8)
            v = quantize_fp8(v, v_scale).view(torch.uint8)
            k_layer, v_layer = k_layer.view(torch.uint8), v_layer.view(torch.uint8)
        torch_scatter(k_layer, v_layer, k, v, slots)  # it selects token_rows itself
    else:
        if rows is not None:
            k, v = k.index_select(0, rows), v.index_select(0, rows)
        launch_kv_append(k_layer, v_layer, k, v, slots.block_ids, slots.offsets, k_scale, v_scale)


def torch_paged_decode(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sm_scale: float | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the first ``max_seq_len`` tokens of each request, then dense masked attention
    (with ``window``, over each request's last ``window`` positions: table entries before them
    are gathered but masked, so they must only be in range, as a cache's released ones are).
    An FP8 layer is gathered as bytes and dequantized with ``k_scale, v_scale``; the math then
    runs in float32 and the output is in q's dtype."""
    batch = q.shape[0]
    block_size = k_layer.shape[2]
    num_blocks = max(1, -(-max_seq_len // block_size))
    ids = block_tables[:, :num_blocks].long()  # [B, nb]
    num_kv_heads, head_dim = k_layer.shape[1], k_layer.shape[3]
    dense_shape = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    if k_scale is not None:
        fp8 = k_layer.dtype
        k_layer, v_layer = k_layer.view(torch.uint8), v_layer.view(torch.uint8)
    k = k_layer[ids].transpose(2, 3).reshape(dense_shape)  # [B, nb, Hkv, bs, D] -> [B, L, Hkv, D]
    v = v_layer[ids].transpose(2, 3).reshape(dense_shape)
    if k_scale is None:
        return dense_decode_attention_ref(q, k, v, seq_lens, sm_scale, window=window)
    k, v = dequantize_fp8(k.view(fp8), k_scale), dequantize_fp8(v.view(fp8), v_scale)
    out = dense_decode_attention_ref(q.float(), k, v, seq_lens, sm_scale, window=window)
    return out.to(q.dtype)


def extend_attention(
    backend: str,
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float | None,
    window: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    workspace: ExtendWorkspace | None = None,
) -> torch.Tensor:
    """The new tokens' attention ``[T, Hq, D]`` over a layer's cache (their K/V stored): the
    ``triton`` extend kernel, or the ``torch`` reference (float32 math) in q's dtype.

    ``workspace`` (triton, from :func:`extend_workspace`): the step's plan, made from the
    lengths the host knows, so the kernel runs without reading the metadata back (the cache
    reserved it: trusted, as decode's)."""
    args = (q, k_layer, v_layer, block_tables, seq_lens, query_lens, sm_scale)
    options = {"window": window, "k_scale": k_scale, "v_scale": v_scale}
    if backend != "triton":
        return paged_extend_attention_ref(*args, **options).to(q.dtype)
    if workspace is not None:  # each layer's output outlives the shared workspace
        options.update(workspace=workspace, out=torch.empty_like(q))
    return extend(*args, **options)


def extend_workspace(
    cache: PagedKVCache,
    group: int,
    num_q_heads: int,
    dtype: torch.dtype,
    query_lens: Sequence[int],
    max_seq_len: int,
) -> ExtendWorkspace:
    """The extend plan and workspace of KV group ``group`` for one step: ``query_lens`` new
    tokens per request, the longest request ``max_seq_len`` tokens after the step."""
    spec = cache.kv_groups[group]
    plan = plan_extend(
        len(query_lens),
        sum(query_lens),
        num_q_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        max_seq_len,
        dtype,
        cache.device,
        max_blocks_per_seq=cache.layout.group_max_blocks_per_seq(group),
        max_query_len=max(query_lens),
        window=spec.window,
        kv_dtype=spec.dtype,
    )
    return ExtendWorkspace.allocate(plan)


@dataclass(frozen=True, eq=False)
class RopeAppendResult:
    """What one RoPE append did (tensors on the cache's device)."""

    q: torch.Tensor  # [B, Hq, D] rotated query
    positions: torch.Tensor  # [B] int32, positions of the appended tokens (pre-append seq_lens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, including the new tokens
    seq_lens: torch.Tensor  # [B] int32, committed lengths after the append


def rope_paged_kv_append(
    cache: PagedKVCache,
    layer_idx: int,
    request_ids: Sequence,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary_dim: int | None,
    append_backend: str = "torch",
    base: float = 10000.0,
) -> RopeAppendResult:
    """Rotate ``q`` and ``k`` at each request's seq_len and append rotated k and v (one layer).

    Only for single-layer caches (``layer_idx`` must be 0); ``append_backend`` is "torch"
    (reference RoPE + index_put), "triton" (reference RoPE + Triton scatter) or "fused" (one
    kernel). All three store the same bytes; rotated q agrees within dtype rounding. Everything
    is validated before the cache changes.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    backend = check_choice("append_backend", append_backend, APPEND_BACKENDS)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
    if layer_idx != 0:
        raise ValueError(
            f"rope_paged_kv_append is the single-layer helper: layer_idx must be 0, got "
            f"{layer_idx}; use begin_token / write_token_layer for multi-layer caches"
        )
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
        raise TypeError(
            f"request_ids must be a list or tuple of ids, got {type(request_ids).__name__}"
        )
    if cache.layout.group_kv_scales(0) is not None:
        raise ValueError(
            "rope_paged_kv_append does not run FP8 caches; use DecodeEngine(cache, "
            "activation_dtype=...)"
        )
    batch = len(request_ids)
    check_step_inputs(cache, batch, q, k, v)
    rope = Rope.build(cache.head_dim, rotary_dim, base, None, cache.device)

    def write(k_layer, v_layer, slots):
        return write_rope_layer(backend, rope, q, k, v, k_layer, v_layer, slots), slots

    q_rot, slots = cache.steps.append_with(list(request_ids), write)
    return RopeAppendResult(
        q=q_rot,
        positions=slots.positions,
        block_tables=slots.block_tables,
        seq_lens=slots.seq_lens_after,
    )


def check_step_inputs(
    cache: PagedKVCache,
    rows: int,
    q: object,
    k: object,
    v: object,
    group: int = 0,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Structural checks of one layer's ``q [rows, Hq, D]`` and ``k, v [rows, Hkv, D]`` (in
    layer group ``group``'s geometry; ``dtype``: the activations', default the group's)."""
    spec = cache.kv_groups[group]
    dtype, device = spec.dtype if dtype is None else dtype, cache.device
    q = check_tensor("q", q, ndim=3, dtypes=(dtype,), device=device)
    k = check_tensor("k", k, ndim=3, dtypes=(dtype,), device=device)
    v = check_tensor("v", v, ndim=3, dtypes=(dtype,), device=device)
    hkv, dim = spec.num_kv_heads, spec.head_dim
    if q.shape[0] != rows or q.shape[2] != dim:
        raise ValueError(f"q must have shape [{rows}, num_q_heads, {dim}], got {tuple(q.shape)}")
    if q.shape[1] == 0 or q.shape[1] % hkv:
        raise ValueError(
            f"q's num_q_heads ({q.shape[1]}) must be a positive multiple of num_kv_heads ({hkv})"
        )
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (rows, hkv, dim):
            raise ValueError(f"{name} must have shape {(rows, hkv, dim)}, got {tuple(t.shape)}")
    return q, k, v


def check_prompt_layers(
    cache: PagedKVCache, k_layers: object, v_layers: object, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``DecodeEngine.prefill_request_layers``' K and V as one ``[T, Hkv, D]`` tensor per layer,
    each in its layer's group geometry, the same ``T >= 1`` for every layer."""
    ks = _prompt_layers(cache, "k_layers", k_layers, dtype)
    vs = _prompt_layers(cache, "v_layers", v_layers, dtype)
    count = ks[0].shape[0]
    specs = [cache.kv_groups[cache.layout.layer_group(i)] for i in range(cache.num_layers)]
    for name, layers in (("k_layers", ks), ("v_layers", vs)):
        for i, (t, spec) in enumerate(zip(layers, specs, strict=True)):
            expected = (count, spec.num_kv_heads, spec.head_dim)
            if tuple(t.shape) != expected or count == 0:
                raise ValueError(
                    f"{name}: layer {i} must have shape {expected} (T >= 1, the same T for "
                    f"every layer), got {tuple(t.shape)}"
                )
    return ks, vs


def _prompt_layers(
    cache: PagedKVCache, name: str, value: object, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``prefill_request_layers``' K or V as one ``[T, Hkv, D]`` tensor per layer."""
    num_layers = cache.num_layers
    specs = [cache.kv_groups[cache.layout.layer_group(i)] for i in range(num_layers)]
    if isinstance(value, torch.Tensor):
        kinds = {(spec.num_kv_heads, spec.head_dim) for spec in specs}
        if len(kinds) != 1:
            raise ValueError(
                f"{name}: this cache's KV layer groups differ in Hkv or head_dim; "
                "pass one tensor per layer"
            )
        check_tensor(name, value, dtypes=(dtype,), device=cache.device)
        if value.dim() not in (3, 4):
            raise ValueError(
                f"{name} must be [num_layers, Hkv, D] or [num_layers, T, Hkv, D], got "
                f"{tuple(value.shape)}"
            )
        if value.dim() == 3:
            value = value.unsqueeze(1)
        if value.shape[0] != num_layers:
            raise ValueError(
                f"{name} must have {num_layers} layers (dim 0), got {tuple(value.shape)}"
            )
        return list(value.unbind(0))
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{name} must be a tensor or a list of per-layer tensors, got {type(value).__name__}"
        )
    if len(value) != num_layers:
        raise ValueError(f"{name} must hold {num_layers} layers, got {len(value)}")
    layers = []
    for i, t in enumerate(value):
        check_tensor(f"{name}[{i}]", t, dtypes=(dtype,), device=cache.device)
        if t.dim() not in (2, 3):
            raise ValueError(f"{name}[{i}] must be [Hkv, D] or [T, Hkv, D], got {tuple(t.shape)}")
        layers.append(t.unsqueeze(0) if t.dim() == 2 else t)
    return layers
