"""Read-only layout queries of a :class:`~flashdec.cache.PagedKVCache`: its KV groups, their
geometry and storage, and which group each layer belongs to. A mixin of the facade: it reads
the state the constructor set (``_groups``, ``_specs``, ``_layers``, ...) and changes nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from flashdec.cache.kv_spec import KVGroupSpec, format_kv_spec
from flashdec.cache.layer_group import LayerGroup


class LayoutQueries:
    """Geometry and per-group reads (see :class:`~flashdec.cache.PagedKVCache`)."""

    # ---- geometry and simple queries -----------------------------------------------------
    def _uniform(self, name: str) -> Any:
        """A geometry attribute every group shares, else a RuntimeError pointing at groups."""
        values = {getattr(group, name) for group in self._groups}
        if len(values) != 1:
            raise RuntimeError(
                f"{name} differs between this cache's KV groups ({format_kv_spec(self._specs)}); "
                "read it per group from kv_groups"
            )
        return values.pop()

    @property
    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        """The layer groups, in group order."""
        return self._specs

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def _check_group(self, group: object) -> LayerGroup:
        if isinstance(group, bool) or not isinstance(group, int):
            raise TypeError(f"group must be an int, got {type(group).__name__}")
        if not 0 <= group < len(self._groups):
            raise ValueError(f"group must be in [0, {len(self._groups)}), got {group}")
        return self._groups[group]

    def layer_group(self, layer_idx: int) -> int:
        """The group of global layer ``layer_idx``."""
        return self._layer_group[self._check_layer_index(layer_idx)]

    def group_layers(self, group: int) -> tuple[int, ...]:
        """The global layer ids of ``group``, ascending."""
        return self._check_group(group).layers

    def group_kv(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage of ``group``: ``[layers_in_group, num_blocks, Hkv, bs, D]`` each."""
        g = self._check_group(group)
        return g.k, g.v

    def group_free_blocks(self, group: int) -> int:
        return self._check_group(group).allocator.num_free

    def group_max_blocks_per_seq(self, group: int) -> int:
        return self._check_group(group).width

    def group_kv_scales(self, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_scale, v_scale)`` float32 ``[Hkv]`` of an FP8 group (the cache's own tensors:
        read, never write), None for a float group. Fixed per-head scales, not calibrated."""
        g = self._check_group(group)
        return None if g.k_scale is None else (g.k_scale, g.v_scale)

    @property
    def k_cache(self) -> torch.Tensor:
        """K storage ``[num_layers, max_blocks, Hkv, bs, D]`` of a single-group cache."""
        return self._single_storage("k_cache").k

    @property
    def v_cache(self) -> torch.Tensor:
        return self._single_storage("v_cache").v

    def _single_storage(self, name: str) -> LayerGroup:
        if not self._single:
            raise RuntimeError(
                f"{name} exists only for a single-group cache; this one has "
                f"{len(self._groups)} KV groups: use group_kv(g) or layer_kv(layer)"
            )
        return self._groups[0]

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._uniform("num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self._uniform("head_dim")

    @property
    def block_size(self) -> int:
        return self._uniform("block_size")

    @property
    def max_blocks(self) -> int:
        """Blocks in the pool (summed over groups)."""
        return sum(g.spec.num_blocks for g in self._groups)

    @property
    def num_blocks(self) -> int:
        return self.max_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self._uniform("width")

    @property
    def prefix_cache_capacity_blocks(self) -> int:
        return self._prefixes.capacity_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self._uniform("dtype")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers (single-group caches; see
        ``KVGroupSpec.block_bytes`` per group)."""
        return self._single_storage("bytes_per_block").spec.block_bytes

    @property
    def num_request_slots(self) -> int:
        """Upper bound (exclusive) of ``TransactionSlots.request_slots`` values; it grows (by
        doubling) when more requests are active at once than ever before."""
        return self._tables.num_rows

    @property
    def version(self) -> int:
        """Bumps on every successful change of lengths, ownership, lifecycle or transactions."""
        return self._version

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (summed over groups)."""
        if self._single:
            return self._allocator.num_free
        return sum(g.allocator.num_free for g in self._groups)

    @property
    def open_transaction_id(self) -> int | None:
        tx = self._tx.open
        return None if tx is None else tx.transaction_id

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, Hkv, block_size, D]`` of one layer's K and V (in its group)."""
        return self._layers[self._check_layer_index(layer_idx)]

    # ---- argument helpers ----------------------------------------------------------------
    def _check_layer_index(self, layer_idx: object) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx must be in [0, {self._num_layers}), got {layer_idx}")
        return layer_idx
