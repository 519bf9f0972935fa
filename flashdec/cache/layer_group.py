"""One KV layer group of a :class:`~flashdec.cache.PagedKVCache`: its storage and block pool.

Layers with the same geometry (SPEC §8.2) share one storage tensor
``[2, layers_in_group, num_blocks, Hkv, block_size, D]`` (K then V), one block allocator, one
prefix registry, one device mirror of the block tables and one set of fixed-address slot buffers.
The request lifecycle and the transaction are the cache's; a group only holds the per-geometry
parts. FP8 groups carry K/V scales per layer and KV head: stored = value / scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashdec._blocks import window_block_bound
from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.block_cache import BlockCache
from flashdec.cache.device_tables import DeviceTables
from flashdec.cache.kv_spec import KVGroupSpec
from flashdec.cache.prefix_registry import PrefixRegistry

if TYPE_CHECKING:
    from flashdec.cache.part_types import WriterBackupBuffers

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn: quantization saturates there


class LayerGroup:
    """Storage, pool and tables of one group (``index`` in the cache, ``layers`` global ids)."""

    def __init__(
        self,
        index: int,
        spec: KVGroupSpec,
        layers: tuple[int, ...],
        width: int,
        device: torch.device,
        prefix_capacity: int,
    ) -> None:
        self.index = index
        self.spec = spec
        self.layers = layers  # global layer ids, ascending
        self.window = spec.window
        self.block_size = spec.block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.dtype = spec.dtype
        self.width = width  # block-table width of a request in this group
        shape = (
            spec.layer_count,
            spec.num_blocks,
            spec.num_kv_heads,
            spec.block_size,
            spec.head_dim,
        )
        # one allocation for K and V (zero-filled so never-written slots hold finite numbers):
        # the abort backup of a token's slots is then one gather over both
        self.kv = torch.zeros((2, *shape), dtype=spec.dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.layer_views = [(self.k[i], self.v[i]) for i in range(spec.layer_count)]
        # [2 * layers, blocks * Hkv * block_size, D]: K then V as rows of head_dim (bytes for
        # FP8, whose index_copy is not implemented everywhere); made once, like the layer views
        kv_rows = self.kv.view(torch.uint8) if spec.dtype == FP8_DTYPE else self.kv
        self.slot_rows = kv_rows.view(2 * spec.layer_count, -1, spec.head_dim)
        self._backups: dict[int, torch.Tensor] = {}  # one-token backups, per slot-row count
        self._writer_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.allocator = BlockAllocator(spec.num_blocks)
        self.prefixes = PrefixRegistry(self.allocator, prefix_capacity, spec.block_size)
        self.block_cache = BlockCache(self.allocator)  # automatic prefix caching (may stay empty)
        self.device = self.kv.device
        self.tables = DeviceTables(width, self.device)
        # the slot builders' SlotBuffers (flashdec.cache.slots), made for the first one-token batch
        self.slot_buffers: WriterBackupBuffers | None = None
        self.pending_updates: list[tuple[int, int, int]] = []  # device-table writes to flush
        self.local_layer = {layer: i for i, layer in enumerate(layers)}
        # FP8: K and V scales [layers, Hkv] (float32), each layer's row a contiguous [Hkv] view
        # whose address never changes (bound launches and CUDA graphs read it; values are
        # updated in place). Rows are padded to 16 bytes so every layer's view is as aligned
        # as the first (a kernel compiled for an aligned pointer serves every layer).
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        self.layer_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if spec.dtype == FP8_DTYPE:
            padded = -(-spec.num_kv_heads // 4) * 4
            rows = torch.ones(
                (2, spec.layer_count, padded), dtype=torch.float32, device=self.kv.device
            )
            self.k_scales = rows[0, :, : spec.num_kv_heads]
            self.v_scales = rows[1, :, : spec.num_kv_heads]
            self.layer_scales = [
                (self.k_scales[i], self.v_scales[i]) for i in range(spec.layer_count)
            ]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def block_bound(self) -> int | None:
        """Blocks a request can hold at most (window groups), else None."""
        return None if self.window is None else window_block_bound(self.block_size, self.window)

    def backup(self, slot_rows: torch.Tensor, fixed: bool) -> torch.Tensor:
        """The bytes now in ``slot_rows`` of every layer, ``[2 * layers, len(slot_rows), D]``
        (for an abort to put back). ``fixed``: into a buffer reused by every one-token
        transaction with as many rows (one transaction is open at a time, and its backup is
        read only by its own abort), so a step allocates nothing."""
        if not fixed:
            return self.slot_rows.index_select(1, slot_rows)
        count = slot_rows.shape[0]
        out = self._backups.get(count)
        if out is None:
            if len(self._backups) >= 8:
                self._backups.clear()
            rows = self.slot_rows
            out = self._backups[count] = rows.new_empty((rows.shape[0], count, rows.shape[2]))
        return torch.index_select(self.slot_rows, 1, slot_rows, out=out)

    def writer_backup(self, num_slot_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[2 * layers, num_slot_rows, D]`` rows of the slot buffers' writer backup (see
        :class:`~flashdec.cache.slots.SlotBuffers`): as bytes like ``slot_rows`` (for the
        restore) and in the group's dtype (for the writers). Fixed addresses per buffers; views
        made once per row count."""
        buffers = self.slot_buffers
        key = (buffers.generation, num_slot_rows)
        views = self._writer_views.get(key)
        if views is None:
            backup = buffers.writer_backup
            if backup is None:
                rows = self.slot_rows
                backup = buffers.writer_backup = rows.new_empty(
                    (rows.shape[0], buffers.capacity * self.num_kv_heads, rows.shape[2])
                )
            if len(self._writer_views) >= 16 or any(k[0] != key[0] for k in self._writer_views):
                self._writer_views.clear()
            part = backup[:, :num_slot_rows]
            views = self._writer_views[key] = (part, part.view(self.dtype))
        return views

    def restore(self, slot_rows: torch.Tensor, backup: torch.Tensor, layers: int) -> None:
        """Put the old bytes of ``slot_rows`` back from ``backup`` in the group's first
        ``layers`` layers (K and V)."""
        count = self.spec.layer_count
        if layers >= count:
            self.slot_rows.index_copy_(1, slot_rows, backup)
        elif layers > 0:
            for start in (0, count):  # K rows, then V rows
                part = slice(start, start + layers)
                self.slot_rows[part].index_copy_(1, slot_rows, backup[part])

    def quantize(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K/V rows ``[T, Hkv, D]`` of global layer ``layer_idx`` as this FP8 group
        stores them (with that layer's scales, saturating)."""

        def one(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            scaled = x.float() / scale.view(1, -1, 1)
            return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

        k_scale, v_scale = self.layer_scales[self.local_layer[layer_idx]]
        return one(k, k_scale), one(v, v_scale)
