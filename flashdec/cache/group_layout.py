"""``PagedKVCache.layout``: per-group and per-layer reads of a cache's KV layer groups (SPEC
§8.2) — which group a layer belongs to, a group's layers, a layer's storage views, an FP8
group's scales, a group's free blocks and block-table width. Read-only, and one object per
cache: the groups, their layers and storage never change after construction (their pools do,
and are read live). The engine keeps what it needs from here at construction, so none of these
reads is on a step's per-layer path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashdec.cache.device_tables import DeviceTables
from flashdec.cache.layer_group import LayerGroup


class GroupLayout:
    """The KV layer groups of one :class:`~flashdec.cache.PagedKVCache`, read per group."""

    def __init__(
        self,
        groups: Sequence[LayerGroup],
        layer_group: tuple[int, ...],
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        tables: DeviceTables,
    ) -> None:
        self._groups = groups
        self._layer_group = layer_group
        self._layers = layers
        self._tables = tables  # group 0's device tables (the groups hand out rows in lockstep)

    def _group(self, group: object) -> LayerGroup:
        """``group`` checked (TypeError / ValueError), as its :class:`LayerGroup`."""
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"group must be an int, got {type(group).__name__}")
        if not 0 <= group < len(self._groups):
            raise ValueError(f"group must be in [0, {len(self._groups)}), got {group}")
        return self._groups[group]

    def _layer(self, layer_idx: object) -> int:
        """``layer_idx`` checked (TypeError / ValueError)."""
        num_layers = len(self._layer_group)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if not 0 <= layer_idx < num_layers:
            raise ValueError(f"layer_idx must be in [0, {num_layers}), got {layer_idx}")
        return layer_idx

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def layer_group(self, layer_idx: int) -> int:
        """The group of global layer ``layer_idx``."""
        return self._layer_group[self._layer(layer_idx)]

    def group_layers(self, group: int) -> tuple[int, ...]:
        """The global layer ids of ``group``, ascending."""
        return self._group(group).layers

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, Hkv, block_size, D]`` of one layer's K and V (in its group)."""
        return self._layers[self._layer(layer_idx)]

    def group_free_blocks(self, group: int) -> int:
        return self._group(group).allocator.num_free

    def group_max_blocks_per_seq(self, group: int) -> int:
        return self._group(group).width

    def group_kv_scales(self, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_scales, v_scales)`` float32 ``[layers_in_group, Hkv]`` of an FP8 group, row ``i``
        for the group's ``i``-th layer (the cache's own tensors: read, never write; see
        ``PagedKVCache.set_kv_scales``), None for a float group."""
        g = self._group(group)
        return None if g.k_scales is None else (g.k_scales, g.v_scales)

    def layer_kv_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_scale, v_scale)`` float32 ``[Hkv]`` of one layer of an FP8 group: contiguous
        views of the cache's scales with fixed addresses (kernels and CUDA graphs bind them;
        read, never write), None for a float group."""
        layer_idx = self._layer(layer_idx)
        g = self._groups[self.layer_group(layer_idx)]
        return None if g.layer_scales is None else g.layer_scales[g.local_layer[layer_idx]]

    @property
    def num_request_slots(self) -> int:
        """Upper bound (exclusive) of ``TransactionSlots.request_slots`` values; it grows (by
        doubling) when more requests are active at once than ever before."""
        return self._tables.num_rows
