"""Read-only whole-cache queries of a :class:`~flashdec.cache.PagedKVCache`: the constructor's
geometry read back (one value every group shares, else a RuntimeError pointing at the groups),
the single-group storage, free blocks and the version. A mixin of the facade: it reads the state
the constructor set (``_groups``, ``_specs``, ...) and changes nothing. Per-group reads are
``cache.layout`` (:mod:`flashdec.cache.group_layout`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashdec.cache.group_layout import GroupLayout
from flashdec.cache.kv_spec import KVGroupSpec, format_kv_spec
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.prefix_caching import PrefixCache
from flashdec.cache.step_access import StepAccess


class LayoutQueries:
    """Whole-cache geometry reads (see :class:`~flashdec.cache.PagedKVCache`)."""

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
    def layout(self) -> GroupLayout:
        """Per-group and per-layer reads (:class:`~flashdec.cache.group_layout.GroupLayout`)."""
        return self._layout

    @property
    def steps(self) -> StepAccess:
        """The engine's access to token transactions
        (:class:`~flashdec.cache.step_access.StepAccess`)."""
        return self._steps

    @property
    def prefix_cache(self) -> PrefixCache:
        """Automatic prefix caching, SPEC §8.7
        (:class:`~flashdec.cache.prefix_caching.PrefixCache`)."""
        return self._prefix_cache

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
                f"{len(self._groups)} KV groups: use layout.layer_kv(layer)"
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
    def version(self) -> int:
        """Bumps on every successful change of lengths, ownership, lifecycle or transactions."""
        return self._version

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (summed over groups)."""
        if self._single:
            return self._allocator.num_free
        return sum(g.allocator.num_free for g in self._groups)
