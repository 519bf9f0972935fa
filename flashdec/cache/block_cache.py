"""One KV group's automatic prefix cache: full blocks indexed by their chained hash.

A cached block is owned by :data:`~flashdec.cache.allocator.CACHED` and reference-counted by
the active requests whose block run starts with it (their *shared* blocks: immutable, like a
registered prefix's). A block whose count drops to 0 stays resident and indexed, parked in the
allocator as evictable: the allocator reclaims it, least recently parked first, only when an
allocation needs it, and tells this index (``_evicted``) to forget its hash; with a host tier
(:class:`~flashdec.cache.host_tier.HostBlockPool`) the block is copied down first. A hit takes
a parked block back (``acquire``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from flashdec.cache.allocator import CACHED, BlockAllocator
from flashdec.cache.block_hash import BlockHash
from flashdec.cache.host_tier import HostBlockPool


class BlockCache:
    """Hash -> block index, reference counts and eviction bookkeeping of one pool."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self._allocator = allocator
        allocator.on_evict = self._evicted
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._refs: dict[int, int] = {}
        self.num_refs = 0  # references over all cached blocks (a block held twice counts 2)
        self.num_evicted = 0
        # while a token transaction is open: (block, hash) of each block it evicted, oldest first
        self._journal: list[tuple[int, BlockHash]] | None = None
        # the host tier: where evicted blocks are copied down (None: they are dropped)
        self.host: HostBlockPool | None = None

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_referenced(self) -> int:
        """Cached blocks some active request holds (the rest are evictable)."""
        return len(self._block_of) - self._allocator.num_evictable

    @property
    def num_extra_refs(self) -> int:
        """References beyond the first to each held block: what per-request block counts
        count more than once."""
        return self.num_refs - self.num_referenced

    def block(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def is_held(self, block_hash: BlockHash) -> bool:
        """Whether the block cached under ``block_hash`` is held by some active request."""
        block_id = self._block_of.get(block_hash)
        return block_id is not None and self._refs[block_id] > 0

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_of

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, are cached."""
        n = 0
        for h in hashes:
            if h not in self._block_of:
                break
            n += 1
        return n

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more reference to each (a parked block leaves the evictable set)."""
        refs, allocator = self._refs, self._allocator
        for block_id in block_ids:
            count = refs[block_id]
            if count == 0:
                allocator.unpark(block_id)
            refs[block_id] = count + 1
        self.num_refs += len(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        """One reference less to each; a block nobody holds becomes evictable (most recent)."""
        refs, allocator = self._refs, self._allocator
        for block_id in block_ids:
            count = refs[block_id] - 1
            if count < 0:
                raise RuntimeError(f"cached block {block_id} has no reference to drop")
            refs[block_id] = count
            self.num_refs -= 1
            if count == 0:
                allocator.park(block_id)

    def adopt(self, block_id: int, block_hash: BlockHash, owner: Hashable, held: bool) -> bool:
        """Index ``owner``'s full block under ``block_hash``: it becomes a cached block, held
        by its request (``held``) or evictable. False (nothing changes) when the hash is
        already cached in another block."""
        if block_hash in self._block_of:
            return False
        self._allocator.transfer(block_id, owner, CACHED)
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._refs[block_id] = 1 if held else 0
        self.num_refs += held
        if not held:
            self._allocator.park(block_id)
        return True

    def _evicted(self, block_ids: list[int]) -> None:
        """The allocator reclaimed ``block_ids`` (about to be reused): forget their hashes,
        and let the host tier, if any, copy them down first."""
        hashes = []
        for block_id in block_ids:
            block_hash = self._hash_of.pop(block_id)
            del self._block_of[block_hash]
            del self._refs[block_id]
            hashes.append(block_hash)
            if self._journal is not None:
                self._journal.append((block_id, block_hash))
        self.num_evicted += len(block_ids)
        if self.host is not None:
            self.host.store(block_ids, hashes)

    def open_journal(self) -> None:
        """A token transaction starts: remember what its allocations evict."""
        self._journal = []

    def close_journal(self, bytes_restored: bool) -> None:
        """The transaction ended (committed, aborted, or failed to begin). Each block it
        evicted that is free again — an abort, a failed begin, or a partial commit gave it
        back — is cached again under its hash, evictable and as least recently used as
        before, when ``bytes_restored``: the transaction put back every slot it wrote, so the
        block holds the cached K/V again. So an aborted step loses no cached block. Otherwise
        (a cache with ``restore_on_abort=False``, a failed single-layer append) the bytes may
        have changed and the blocks stay evicted."""
        journal, self._journal = self._journal, None
        if not journal or not bytes_restored:
            return
        allocator = self._allocator
        back = [
            (b, h) for b, h in journal if allocator.owner_of(b) is None and h not in self._block_of
        ]
        if not back:
            return
        allocator.restore_evicted([b for b, _ in back])
        for block_id, block_hash in back:
            self._block_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash
            self._refs[block_id] = 0
        self.num_evicted -= len(back)

    def check_integrity(self, held: Counter, where: str = "") -> None:
        """RuntimeError unless every indexed block is owned by CACHED, its count equals the
        active requests holding it (``held``), and exactly the unheld ones are evictable."""
        allocator = self._allocator
        for block_id, count in self._refs.items():
            if allocator.owner_of(block_id) != CACHED:
                raise RuntimeError(f"{where}cached block {block_id} is not owned by the cache")
            if count != held.get(block_id, 0):
                raise RuntimeError(
                    f"{where}cached block {block_id} counts {count} references, "
                    f"{held.get(block_id, 0)} active request(s) hold it"
                )
            if (count == 0) != allocator.is_evictable(block_id):
                raise RuntimeError(f"{where}cached block {block_id}: evictable iff unheld broken")
        for block_id in held:
            if block_id not in self._refs:
                raise RuntimeError(f"{where}requests hold block {block_id}, not in the cache")
        if allocator.num_evictable != sum(1 for c in self._refs.values() if c == 0):
            raise RuntimeError(f"{where}the allocator parks blocks the cache does not index")
        if self.num_refs != sum(self._refs.values()):
            raise RuntimeError(f"{where}cached reference total {self.num_refs} is stale")
        if len(self._block_of) != len(self._hash_of):
            raise RuntimeError(f"{where}the hash index and its inverse disagree")
