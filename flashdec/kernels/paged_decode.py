"""Paged single-token decode attention, the host side: :func:`decode` checks every input (and,
without a workspace, the metadata's values on the device, read back once per metadata tensor)
and plans the call; :func:`launch_decode` is the trusted launch (no checks, no allocation, no
host sync); :class:`BoundDecode` binds a launch to one step's metadata, plan and workspace.

The kernels (split-KV, the log-sum-exp merge of the splits) are in
:mod:`flashdec.kernels.decode_kernel`, the device helpers they share with extend in
:mod:`flashdec.kernels.attention_tiles`. Limits: head_dim <= 256; any page size; strides honoured.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flashdec._checks import (
    FP8_DTYPE,
    PagedDecodeDims,
    check_kv_scales,
    check_paged_decode_inputs,
    check_paged_decode_stats,
    check_positive_int,
    check_tensor,
    check_window,
    resolve_sm_scale,
    same_device,
)
from flashdec.kernels._runtime import INTERPRET, Launcher, PlanMemo, check_kernel_device
from flashdec.kernels._scales import call_scales, scale_tensor
from flashdec.kernels.attention_tiles import _STAGING_BITS, FP8_F16, FP8_ON, LOG2E

# re-exported (unused here): tests read every bit of the KV_FP8 constexpr from this module
from flashdec.kernels.attention_tiles import FP8_STAGE_K as FP8_STAGE_K
from flashdec.kernels.attention_tiles import FP8_STAGE_V as FP8_STAGE_V
from flashdec.kernels.decode_kernel import _decode_kernel, _merge_splits_kernel
from flashdec.kernels.decode_plan import DecodePlan, DecodeWorkspace, plan_decode
from flashdec.kernels.dependent_launch import dependent_launch
from flashdec.kernels.validation import decode_metadata_stats, lookup, metadata_key, remember

_DECODE = Launcher(_decode_kernel)
_MERGE = Launcher(_merge_splits_kernel)


def _check_plan_matches(
    plan: DecodePlan,
    dims: PagedDecodeDims,
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    kv_layout: str,
    window: int | None,
) -> None:
    """Structural agreement between a workspace's plan and this call (no host sync). Also the
    check of an :class:`~flashdec.kernels.extend_plan.ExtendPlan`, which has the same fields."""
    if (
        dims.num_q_heads == plan.num_q_heads
        and dims.num_kv_heads == plan.num_kv_heads
        and dims.head_dim == plan.head_dim
        and dims.block_size == plan.block_size
        and dims.batch <= plan.batch
        and q.dtype == plan.dtype
        and kv_layout == plan.kv_layout
        and q.device == plan.device
        and window == plan.window
        and kv_dtype == plan.cache_dtype
    ):
        return  # the common case
    for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size"):
        if getattr(dims, name) != getattr(plan, name):
            raise ValueError(
                f"workspace was planned for {name}={getattr(plan, name)}, but the inputs have "
                f"{name}={getattr(dims, name)}"
            )
    if dims.batch > plan.batch:
        raise ValueError(f"workspace was planned for batch <= {plan.batch}, got {dims.batch}")
    if q.dtype != plan.dtype:
        raise TypeError(f"workspace was planned for dtype {plan.dtype}, got {q.dtype}")
    if kv_dtype != plan.cache_dtype:
        raise TypeError(
            f"workspace was planned for a {plan.cache_dtype} cache, got {kv_dtype} (pass "
            "kv_dtype= to the plan)"
        )
    if kv_layout != plan.kv_layout:
        raise ValueError(
            f"workspace was planned for kv_layout {plan.kv_layout!r}, got {kv_layout!r}"
        )
    if not same_device(q.device, plan.device):
        raise TypeError(f"workspace lives on {plan.device}, inputs on {q.device}")
    if window != plan.window:
        raise ValueError(
            f"workspace was planned for window={plan.window}, got window={window} (pass "
            "window= to the plan)"
        )


class _PlanConstants:
    """What a launch reads off its plan, computed once per plan object."""

    __slots__ = ("decode", "decode_fused", "fp8", "merge", "plan", "swap_kv", "window")

    def __init__(self, plan: DecodePlan) -> None:
        self.plan = plan  # held so that the id() key cannot be reused while the entry lives
        self.fp8 = plan.cache_dtype == FP8_DTYPE
        kv_fp8 = 0
        if self.fp8:
            kv_fp8 = FP8_ON | (FP8_F16 if plan.fp8_compute == "f16" else 0)
            if not INTERPRET:  # staging is a GPU code-layout choice (same values either way)
                kv_fp8 |= _STAGING_BITS[plan.fp8_staging]
        # fp16 dots are right in the interpreter: an fp8_compute="f16" plan runs its GPU path
        upcast = INTERPRET and plan.dtype == torch.bfloat16 and not kv_fp8 & FP8_F16
        precision = "ieee" if (plan.dtype == torch.float32 or upcast) else "tf32"
        self.decode = (
            plan.num_kv_heads,
            plan.group_size,
            plan.block_size,
            plan.head_dim,
            plan.block_g,
            plan.block_d,
            plan.block_n,
            plan.block_b,
            plan.uses_split,
            upcast,
            precision,
            plan.window is not None,
            kv_fp8,
        )
        # (FUSED_MERGE, MERGE_G, MERGE_S): the merge tile only matters, and only specialises
        # the kernel, when the launch merges in place
        self.decode_fused = (*self.decode, True, plan.merge_block_g, plan.merge_chunk_splits)
        self.decode = (*self.decode, False, 1, 1)
        self.merge = (
            plan.num_q_heads,
            plan.head_dim,
            plan.block_d // plan.merge_block_d,
            plan.merge_block_d,
            plan.merge_block_s,
            plan.block_n,
            plan.window is not None,
        )
        self.window = 0 if plan.window is None else plan.window
        self.swap_kv = plan.kv_layout == "dim_major"  # (dim, token) strides -> (token, dim)


_plan_constants = PlanMemo(_PlanConstants).get


def _decode_launches(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    sm_scale,
    plan,
    out,
    partial_out,
    partial_lse,
    batch,
    k_scale,
    v_scale,
    counters,
) -> tuple[tuple, tuple | None, bool]:
    """The arguments of the decode launch and, with splits merged by a second kernel (a plan
    without ``fused_merge``, or no counters), of the merge launch; whether both are dependent
    launches (:mod:`flashdec.kernels.dependent_launch`)."""
    consts = _plan_constants(plan)
    pdl = dependent_launch(q.device)
    if not consts.fp8:  # never read: seq_lens stands in for the scale pointers
        k_scale = v_scale = seq_lens
    fused = plan.fused_merge and counters is not None
    if not fused:  # likewise for the counters
        counters = seq_lens
    skb, skh, sk2, sk3 = k_cache.stride()
    svb, svh, sv2, sv3 = v_cache.stride()
    if consts.swap_kv:
        sk2, sk3, sv2, sv3 = sk3, sk2, sv3, sv2
    splits = plan.num_splits
    if splits == 1:  # the partial buffers are not touched: out stands in for their pointers
        grid = batch * plan.num_kv_heads
        tensors = (
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            out,
            out,
            k_scale,
            v_scale,
            counters,
        )
        partial_strides = (0, 0, 0, 0, 0, 0, 0)
    else:
        grid = plan.num_programs
        tensors = (
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            partial_out,
            partial_lse,
            k_scale,
            v_scale,
            counters,
        )
        partial_strides = (*partial_out.stride(), *partial_lse.stride())
    decode_args = (
        grid,
        tensors,
        (
            sm_scale * LOG2E,
            batch,
            plan.tokens_per_split,
            splits,
            grid,
            consts.window,
            *q.stride(),
            skb,
            skh,
            sk2,
            sk3,
            svb,
            svh,
            sv2,
            sv3,
            *block_tables.stride(),
            *out.stride(),
            *partial_strides,
        ),
        (*(consts.decode_fused if fused else consts.decode), pdl),
        plan.num_warps,
        plan.num_stages,
    )
    merge_args = None
    if splits > 1 and not fused:
        merge_args = (
            batch * plan.num_q_heads * (plan.block_d // plan.merge_block_d),
            (partial_out, partial_lse, seq_lens, out),
            (
                plan.tokens_per_split,
                splits,
                *partial_out.stride(),
                *partial_lse.stride(),
                *out.stride(),
                consts.window,
            ),
            (*consts.merge, pdl),
            4,
        )
    return decode_args, merge_args, pdl


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    plan: DecodePlan,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    batch: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Trusted launcher: no checks, no allocation, no host sync (inputs already validated).

    An FP8 plan (``kv_dtype=float8_e4m3fn``) needs ``k_scale``/``v_scale`` as contiguous
    float32 device tensors ``[num_kv_heads]`` (read on the device: CUDA-graph capturable).
    ``counters`` (a workspace's: contiguous int32 ``[>= batch, num_kv_heads]``, zero, and left
    zero) lets a ``fused_merge`` plan merge its splits in the same launch; without them a split
    plan launches a second, merge kernel."""
    if batch == 0:
        return out
    decode_args, merge_args, pdl = _decode_launches(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        sm_scale,
        plan,
        out,
        partial_out,
        partial_lse,
        batch,
        k_scale,
        v_scale,
        counters,
    )
    _DECODE(*decode_args, pdl=pdl)
    if merge_args is not None:
        _MERGE(*merge_args, pdl=pdl)
    return out


