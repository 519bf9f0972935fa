"""The host tier of automatic prefix caching: pinned CPU copies of one KV group's cached blocks
that the GPU pool evicted, keyed by the same chained block hashes, least recently used first.

When an allocation reclaims evictable cached blocks (``BlockAllocator``), the group's
:class:`~flashdec.cache.block_cache.BlockCache` forgets their hashes and hands them here:
:meth:`HostBlockPool.store` copies them down in one batched transfer
(:class:`~flashdec.cache.block_transfer.BlockTransfer`). A later prompt whose hash chain runs
on into this pool gets fresh GPU blocks filled by :meth:`load` (one batched copy up) instead of
recomputing them. A hash may be in both tiers: a block copied up stays here too, so evicting it
again costs no copy.

The pool is bounded: a full pool drops its least recently used entries to make room. A copy
that raises (down: the blocks are simply not kept; up: the caller recomputes the blocks) counts
in ``failed_down`` / ``failed_up`` and never leaves an entry whose bytes may be incomplete.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from flashdec.cache.block_hash import BlockHash
from flashdec.cache.block_transfer import BlockTransfer

log = logging.getLogger(__name__)


class HostBlockPool:
    """Pinned host copies of up to ``capacity_blocks`` evicted blocks of one group's ``kv``."""

    def __init__(self, kv: torch.Tensor, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a host pool needs at least one block, got {capacity_blocks}")
        block_shape = tuple(kv.view(torch.uint8).shape[i] for i in (0, 1, 3, 4, 5))
        self.capacity_blocks = capacity_blocks
        self.storage = torch.empty(
            (capacity_blocks, *block_shape),
            dtype=torch.uint8,
            pin_memory=kv.device.type == "cuda",
        )
        self.transfer = BlockTransfer(kv, self.storage)
        self._slot_of: dict[BlockHash, int] = {}  # least recently used first
        self._free = list(range(capacity_blocks - 1, -1, -1))  # lowest slots first
        self.blocks_down = 0
        self.blocks_up = 0
        self.dropped_blocks = 0  # LRU entries dropped to make room
        self.failed_down = 0
        self.failed_up = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slot_of

    @property
    def block_bytes(self) -> int:
        return self.transfer.block_bytes

    def store(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> int:
        """Keep copies of the GPU blocks ``block_ids`` (cached under ``hashes``), which the pool
        is about to reuse; returns how many were copied. A hash already here becomes the most
        recently used and costs no copy. Never raises an ``Exception``: a failed copy keeps
        nothing of its blocks (they will be recomputed) and is counted."""
        pairs: dict[BlockHash, int] = {}
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if block_hash in self._slot_of:
                self._touch(block_hash)
            else:
                pairs.setdefault(block_hash, block_id)
        if not pairs:
            return 0
        items = list(pairs.items())[-self.capacity_blocks :]  # more than fit: the newest
        slots = self._take(len(items))
        try:
            self.transfer.down([b for _, b in items], slots)
        except Exception as exc:  # the blocks are lost to the host tier, not to correctness
            self._free += slots
            self.failed_down += len(items)
            log.warning("host KV tier: copy of %d block(s) down failed (%s)", len(items), exc)
            return 0
        except BaseException:
            self._free += slots
            raise
        for (block_hash, _), slot in zip(items, slots, strict=True):
            self._slot_of[block_hash] = slot
        self.blocks_down += len(items)
        return len(items)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Make the entries of ``hashes`` that are here the most recently used."""
        for block_hash in hashes:
            if block_hash in self._slot_of:
                self._touch(block_hash)

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        """Fill GPU blocks ``block_ids`` from the copies of ``hashes``; the current stream's
        later work reads them. False when one of them is no longer here, or the copy raised an
        ``Exception`` (counted; those entries are dropped, since their bytes are in doubt):
        recompute the blocks then."""
        if not all(h in self._slot_of for h in hashes):
            return False
        slots = [self._slot_of[h] for h in hashes]
        order = sorted(range(len(slots)), key=slots.__getitem__)
        try:
            self.transfer.up([slots[i] for i in order], [block_ids[i] for i in order])
        except Exception as exc:
            self.failed_up += len(hashes)
            for block_hash in hashes:
                self._free.append(self._slot_of.pop(block_hash))
            log.warning("host KV tier: copy of %d block(s) up failed (%s)", len(hashes), exc)
            return False
        for block_hash in hashes:
            self._touch(block_hash)
        self.blocks_up += len(hashes)
        return True

    def _touch(self, block_hash: BlockHash) -> None:
        self._slot_of[block_hash] = self._slot_of.pop(block_hash)

    def _take(self, n: int) -> list[int]:
        """``n`` free slots (ascending), dropping least recently used entries for them."""
        while len(self._free) < n:
            oldest = next(iter(self._slot_of))
            self._free.append(self._slot_of.pop(oldest))
            self.dropped_blocks += 1
        taken = [self._free.pop() for _ in range(n)]
        taken.sort()
        return taken

    def stats(self) -> dict[str, Any]:
        """Counters of this group's host pool (copy times: the completed copies)."""
        transfer = self.transfer
        transfer.collect_timings()
        size = self.block_bytes
        return {
            "capacity_blocks": self.capacity_blocks,
            "cached_blocks": len(self._slot_of),
            "blocks_down": self.blocks_down,
            "blocks_up": self.blocks_up,
            "bytes_down": self.blocks_down * size,
            "bytes_up": self.blocks_up * size,
            "copy_down_s": transfer.seconds_down,
            "copy_up_s": transfer.seconds_up,
            "dropped_blocks": self.dropped_blocks,
            "failed_down": self.failed_down,
            "failed_up": self.failed_up,
        }

    def check_integrity(self, where: str = "") -> None:
        """RuntimeError unless every slot is either free or holds exactly one hash."""
        used = list(self._slot_of.values())
        if len(set(used)) != len(used) or set(used) & set(self._free):
            raise RuntimeError(f"{where}host KV pool: a slot is used twice")
        if len(used) + len(self._free) != self.capacity_blocks:
            raise RuntimeError(f"{where}host KV pool: slots leaked")


def host_capacities(groups: Sequence[Any], total_bytes: object, caching: bool) -> list[int]:
    """Host blocks per group (``LayerGroup`` s) for ``total_bytes`` of host tier, split in
    proportion to the groups' pool bytes; all 0 for 0. Checks the argument first: an int >= 0,
    only with prefix caching, and enough for one block in every group."""
    if isinstance(total_bytes, bool) or not isinstance(total_bytes, int):
        raise TypeError(f"host_kv_cache_bytes must be an int, got {type(total_bytes).__name__}")
    if total_bytes < 0:
        raise ValueError(f"host_kv_cache_bytes must be >= 0, got {total_bytes}")
    if total_bytes == 0:
        return [0] * len(groups)
    if not caching:
        raise ValueError("a host KV tier needs automatic prefix caching (enable_prefix_caching)")
    pool_bytes = [g.kv.numel() * g.kv.element_size() for g in groups]
    block_bytes = [b // g.spec.num_blocks for b, g in zip(pool_bytes, groups, strict=True)]
    share = [total_bytes * b // sum(pool_bytes) for b in pool_bytes]
    capacities = [s // b for s, b in zip(share, block_bytes, strict=True)]
    if min(capacities) < 1:
        need = max(b * sum(pool_bytes) // p for b, p in zip(block_bytes, pool_bytes, strict=True))
        raise ValueError(
            f"host_kv_cache_bytes={total_bytes} holds no whole KV block in some group "
            f"(at least {need} bytes)"
        )
    return capacities
