"""One layer's decode attention as an engine step issues it: fused RoPE + KV append, then paged
decode, bound once per batch shape and launched for any layer of the step.

Every layer of a step launches the same kernels with the same metadata; only the layer's cache
views (and backup rows) and the caller's ``q, k, v`` and output change. Once both bound launches
have run, :class:`BoundLayerAttention` keeps each layer's pointers as ints and issues the kernels
through :class:`~flashdec.kernels._runtime.DirectLaunch` copies of their argument lists: a few
list writes, one stream lookup and one C call per kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashdec.kernels._runtime import current_stream, hooks_active
from flashdec.kernels.append import BoundFusedRopeKVAppend
from flashdec.kernels.decode_plan import DecodePlan
from flashdec.kernels.paged_decode import BoundDecode

# per layer: its K and V cache views, its backup rows (or None) and its FP8 scales (or Nones)
LayerCaches = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]


class BoundLayerAttention:
    """RoPE + append into layer ``i``'s cache, then decode over it, for any ``i`` of a step.

    ``layers[i] = (k_cache, v_cache, backup, k_scale, v_scale)``: the layer's views; when the
    transaction's writers save the old slot bytes, its K backup rows ``[rows * Hkv, D]`` (V rows
    ``backup_v`` elements further on; None for every layer otherwise); an FP8 layer's own scales
    (float32 ``[Hkv]``, None for float caches). A call takes ``q, k, v`` with the
    dtypes and strides of the ones bound and ``out`` like the one bound; the rotated q goes to
    ``q_rot`` (fixed), the attention output to ``out``.
    """

    __slots__ = ("_append", "_decode", "_direct", "_layers", "q_rot")

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layers: Sequence[LayerCaches],
        block_ids: torch.Tensor,
        offsets: torch.Tensor,
        positions: torch.Tensor,
        rotary_dim: int,
        base: float,
        inv_freq: torch.Tensor | None,
        q_rot: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
        plan: DecodePlan,
        out: torch.Tensor,
        partial_out: torch.Tensor,
        partial_lse: torch.Tensor,
        batch: int,
        counters: torch.Tensor | None = None,
        backup_v: int = 0,
    ) -> None:
        k0, v0, backup0, k_scale, v_scale = layers[0]
        self._append = BoundFusedRopeKVAppend(
            q,
            k,
            v,
            k0,
            v0,
            block_ids,
            offsets,
            positions,
            rotary_dim,
            base,
            q_rot,
            inv_freq,
            k_scale,
            v_scale,
            backup0,
            backup_v,
        )
        self._decode = BoundDecode(
            q_rot,
            k0,
            v0,
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
        self.q_rot = q_rot
        self._layers = tuple(layers)
        # (append, decode, merge or None, per-layer (k, v, backup, k_scale, v_scale) pointers,
        # 0 for None) once both ran;
        # False for a binding that cannot take the direct path (misaligned)
        self._direct: tuple | bool | None = None

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        direct = self._direct
        if direct and not hooks_active():
            q_ptr, k_ptr, v_ptr, out_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
            if not (q_ptr | k_ptr | v_ptr | out_ptr) & 15:  # bound 16-byte aligned, like these
                append, decode, merge, pointers = direct
                k_cache, v_cache, backup, k_scale, v_scale = pointers[layer]
                args = append.args
                args[0], args[1], args[2], args[3], args[4] = q_ptr, k_ptr, v_ptr, k_cache, v_cache
                if backup:
                    args[BoundFusedRopeKVAppend.BACKUP] = backup
                if k_scale:
                    args[BoundFusedRopeKVAppend.K_SCALE] = k_scale
                    args[BoundFusedRopeKVAppend.V_SCALE] = v_scale
                args = decode.args
                args[1], args[2], args[5] = k_cache, v_cache, out_ptr
                if k_scale:
                    args[BoundDecode.K_SCALE], args[BoundDecode.V_SCALE] = k_scale, v_scale
                if self._decode.single:  # out stands in for the partial buffers
                    args[6] = args[7] = out_ptr
                stream = current_stream(append.device)
                append.issue(stream)
                decode.issue(stream)
                if merge is not None:
                    merge.args[3] = out_ptr
                    merge.issue(stream)
                return
        self._slow(layer, q, k, v, out)

    def _slow(self, layer: int, q, k, v, out) -> None:
        """Through the bound launches (Triton's path when needed); makes the direct copies."""
        k_cache, v_cache, backup, k_scale, v_scale = self._layers[layer]
        self._append(q, k, v, k_cache, v_cache, self.q_rot, backup, k_scale, v_scale)
        self._decode(self.q_rot, k_cache, v_cache, out, k_scale, v_scale)
        if self._direct is None:
            self._direct = self._make_direct()

    def _make_direct(self) -> tuple | bool | None:
        append, decode, merge = self._append.launch, self._decode.decode, self._decode.merge
        direct = (append.direct(), decode.direct(), None if merge is None else merge.direct())
        if direct[0] is None or direct[1] is None or (merge is not None and direct[2] is None):
            return None  # not on the direct path (interpreter, hooks, scratch buffers)
        aligned = (*append.aligned, *decode.aligned, *(() if merge is None else merge.aligned))
        pointers = tuple(
            tuple(0 if t is None else t.data_ptr() for t in layer) for layer in self._layers
        )
        if not all(aligned) or any(ptr & 15 for row in pointers for ptr in row):
            return False  # a misaligned binding keeps the bound launches' path
        return (*direct, pointers)