class BoundDecode:
    """:func:`launch_decode` bound to one step's metadata, plan and workspace: a call takes the
    layer's ``q, k_cache, v_cache, out`` — with the dtypes and strides of the ones it was bound
    with (a caller that cannot promise that binds again) — and launches with no per-call
    argument building. The plan's window applies; an FP8 plan's ``k_scale``/``v_scale`` are
    per-call too (each layer has its own; the ones bound serve a call that passes none), and
    the workspace's ``counters`` are bound (one launch instead of two with a ``fused_merge``
    plan)."""

    K_SCALE, V_SCALE = 8, 9  # positions of the scale pointers among the launch's tensors

    __slots__ = ("_scales", "decode", "merge", "single")

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        sm_scale,
        plan,
        out,
        partial_out,
        partial_lse,
        batch,
        k_scale=None,
        v_scale=None,
        counters=None,
    ) -> None:
        decode_args, merge_args, pdl = _decode_launches(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            sm_scale,
            plan,
            out,
            partial_out,
            partial_lse,
            batch,
            k_scale,
            v_scale,
            counters,
        )
        self.single = not plan.uses_split  # out also stands in for the two partial buffers
        dynamic = (0, 1, 2, 5, 6, 7) if self.single else (0, 1, 2, 5)
        fp8 = _plan_constants(plan).fp8
        self._scales = (decode_args[1][self.K_SCALE], decode_args[1][self.V_SCALE]) if fp8 else None
        if fp8:
            dynamic = (*dynamic, self.K_SCALE, self.V_SCALE)
        self.decode = _DECODE.bind(*decode_args, dynamic=dynamic, pdl=pdl)
        # splits merged by a second launch (a plan without fused_merge, or no counters)
        self.merge = None if merge_args is None else _MERGE.bind(*merge_args, dynamic=(3,), pdl=pdl)

    def __call__(self, q, k_cache, v_cache, out, k_scale=None, v_scale=None) -> torch.Tensor:
        scales = call_scales(self._scales, k_scale, v_scale)
        if self.single:
            self.decode(q, k_cache, v_cache, out, out, out, *scales)
        else:
            self.decode(q, k_cache, v_cache, out, *scales)
        if self.merge is not None:
            self.merge(out)
        return out


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    block_size: int | None = None,
    num_warps: int | None = None,
    kv_layout: str = "token_major",
    num_stages: int | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention of ``q [B, Hq, D]`` over one layer's cache; returns ``[B, Hq, D]``.

    Same semantics as :func:`flashdec.paged_decode_attention_ref`. ``block_size``, if given,
    must equal the cache's page size. ``num_warps`` / ``num_stages`` override the tuned defaults.

    ``window`` (sliding-window layers): each request of length ``L`` attends only to positions
    ``[max(0, L - window), L)``. The kernel starts at the window's first block and the splits cut
    only the window, so bytes read and time follow ``min(L, window)``; table entries of blocks
    wholly before the window are never read (nor checked) and may hold anything. With a
    workspace, its plan must have been made with the same ``window``.

    FP8 KV: with ``torch.float8_e4m3fn`` caches (q and the output fp16/bf16) ``k_scale`` and
    ``v_scale`` are required — each a float or a float32 tensor ``[num_kv_heads]`` — and a key
    is ``stored.float() * k_scale[kv_head]`` (a value likewise). The kernel loads FP8 (half the
    bytes) and converts it on chip; by default (``DecodePlan.fp8_compute="f16"``) the K scale and
    softmax scale are folded into q in float32 and both dots run in fp16, so q times that
    factor must stay below 65504 (q itself may exceed fp16's range); the V scale is applied to
    the output. For CUDA-graph capture pass tensors (a float becomes a small cached device
    tensor). Float caches take no scales (ValueError); the workspace's plan must have been made
    with ``kv_dtype=torch.float8_e4m3fn``.

    With ``workspace`` (from :func:`plan_decode`) the call allocates nothing and never syncs with
    the host (CUDA-graph capturable): the split count is the plan's, the output goes to ``out``
    or ``workspace.out``, and the metadata's values are the caller's responsibility.

    Without it, the lengths and the used block ids are range-checked on the device and read back
    in one small transfer, which also sizes the plan. What that read established is cached per
    metadata tensor: a later call with the same ``block_tables`` and ``seq_lens`` objects,
    unmodified, pays no read at all. Every in-place write through PyTorch (``copy_``, indexing,
    ``out=``) invalidates the entry; a table written behind PyTorch's back (a custom kernel, a
    CUDA-graph replay, ``.data``, a NumPy/DLPack view) must be passed as a fresh tensor, or the
    cache emptied with :func:`flashdec.kernels.clear_validation_cache`. Inference-mode tensors
    are checked on every call.
    """
    dims = check_paged_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens, kv_layout)
    check_kernel_device("q", q)
    if window is not None:
        check_window(window)
    kv_dtype = k_cache.dtype
    if block_size is not None or num_warps is not None or num_stages is not None:
        _check_overrides(dims, block_size, num_warps, num_stages)
    k_scale, v_scale, scale, out = _check_call_arguments(
        q, kv_dtype, k_scale, v_scale, dims, sm_scale, out
    )

    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise TypeError(f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
        plan = workspace.plan
        _check_plan_matches(plan, dims, q, kv_dtype, kv_layout, window)
        if out is None:
            out = workspace.out if dims.batch == plan.batch else workspace.out[: dims.batch]
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
        counters = workspace.counters
    else:
        if dims.batch == 0:
            return torch.empty_like(q) if out is None else out
        plan = _validated_plan(q, kv_dtype, block_tables, seq_lens, dims, kv_layout, window)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if plan.uses_split:
            shape = (dims.batch, dims.num_q_heads, plan.num_splits)
            partial_out = torch.empty(*shape, dims.head_dim, dtype=torch.float32, device=q.device)
            partial_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        else:
            partial_out = partial_lse = out
        counters = None
        if plan.fused_merge:
            counters = torch.zeros(
                dims.batch, dims.num_kv_heads, dtype=torch.int32, device=q.device
            )
    if num_warps is not None or num_stages is not None:
        plan = dataclasses.replace(
            plan,
            num_warps=plan.num_warps if num_warps is None else num_warps,
            num_stages=plan.num_stages if num_stages is None else num_stages,
        )
    return launch_decode(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        plan,
        out,
        partial_out,
        partial_lse,
        dims.batch,
        k_scale,
        v_scale,
        counters,
    )


def _check_call_arguments(q, kv_dtype, k_scale, v_scale, dims, sm_scale, out) -> tuple:
    """What the public decode and extend calls check alike after their inputs' shapes: the KV
    scales (``[Hkv]`` float32 tensors on q's device, or None for a float cache without any),
    head_dim, the softmax scale and ``out``; returns ``(k_scale, v_scale, sm_scale, out)``."""
    if k_scale is not None or v_scale is not None or kv_dtype == FP8_DTYPE:
        k_scale, v_scale = check_kv_scales(kv_dtype, k_scale, v_scale, dims.num_kv_heads, q.device)
        k_scale = scale_tensor(k_scale, dims.num_kv_heads, q.device)
        v_scale = scale_tensor(v_scale, dims.num_kv_heads, q.device)
    if dims.head_dim > 256:
        raise ValueError(f"head_dim must be <= 256, got {dims.head_dim}")
    scale = resolve_sm_scale(sm_scale, dims.head_dim)
    if out is not None:
        out = check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    return k_scale, v_scale, scale, out


def _check_overrides(
    dims: PagedDecodeDims, block_size: object, num_warps: object, num_stages: object
) -> None:
    if block_size is not None:
        check_positive_int("block_size", block_size)
        if block_size != dims.block_size:
            raise ValueError(
                f"block_size={block_size} does not match the cache's page size {dims.block_size}"
            )
    if num_warps is not None:
        check_positive_int("num_warps", num_warps)
        if num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if num_stages is not None:
        check_positive_int("num_stages", num_stages)


def _validated_plan(
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: PagedDecodeDims,
    kv_layout: str,
    window: int | None,
) -> DecodePlan:
    """The plan of an eager call, after the metadata's range checks (cached per metadata)."""
    try:
        key = ("decode", metadata_key(block_tables), metadata_key(seq_lens), dims, kv_layout)
        key += (q.dtype, kv_dtype, window)
    except RuntimeError:  # inference tensors have no version counter: never cached
        key = None
    if key is not None:
        plan = lookup(key, block_tables, seq_lens)
        if plan is not None:
            return plan  # type: ignore[return-value]
    stats = decode_metadata_stats(block_tables, seq_lens, dims, window)
    check_paged_decode_stats(stats, dims)
    plan = _cached_plan(
        dims,
        _bucket(stats.max_len),
        _bucket(stats.total_len),
        q.dtype,
        q.device,
        kv_layout,
        window,
        kv_dtype,
    )
    if key is not None:
        remember(key, plan, block_tables, seq_lens)
    return plan


def _bucket(n: int) -> int:
    """Round up to a few significant bits so that plans are reused across nearby lengths."""
    if n <= 64:
        return n
    shift = n.bit_length() - 4
    return ((n + (1 << shift) - 1) >> shift) << shift


_PLAN_CACHE: dict[tuple, DecodePlan] = {}


def _cached_plan(
    dims: PagedDecodeDims,
    max_len: int,
    total: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_layout: str,
    window: int | None,
    kv_dtype: torch.dtype,
) -> DecodePlan:
    key = (dims.batch, dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size)
    key += (max_len, total, dtype, device, kv_layout, window, kv_dtype)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if len(_PLAN_CACHE) >= 4096:
            _PLAN_CACHE.clear()
        plan = plan_decode(
            dims.batch,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
            dims.block_size,
            max_len,
            dtype,
            device,
            kv_layout,
            max_blocks_per_seq=max(1, math.ceil(max_len / dims.block_size)),
            total_tokens=total,
            window=window,
            kv_dtype=kv_dtype,
        )
        _PLAN_CACHE[key] = plan
    return plan


paged_decode_attention = decode
