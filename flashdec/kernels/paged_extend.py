"""Paged extend attention, the host side: each request brings ``n >= 1`` new tokens (a prompt
chunk, speculative tokens to verify, or one decode token), each attending causally to its paged
context and the new tokens before it (SPEC §8.6). :func:`extend` checks every input (and,
without a workspace, the metadata's values on the device, read back once per metadata tensor)
and plans the call; :func:`launch_extend` is the trusted launch (no checks, no allocation, no
host sync); :func:`extend_launch_arguments` builds its arguments.

The kernel (query tiles of G heads, split-KV merged in the same launch) is in
:mod:`flashdec.kernels.extend_kernel`. Limits: head_dim <= 256; any page size; strides honoured;
token-major and dim-major caches; FP8 (e4m3) caches beside fp16/bf16 queries.
"""

from __future__ import annotations

import math

import torch

from flashdec._checks import (
    FP8_DTYPE,
    PagedDecodeDims,
    check_paged_decode_stats,
    check_paged_extend_inputs,
    check_query_len_stats,
    check_window,
)
from flashdec.kernels._runtime import INTERPRET, Launcher, PlanMemo, check_kernel_device
from flashdec.kernels._scales import call_scales
from flashdec.kernels.attention_tiles import FP8_ON, LOG2E
from flashdec.kernels.extend_kernel import _extend_kernel
from flashdec.kernels.extend_plan import (
    ExtendPlan,
    ExtendWorkspace,
    allocate_partials,
    plan_extend,
)
from flashdec.kernels.paged_decode import _bucket, _check_call_arguments, _check_plan_matches
from flashdec.kernels.validation import extend_metadata_stats, lookup, metadata_key, remember

_EXTEND = Launcher(_extend_kernel)


class _PlanConstants:
    """What a launch reads off its plan, computed once per plan object."""

    __slots__ = ("constexprs", "fp8", "plan", "swap_kv", "window")

    def __init__(self, plan: ExtendPlan) -> None:
        self.plan = plan  # held so that the id() key cannot be reused while the entry lives
        self.fp8 = plan.cache_dtype == FP8_DTYPE
        upcast = INTERPRET and plan.dtype == torch.bfloat16
        precision = "ieee" if (plan.dtype == torch.float32 or upcast) else "tf32"
        self.constexprs = (
            plan.num_kv_heads,
            plan.group_size,
            plan.block_size,
            plan.head_dim,
            plan.block_m,
            plan.block_d,
            plan.block_n,
            plan.block_b,
            plan.uses_split,
            upcast,
            precision,
            plan.window is not None,
            FP8_ON if self.fp8 else 0,
        )
        self.window = 0 if plan.window is None else plan.window
        self.swap_kv = plan.kv_layout == "dim_major"  # (dim, token) strides -> (token, dim)


_plan_constants = PlanMemo(_PlanConstants).get


