"""A step's Triton decode plan and workspace, per KV layer group: the length bucket a plan is
sized for (:func:`plan_bucket`), the plan of a group (:func:`group_decode_plan`), what its
launches depend on (:func:`launch_key`, which the CUDA graphs are keyed by) and
:class:`DecodeState`, the plan + workspace every layer of a step shares, with its bound
RoPE + append + decode launches. The launchers are the trusted ones (see
:mod:`flashdec.engine.layer_ops`): the cache validated its own reservation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from flashdec.cache import PagedKVCache, TransactionSlots
from flashdec.engine.layer_ops import Rope
from flashdec.kernels import (
    BoundLayerAttention,
    DecodePlan,
    DecodeWorkspace,
    launch_decode,
    plan_decode,
)


def max_table_tokens(cache: PagedKVCache) -> int:
    """The most tokens every group's block table can hold (all groups' tables are sized for
    the same token limit)."""
    return min(
        cache.layout.group_max_blocks_per_seq(g) * spec.block_size
        for g, spec in enumerate(cache.kv_groups)
    )


def plan_bucket(cache: PagedKVCache, max_len: int, limit: int | None = None) -> int:
    """The length a step's decode plans are sized for: the next power of two of its longest
    request (capped at what the tables hold; ``limit`` passes that, once computed). One rule
    for when a plan is reused, in every group: while this value stays the same."""
    if limit is None:
        limit = max_table_tokens(cache)
    return max(min(1 << max(0, (max_len - 1).bit_length()), limit), max_len)


def group_decode_plan(
    cache: PagedKVCache,
    group: int,
    num_rows: int,
    num_q_heads: int,
    planned_len: int,
    dtype: torch.dtype,
) -> DecodePlan:
    """The decode plan of KV group ``group`` for ``num_rows`` requests of up to ``planned_len``
    tokens (a :func:`plan_bucket` value)."""
    spec = cache.kv_groups[group]
    return plan_decode(
        num_rows,
        num_q_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        planned_len,
        dtype,
        cache.device,
        max_blocks_per_seq=cache.layout.group_max_blocks_per_seq(group),
        window=spec.window,
        kv_dtype=spec.dtype,
    )


def launch_key(plan: DecodePlan) -> DecodePlan:
    """What a plan's launches depend on: the plan less the length it was sized for (and, in a
    single pass, less the split length and program count, which it does not read). Plans with
    equal keys launch the same kernels on the same grids (each request's range is read from the
    device lengths), so one CUDA graph serves both."""
    if plan.num_splits == 1:
        return replace(plan, max_seq_len=0, tokens_per_split=0, num_programs=0)
    return replace(plan, max_seq_len=0)


class DecodeState:
    """A Triton decode plan and its workspace, shared by every layer of a step (of one layer
    group: ``group``, whose geometry and sliding window the plan has).

    The plan is sized for :func:`plan_bucket` of the longest request, so one plan serves every
    step until the batch outgrows the bucket (the kernel derives each request's range from the
    device lengths, so a plan is correct for any length; the bucket only keeps the split count
    well chosen). Reused while the step has the same rows, head count and bucket.
    """

    __slots__ = (
        "_bound",
        "limit",
        "num_q_heads",
        "num_rows",
        "planned_len",
        "q_rot",
        "window",
        "workspace",
    )

    def __init__(
        self,
        cache: PagedKVCache,
        num_rows: int,
        num_q_heads: int,
        max_len: int,
        group: int = 0,
        dtype: torch.dtype | None = None,
    ):
        """``dtype``: q's and the output's (default: the group's storage dtype, which an FP8
        group must not use: its activations are fp16/bf16)."""
        spec = cache.kv_groups[group]
        dtype = spec.dtype if dtype is None else dtype
        self.limit = max_table_tokens(cache)
        planned = plan_bucket(cache, max_len, self.limit)
        self.window = spec.window
        plan = group_decode_plan(cache, group, num_rows, num_q_heads, planned, dtype)
        self.workspace = DecodeWorkspace.allocate(plan)
        self.num_rows = num_rows
        self.num_q_heads = num_q_heads
        self.planned_len = planned  # the bucket this plan serves
        # rotated q of the layer in flight: written by the fused append, read by decode
        self.q_rot = torch.empty(
            num_rows, num_q_heads, spec.head_dim, dtype=dtype, device=cache.device
        )
        self._bound: dict[tuple, tuple] = {}

    def fits(self, cache: PagedKVCache, num_rows: int, num_q_heads: int, max_len: int) -> bool:
        return (
            num_rows == self.num_rows
            and num_q_heads == self.num_q_heads
            and plan_bucket(cache, max_len, self.limit) == self.planned_len
        )

    def bound(
        self,
        rope: Rope,
        slots: TransactionSlots,
        sm_scale: float,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_views: Sequence[tuple[torch.Tensor, torch.Tensor]],
        layer_scales: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]],
        backup: torch.Tensor | None,
        out: torch.Tensor,
    ) -> BoundLayerAttention:
        """RoPE + append + decode of this plan for any layer of ``layer_views`` (the group's, in
        order, with its FP8 ``layer_scales``: the cache's fixed-address views, or Nones), bound
        to ``slots`` (fixed-address for a batch shape), to the transaction's writer ``backup``
        (``[2 * layers, rows, D]`` or None) and to these inputs' strides."""
        key = (
            id(slots),
            q.stride(),
            k.stride(),
            v.stride(),
            out.stride(),
            None if backup is None else backup.data_ptr(),
        )
        entry = self._bound.get(key)
        if entry is None:
            if len(self._bound) > 16:
                self._bound.clear()
            ws = self.workspace
            count = len(layer_views)
            # K backup rows of layer i at [i], its V rows one group of layers further on
            backups = [None] * count if backup is None else [backup[i] for i in range(count)]
            backup_v = 0 if backup is None else count * backup.stride(0)
            layers = [
                (kv[0], kv[1], saved, *scales)
                for kv, saved, scales in zip(layer_views, backups, layer_scales, strict=True)
            ]
            launch = BoundLayerAttention(
                q,
                k,
                v,
                layers,
                slots.block_ids,
                slots.offsets,
                slots.positions,
                rope.rotary_dim,
                rope.base,
                rope.inv_freq,
                self.q_rot,
                slots.block_tables,
                slots.seq_lens_after,
                sm_scale,
                ws.plan,
                out,
                ws.partial_out,
                ws.partial_lse,
                slots.num_rows,
                ws.counters,
                backup_v,
            )
            # slots and backup kept: their ids and addresses stay unique while bound
            entry = self._bound[key] = (launch, slots, backup)
        return entry[0]

    def decode(
        self,
        q: torch.Tensor,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        slots: TransactionSlots,
        sm_scale: float,
        out: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode of one layer (an FP8 layer with its own ``k_scale``/``v_scale``)."""
        ws = self.workspace
        return launch_decode(
            q,
            k_layer,
            v_layer,
            slots.block_tables,
            slots.seq_lens_after,
            sm_scale,
            ws.plan,
            out,
            ws.partial_out,
            ws.partial_lse,
            slots.num_rows,
            k_scale,
            v_scale,
            ws.counters,
        )
