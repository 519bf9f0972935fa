"""StepAttention: how one layer's attention runs inside an open step, in its KV layer group.

The engine decides *which* step is open and *whether* a layer may run (lifecycle, order, CUDA
graph capture); this class runs it: RoPE + append of the layer's new tokens through the cache,
then paged decode (one token per request) or extend (n tokens, each over its context and the new
tokens before it), with the engine's backends. Per group it keeps what follows the group's
geometry (RoPE and the softmax scale follow its head_dim; its window), per layer its FP8
scales; per step it keeps each group's plan, workspace and bound launch on the
:class:`OpenStep`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashdec._checks import FLOAT_DTYPES, check_tensor, resolve_sm_scale
from flashdec.cache import PagedKVCache
from flashdec.engine.decode_state import DecodeState, plan_bucket
from flashdec.engine.layer_ops import (
    Rope,
    check_step_inputs,
    extend_attention,
    extend_workspace,
    torch_paged_decode,
    write_plain_layer,
    write_rope_layer,
)
from flashdec.engine.step import OpenStep
from flashdec.engine.verify_state import VerifySlots, verify_plan
from flashdec.kernels import BoundExtend, ExtendWorkspace, extend
from flashdec.kernels.append import BoundFusedRopeKVAppend
from flashdec.kernels.extend_plan import extend_plan_variants


class StepAttention:
    """A layer's RoPE + append and attention in an open step (see the module docstring)."""

    def __init__(
        self,
        cache: PagedKVCache,
        append_backend: str,
        decode_backend: str,
        dtype: torch.dtype,
        rotary_dim: int | None,
        rope_base: float,
        sm_scale: float | None,
        rope_inv_freq: torch.Tensor | None,
    ) -> None:
        specs = cache.kv_groups
        self.cache = cache
        self.append_backend = append_backend
        self.decode_backend = decode_backend
        self.dtype = dtype
        # per layer: its FP8 scales (cache-owned device views: fixed addresses) or Nones
        self.layer_scales = tuple(
            cache.layout.layer_kv_scales(i) or (None, None) for i in range(cache.num_layers)
        )
        # per group: RoPE and the softmax scale follow the group's head_dim
        self.ropes = tuple(
            Rope.build(spec.head_dim, rotary_dim, rope_base, rope_inv_freq, cache.device)
            for spec in specs
        )
        self.sm_scales = tuple(resolve_sm_scale(sm_scale, spec.head_dim) for spec in specs)
        self.windows = tuple(spec.window for spec in specs)
        self.fused_triton = (append_backend, decode_backend) == ("fused", "triton")
        self._layer_views = [cache.layout.layer_kv(i) for i in range(cache.num_layers)]
        self._num_groups = len(specs)
        layer_groups = [cache.layout.layer_group(i) for i in range(cache.num_layers)]
        # each layer's index inside its group (its row of the group's per-step outputs)
        self._layer_local = tuple(
            cache.layout.group_layers(g).index(i) for i, g in enumerate(layer_groups)
        )
        self._group_views = tuple(
            [self._layer_views[i] for i in cache.layout.group_layers(g)] for g in range(len(specs))
        )
        self._group_scales = tuple(
            [self.layer_scales[i] for i in cache.layout.group_layers(g)] for g in range(len(specs))
        )
        # per group: the decode plan reused while the layout holds
        self.decode_states: list[DecodeState | None] = [None] * len(specs)
        # fixed-shape extend steps: per (group, rows, n) their fixed metadata (never replaced:
        # graphs read it), and per group the last plan's workspace, reused while it fits
        self.verify_slots: dict[tuple[int, int, int], VerifySlots] = {}
        self.verify_workspaces: list[tuple[tuple, ExtendWorkspace] | None] = [None] * len(specs)
        # Tensor.get_device() of the cache's tensors (-1 on the CPU): a cheap per-layer check
        self._device_index = cache.device.index if cache.device.type == "cuda" else -1

    # ------------------------------------------------------------------ decode (one token)
    def decode_layer(self, step: OpenStep, layer_idx: int, g: int, q, k, v) -> torch.Tensor:
        """RoPE + append + decode of layer ``layer_idx`` (in group ``g``) of a decode step."""
        self.check_inputs(step, g, q, k, v)
        if self.fused_triton:
            return self._fast_layer(step, layer_idx, g, q, k, v)
        q_rot = self._write_rope(step, layer_idx, g, q, k, v)
        return self._decode(step, layer_idx, g, q_rot)

    def check_inputs(self, step: OpenStep, g: int, q, k, v, rows: int | None = None) -> None:
        """Checks of a layer's inputs in its group ``g`` (its Hkv, D; ``rows`` of them, default
        the step's rows); after the group's first layer only a comparison with that layer's
        shapes, dtype and device."""
        seen = step.shapes[g]
        try:  # the common case: the shapes, dtype and device of the group's first layer
            device = self._device_index
            if (
                seen is not None
                and q.shape == seen[0]
                and k.shape == seen[1]
                and v.shape == seen[1]
                and q.dtype is self.dtype
                and k.dtype is q.dtype
                and v.dtype is q.dtype
                and q.get_device() == device
                and k.get_device() == device
                and v.get_device() == device
            ):
                return
        except AttributeError:  # not tensors: the full check says what is wrong
            pass
        rows = step.num_rows if rows is None else rows
        q, k, v = check_step_inputs(self.cache, rows, q, k, v, g, self.dtype)
        if seen is not None and q.shape != seen[0]:
            where = "this step" if self._num_groups == 1 else f"KV group {g} in this step"
            raise ValueError(
                f"q has {q.shape[1]} heads but earlier layers of {where} had {seen[0][1]}"
            )
        step.shapes[g] = (q.shape, k.shape)

    def _fast_layer(self, step: OpenStep, layer_idx: int, g: int, q, k, v) -> torch.Tensor:
        """Fused RoPE + append and Triton decode bound once per group and batch shape (the
        common path): per layer only the layer's tensors are read, every other argument was
        bound once."""
        strides = (q.stride(), k.stride(), v.stride())
        bound = step.bound[g]
        if bound is None or bound[1] != strides:  # the group's first layer (or new strides)
            bound = step.bound[g] = self._bind(step, g, q, k, v, strides)
        launch, _, outs = bound
        local = self._layer_local[layer_idx]
        out = outs[local]
        self.cache.write_token_layer_with(
            step.transaction_id, layer_idx, lambda *_: launch(local, q, k, v, out)
        )
        return out

    def _bind(self, step: OpenStep, g: int, q, k, v, strides: tuple) -> tuple:
        """Group ``g``'s bound launch for the step (its plan, slots, window, backup), the
        strides it was bound to and its layers' outputs (one allocation per step and group)."""
        state = self._decode_state(step, g, q.shape[1])
        outs = step.layer_outputs[g]
        if not outs:
            outputs = step.outputs[g] = torch.empty(
                (len(self._group_views[g]), *q.shape), dtype=q.dtype, device=q.device
            )
            outs = step.layer_outputs[g] = outputs.unbind(0)
        backup = step.backups[g] if step.backups else None
        launch = state.bound(
            self.ropes[g],
            step.group_slots[g],
            self.sm_scales[g],
            q,
            k,
            v,
            self._group_views[g],
            self._group_scales[g],
            backup,
            outs[0],
        )
        return launch, strides, outs

    def _decode_state(self, step: OpenStep, g: int, num_heads: int) -> DecodeState:
        """Group ``g``'s decode plan and workspace for the step (the last one while it fits)."""
        state = step.decode[g]
        if state is None:
            state = self.decode_states[g]
            if state is None or not state.fits(self.cache, step.num_rows, num_heads, step.plan_len):
                state = self.decode_states[g] = DecodeState(
                    self.cache, step.num_rows, num_heads, step.plan_len, g, self.dtype
                )
            step.decode[g] = state
        return state

    def _decode(self, step: OpenStep, layer_idx: int, g: int, q_rot: torch.Tensor) -> torch.Tensor:
        """Decode of a layer whose RoPE + append is written (the unbound backends)."""
        k_layer, v_layer = self._layer_views[layer_idx]
        slots = step.group_slots[g]
        if self.decode_backend == "torch":
            return torch_paged_decode(
                q_rot,
                k_layer,
                v_layer,
                slots.block_tables,
                slots.seq_lens_after,
                step.max_len_after,
                self.sm_scales[g],
                self.windows[g],
                *self.layer_scales[layer_idx],
            )
        state = self._decode_state(step, g, q_rot.shape[1])
        # each layer's output outlives the shared workspace
        return state.decode(
            q_rot,
            k_layer,
            v_layer,
            slots,
            self.sm_scales[g],
            torch.empty_like(q_rot),
            *self.layer_scales[layer_idx],
        )

    def _write_rope(self, step: OpenStep, layer_idx: int, g: int, q, k, v) -> torch.Tensor:
        """RoPE + append of one layer through the cache with the append backend, unbound (the
        decode step's fast path binds its launches instead); returns the rotated q."""
        backend, rope = self.append_backend, self.ropes[g]
        k_scale, v_scale = self.layer_scales[layer_idx]
        return self.cache.write_token_layer_with(
            step.transaction_id,
            layer_idx,
            lambda k_layer, v_layer, slots: write_rope_layer(
                backend, rope, q, k, v, k_layer, v_layer, slots, None, k_scale, v_scale
            ),
        )

    # ------------------------------------------------------------------ extend (n tokens)
    def extend_layer(self, step: OpenStep, layer_idx: int, g: int, q, k, v) -> torch.Tensor:
        """RoPE + append of every new token of the layer, then each new token attends to its
        request's context and the new tokens up to itself.

        The group's first layer in the step is checked in full (its inputs, and the extend
        call's arguments by the public ``extend``); later layers read the same metadata, plan
        and geometry, so they compare their inputs with the first layer's and launch the
        trusted extend (as decode's bound launch does): a mixed step's host time is per layer.
        """
        if step.tokens_per_row:  # a fixed-shape step: its metadata sits in fixed buffers
            q, k, v = check_step_inputs(self.cache, step.num_tokens, q, k, v, g, self.dtype)
            return self._fixed_extend_layer(step, layer_idx, g, q, k, v)
        self.check_inputs(step, g, q, k, v, rows=step.num_tokens)
        strides = (q.stride(), k.stride(), v.stride())
        bound = step.bound[g]
        if bound is not None and bound[0] == strides:  # a later layer of the group
            _, append, attend, q_rot = bound
            k_layer, v_layer = self._layer_views[layer_idx]
            k_scale, v_scale = self.layer_scales[layer_idx]
            self.cache.write_token_layer_with(
                step.transaction_id,
                layer_idx,
                lambda *_: append(
                    q, k, v, k_layer, v_layer, q_rot, k_scale=k_scale, v_scale=v_scale
                ),
            )
            # each layer's output outlives the step's shared buffers
            return attend(q_rot, k_layer, v_layer, torch.empty_like(q_rot), k_scale, v_scale)
        slots = step.group_slots[g]
        q_rot = self._write_rope(step, layer_idx, g, q, k, v)
        k_layer, v_layer = self._layer_views[layer_idx]
        workspace = step.extend[g]
        if workspace is None and self.decode_backend == "triton":
            # planned once per step and group from the lengths the host knows: no read-back
            counts = [a - s for a, s in zip(step.seq_lens_after, step.positions, strict=True)]
            workspace = step.extend[g] = extend_workspace(
                self.cache, g, q_rot.shape[1], q_rot.dtype, counts, step.max_len_after
            )
        out = extend_attention(  # the public call checks every argument
            self.decode_backend,
            q_rot,
            k_layer,
            v_layer,
            slots.block_tables,
            slots.seq_lens_after,
            step.query_lens,
            self.sm_scales[g],
            self.windows[g],
            *self.layer_scales[layer_idx],
            workspace,
        )
        if self.fused_triton:  # later layers: the same metadata, plan and geometry, bound once
            step.bound[g] = (strides, *self._bind_extend(step, g, q, k, v, q_rot, out))
        return out

    def _bind_extend(self, step: OpenStep, g: int, q, k, v, q_rot, out) -> tuple:
        """Group ``g``'s bound fused append and extend for the step's later layers (bound over
        its first layer's views, which the calls replace), and the rotated-q buffer they
        share (one layer's q is attended before the next layer's append rewrites it)."""
        slots, rope, workspace = step.group_slots[g], self.ropes[g], step.extend[g]
        k0, v0 = self._group_views[g][0]
        k_scale, v_scale = self._group_scales[g][0]
        append = BoundFusedRopeKVAppend(
            q,
            k,
            v,
            k0,
            v0,
            slots.block_ids,
            slots.offsets,
            slots.positions,
            rope.rotary_dim,
            rope.base,
            q_rot,
            rope.inv_freq,
            k_scale,
            v_scale,
        )
        attend = BoundExtend(
            q_rot,
            k0,
            v0,
            slots.block_tables,
            slots.seq_lens_after,
            step.query_lens,
            self.sm_scales[g],
            workspace.plan,
            out,
            workspace.partial_out,
            workspace.partial_lse,
            workspace.counters,
            step.query_lens.shape[0],
            k_scale,
            v_scale,
        )
        return append, attend, q_rot

    def fixed_slots(self, g: int, num_rows: int, n: int) -> VerifySlots:
        """Group ``g``'s fixed metadata for steps of ``num_rows`` rows x ``n`` tokens (made once,
        then kept: a CUDA graph captured over such a step reads it)."""
        key = (g, num_rows, n)
        slots = self.verify_slots.get(key)
        if slots is None:
            slots = self.verify_slots[key] = VerifySlots(self.cache, g, num_rows, n)
        return slots

    def _fixed_extend_layer(self, step: OpenStep, layer_idx: int, g: int, q, k, v):
        """A fixed-shape step's layer: RoPE + append through the fixed metadata (padding rows
        are not stored), then extend with the plan of its length bucket (Triton: the
        capturable launch, no host read) or the torch reference over the live rows."""
        slots = step.group_slots[g]
        fixed = step.fixed[g]
        backend, rope = self.append_backend, self.ropes[g]
        k_scale, v_scale = self.layer_scales[layer_idx]
        q_rot = self.cache.write_token_layer_with(
            step.transaction_id,
            layer_idx,
            lambda k_layer, v_layer, _: write_rope_layer(
                backend, rope, q, k, v, k_layer, v_layer, slots, None, k_scale, v_scale
            ),
        )
        k_layer, v_layer = self._layer_views[layer_idx]
        options = (self.sm_scales[g], self.windows[g], k_scale, v_scale)
        if self.decode_backend != "triton":  # the reference takes no padding row
            live, tokens = slots.batch, slots.num_tokens
            out = extend_attention(
                self.decode_backend,
                q_rot[:tokens],
                k_layer,
                v_layer,
                slots.block_tables[:live],
                slots.seq_lens_after[:live],
                fixed.query_lens[:live],
                *options,
            )
            return torch.cat([out, out.new_zeros((q_rot.shape[0] - tokens, *out.shape[1:]))])
        workspace = step.extend[g]
        if workspace is None:
            workspace = step.extend[g] = self._fixed_workspace(step, g, q_rot.shape[1])
        return extend_attention(
            "triton",
            q_rot,
            k_layer,
            v_layer,
            slots.block_tables,
            slots.seq_lens_after,
            fixed.query_lens,
            *options,
            workspace,
        )

    def _fixed_workspace(self, step: OpenStep, g: int, num_heads: int) -> ExtendWorkspace:
        """Group ``g``'s plan and workspace for a fixed-shape step, sized for the length bucket
        of ``step.plan_len`` (the last one while it fits: a graph's eager warm-up step and its
        capture share it)."""
        planned = plan_bucket(self.cache, step.plan_len)
        key = (step.num_rows, step.tokens_per_row, num_heads, planned)
        memo = self.verify_workspaces[g]
        if memo is None or memo[0] != key:
            plan = verify_plan(
                self.cache, g, step.num_rows, step.tokens_per_row, num_heads, planned, self.dtype
            )
            memo = self.verify_workspaces[g] = (key, ExtendWorkspace.allocate(plan))
        return memo[1]

    def build_extend_kernels(self, num_q_heads: int, max_batch: int) -> int:
        """Launch the Triton extend kernel once per variant its planner can choose for steps
        of up to ``max_batch`` requests, in every group, on a one-token problem over the
        group's first layer: after this (the warm start) no serving step waits for a compile.
        The metadata has the dtypes and alignment of a step's. Returns the launches made."""
        if self.decode_backend != "triton":
            return 0
        cache, device, launches = self.cache, self.cache.device, 0
        for g, spec in enumerate(cache.kv_groups):
            k_layer, v_layer = self._group_views[g][0]
            width = cache.layout.group_max_blocks_per_seq(g)
            plans = extend_plan_variants(
                max_batch,
                num_q_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                self.dtype,
                device,
                max_blocks_per_seq=width,
                window=spec.window,
                kv_dtype=spec.dtype,
            )
            for plan in plans:
                rows = plan.batch  # one token each, attending to itself in block 0
                ones = torch.ones(rows, dtype=torch.int64, device=device)
                extend(
                    torch.zeros(rows, num_q_heads, spec.head_dim, dtype=self.dtype, device=device),
                    k_layer,
                    v_layer,
                    torch.zeros(rows, width, dtype=torch.int64, device=device),
                    ones,
                    ones.to(torch.int32),
                    self.sm_scales[g],
                    window=spec.window,
                    k_scale=self._group_scales[g][0][0],
                    v_scale=self._group_scales[g][0][1],
                    workspace=ExtendWorkspace.allocate(plan),
                )
                launches += 1
        return launches

    # ------------------------------------------------------------------ prompt import
    def import_layer(self, step: OpenStep, layer_idx: int, g: int, k, v) -> None:
        """Store one layer's caller-built prompt ``k, v [tokens, Hkv, D]`` (already rotated) in
        the step's reserved slots."""
        cache = self.cache
        spec = cache.kv_groups[g]
        rows = step.num_tokens
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=cache.device)
            if tuple(t.shape) != (rows, spec.num_kv_heads, spec.head_dim):
                raise ValueError(
                    f"{name} must have shape {(rows, spec.num_kv_heads, spec.head_dim)}, "
                    f"got {tuple(t.shape)}"
                )
        backend = "torch" if self.append_backend == "torch" else "triton"
        k_scale, v_scale = self.layer_scales[layer_idx]
        cache.write_token_layer_with(
            step.transaction_id,
            layer_idx,
            lambda k_layer, v_layer, slots: write_plain_layer(
                backend, k, v, k_layer, v_layer, slots, k_scale, v_scale
            ),
        )


def activation_dtype_of(specs: Sequence, dtype: object) -> torch.dtype:
    """The engine's q/k/v/output dtype: ``dtype`` checked against every group's storage."""
    fp8 = [g for g, spec in enumerate(specs) if spec.dtype == torch.float8_e4m3fn]
    if dtype is None:
        if fp8:
            raise ValueError(
                f"KV group {fp8[0]} stores float8_e4m3fn: pass activation_dtype=torch.float16 "
                "or torch.bfloat16 (the dtype of q, k, v and the attention output)"
            )
        dtype = specs[0].dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"activation_dtype must be a torch.dtype or None, got {dtype!r}")
    allowed = (torch.float16, torch.bfloat16) if fp8 else FLOAT_DTYPES
    if dtype not in allowed:
        raise ValueError(f"activation_dtype must be one of {allowed}, got {dtype}")
    for g, spec in enumerate(specs):
        if g not in fp8 and spec.dtype != dtype:
            raise ValueError(
                f"KV group {g} stores {spec.dtype} but activation_dtype is {dtype}: a float "
                "group's storage dtype must be the activation dtype"
            )
    return dtype