def launch_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float,
    plan: ExtendPlan,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    counters: torch.Tensor,
    batch: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Trusted launcher: no checks, no allocation, no host sync (inputs already validated;
    ``batch <= plan.batch`` requests, at most ``plan.total_q`` rows). A split plan needs a
    workspace's ``partial_out``/``partial_lse`` and its zeroed ``counters`` (left zero); an FP8
    plan ``k_scale``/``v_scale`` as contiguous float32 device tensors ``[num_kv_heads]``."""
    if batch == 0:
        return out
    _EXTEND(
        *extend_launch_arguments(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_lens,
            sm_scale,
            plan,
            out,
            partial_out,
            partial_lse,
            counters,
            batch,
            k_scale,
            v_scale,
        )
    )
    return out


def extend_launch_arguments(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_lens,
    sm_scale,
    plan,
    out,
    partial_out,
    partial_lse,
    counters,
    batch,
    k_scale,
    v_scale,
) -> tuple:
    """``(grid, tensors, scalars, constexprs, num_warps, num_stages)`` of the extend launch
    (also what ``benchmarks/compile_extend.py`` compiles for sm_90 without a GPU)."""
    consts = _plan_constants(plan)
    if not consts.fp8:  # never read: seq_lens stands in for the scale pointers
        k_scale = v_scale = seq_lens
    skb, skh, sk2, sk3 = k_cache.stride()
    svb, svh, sv2, sv3 = v_cache.stride()
    if consts.swap_kv:
        sk2, sk3, sv2, sv3 = sk3, sk2, sv3, sv2
    if plan.uses_split:
        partials = (partial_out, partial_lse, counters)
        partial_strides = (*partial_out.stride(), *partial_lse.stride())
    else:  # never touched: out and seq_lens stand in for their pointers
        partials = (out, out, seq_lens)
        partial_strides = (0,) * 9
    return (
        plan.num_programs,
        (q, k_cache, v_cache, block_tables, seq_lens, query_lens, out, *partials, k_scale, v_scale),
        (
            sm_scale * LOG2E,
            batch,
            plan.num_splits,
            plan.tokens_per_split,
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
            seq_lens.stride(0),
            query_lens.stride(0),
            *out.stride(),
            *partial_strides,
        ),
        consts.constexprs,
        plan.num_warps,
        plan.num_stages,
    )


class BoundExtend:
    """:func:`launch_extend` bound to one step's metadata, plan and workspace (as
    :class:`~flashdec.kernels.paged_decode.BoundDecode` is decode's): a call takes the layer's
    ``q, k_cache, v_cache, out`` (and an FP8 layer's ``k_scale``/``v_scale``; the ones bound
    serve a call that passes none) with the dtypes and strides of the ones it was bound with and
    launches with no per-call argument building."""

    K_SCALE, V_SCALE = 10, 11  # positions of the scale pointers among the launch's tensors

    __slots__ = ("_scales", "launch", "single")

    def __init__(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_lens,
        sm_scale,
        plan,
        out,
        partial_out,
        partial_lse,
        counters,
        batch,
        k_scale=None,
        v_scale=None,
    ) -> None:
        args = extend_launch_arguments(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_lens,
            sm_scale,
            plan,
            out,
            partial_out,
            partial_lse,
            counters,
            batch,
            k_scale,
            v_scale,
        )
        self.single = not plan.uses_split  # out also stands in for the two partial buffers
        dynamic = (0, 1, 2, 6, 7, 8) if self.single else (0, 1, 2, 6)
        fp8 = _plan_constants(plan).fp8
        self._scales = (args[1][self.K_SCALE], args[1][self.V_SCALE]) if fp8 else None
        if fp8:
            dynamic = (*dynamic, self.K_SCALE, self.V_SCALE)
        self.launch = _EXTEND.bind(*args, dynamic=dynamic)

    def __call__(self, q, k_cache, v_cache, out, k_scale=None, v_scale=None) -> torch.Tensor:
        scales = call_scales(self._scales, k_scale, v_scale)
        if self.single:
            self.launch(q, k_cache, v_cache, out, out, out, *scales)
        else:
            self.launch(q, k_cache, v_cache, out, *scales)
        return out


def extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    sm_scale: float | None = None,
    kv_layout: str = "token_major",
    *,
    out: torch.Tensor | None = None,
    workspace: ExtendWorkspace | None = None,
    window: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged extend attention of ``q [total_q, Hq, D]`` (the new tokens' queries, packed request
    by request) over one layer's cache; returns ``[total_q, Hq, D]`` in q's dtype.

    Same semantics as :func:`flashdec.paged_extend_attention_ref`: ``query_lens [B]`` new tokens
    per request (each >= 1, summing to ``total_q``), whose K/V are already in the cache and
    counted in ``seq_lens [B]``; query ``i`` of request ``b`` is at position ``seq_lens[b] -
    query_lens[b] + i`` and attends to the positions up to its own — with ``window``, only the
    last ``window`` of them. With every query_len 1 it is :func:`flashdec.decode`'s attention.

    FP8 caches (``torch.float8_e4m3fn``, q fp16/bf16) need ``k_scale``/``v_scale``, a float or a
    float32 tensor ``[num_kv_heads]`` each, as for ``decode`` (pass tensors for CUDA graphs).

    With ``workspace`` (from :func:`~flashdec.kernels.extend_plan.plan_extend`) the call
    allocates nothing and never syncs with the host (CUDA-graph capturable): the output goes to
    ``out`` or ``workspace.out``, and the metadata's values are the caller's responsibility
    (``plan_extend``'s batch and total_q bound the call; its window and cache dtype must match).

    Without it, the lengths, the query lengths and the used block ids are checked on the device
    and read back in one small transfer, which also sizes the plan; what that read established is
    cached per unmodified metadata tensor, as for ``decode``.
    """
    dims, total_q = check_paged_extend_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_lens, kv_layout
    )
    check_kernel_device("q", q)
    if window is not None:
        check_window(window)
    kv_dtype = k_cache.dtype
    k_scale, v_scale, scale, out = _check_call_arguments(
        q, kv_dtype, k_scale, v_scale, dims, sm_scale, out
    )

    if workspace is not None:
        if not isinstance(workspace, ExtendWorkspace):
            raise TypeError(f"workspace must be an ExtendWorkspace, got {type(workspace).__name__}")
        plan = workspace.plan
        _check_plan_matches(plan, dims, q, kv_dtype, kv_layout, window)
        if total_q > plan.total_q:
            raise ValueError(f"workspace was planned for total_q <= {plan.total_q}, got {total_q}")
        if out is None:
            out = workspace.out if total_q == plan.total_q else workspace.out[:total_q]
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
        counters = workspace.counters
    else:
        if dims.batch == 0:
            return torch.empty_like(q) if out is None else out
        plan = _validated_plan(
            q, kv_dtype, block_tables, seq_lens, query_lens, dims, total_q, kv_layout, window
        )
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        partial_out, partial_lse, counters = allocate_partials(plan)
    return launch_extend(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_lens,
        scale,
        plan,
        out,
        partial_out,
        partial_lse,
        counters,
        dims.batch,
        k_scale,
        v_scale,
    )


def _validated_plan(
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    dims: PagedDecodeDims,
    total_q: int,
    kv_layout: str,
    window: int | None,
) -> ExtendPlan:
    """The plan of an eager call, after the metadata's checks (cached per metadata)."""
    try:
        key = ("extend", metadata_key(block_tables), metadata_key(seq_lens))
        key += (metadata_key(query_lens), dims, total_q, kv_layout, q.dtype, kv_dtype, window)
    except RuntimeError:  # inference tensors have no version counter: never cached
        key = None
    if key is not None:
        plan = lookup(key, block_tables, seq_lens, query_lens)
        if plan is not None:
            return plan  # type: ignore[return-value]
    stats, queries = extend_metadata_stats(block_tables, seq_lens, query_lens, dims, window)
    check_query_len_stats(queries, total_q)
    check_paged_decode_stats(stats, dims)
    plan = _cached_plan(
        dims,
        total_q,
        _bucket(stats.max_len),
        _bucket(queries.max_len),
        q.dtype,
        q.device,
        kv_layout,
        window,
        kv_dtype,
    )
    if key is not None:
        remember(key, plan, block_tables, seq_lens, query_lens)
    return plan


_PLAN_CACHE: dict[tuple, ExtendPlan] = {}


def _cached_plan(
    dims: PagedDecodeDims,
    total_q: int,
    max_len: int,
    max_query_len: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_layout: str,
    window: int | None,
    kv_dtype: torch.dtype,
) -> ExtendPlan:
    key = (dims.batch, dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size)
    key += (total_q, max_len, max_query_len, dtype, device, kv_layout, window, kv_dtype)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if len(_PLAN_CACHE) >= 4096:
            _PLAN_CACHE.clear()
        plan = plan_extend(
            dims.batch,
            total_q,
            dims.num_q_heads,
            dims.num_kv_heads,
            dims.head_dim,
            dims.block_size,
            max_len,
            dtype,
            device,
            kv_layout,
            max_blocks_per_seq=max(1, math.ceil(max_len / dims.block_size)),
            max_query_len=min(max_query_len, total_q),
            window=window,
            kv_dtype=kv_dtype,
        )
        _PLAN_CACHE[key] = plan
    return plan


paged_extend_attention = extend
