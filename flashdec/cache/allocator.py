"""Physical block allocator: a free list plus who owns each block, and the evictable blocks.

It knows nothing of requests, lengths or prefixes; an owner is any hashable tag the caller picks.
Allocation is all-or-nothing and every call checks its arguments before it changes anything.

Automatic prefix caching (``flashdec.cache.block_cache``) parks the cached blocks no request
holds here: they keep their owner (:data:`CACHED`) and their bytes, count as free, and are
reclaimed least-recently-parked first only when an allocation finds the free list short
(``on_evict`` tells the cache which blocks it lost, once per allocation). So ``num_free`` =
truly free + evictable, with no sweep and no capacity to tune.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

CACHED = ("cached",)  # the owner of every block of the automatic prefix cache


class BlockAllocator:
    """Hands out ids in ``[0, num_blocks)``; each id is free or owned by exactly one tag."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        # a stack: the lowest ids come out first on a fresh pool, released ids are reused first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: list[Hashable | None] = [None] * num_blocks
        # cached blocks no request holds, least recently parked first (dict order)
        self._evictable: dict[int, None] = {}
        self.on_evict: Callable[[list[int]], None] | None = None
        self.num_evicted = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: truly free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def _reclaim(self, n: int) -> None:
        """Evict least-recently-parked cached blocks until ``n`` are truly free (the caller
        checked that ``n <= num_free``)."""
        free, evictable, owner_of = self._free, self._evictable, self._owner
        evicted = []
        while len(free) < n:
            block_id = next(iter(evictable))
            del evictable[block_id]
            owner_of[block_id] = None
            free.append(block_id)
            evicted.append(block_id)
        self.num_evicted += len(evicted)
        if self.on_evict is not None:  # one call: the host tier copies them in one batch
            self.on_evict(evicted)

    def park(self, block_id: int) -> None:
        """A cached block no request holds any more: evictable, most recently used."""
        if self._owner[block_id] != CACHED or block_id in self._evictable:
            raise RuntimeError(f"block {block_id} is not a held cached block")
        self._evictable[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A request takes an evictable cached block again."""
        if block_id not in self._evictable:
            raise RuntimeError(f"block {block_id} is not evictable")
        del self._evictable[block_id]

    def restore_evicted(self, block_ids: Sequence[int]) -> None:
        """Undo the eviction of free ``block_ids`` (their step was taken back): cached again,
        evictable, least recently used first in the given order, ahead of every other."""
        back = set(block_ids)
        if any(self._owner[b] is not None for b in back):
            raise RuntimeError("only free blocks can be restored to the cache")
        self._free = [b for b in self._free if b not in back]
        for block_id in block_ids:
            self._owner[block_id] = CACHED
        self._evictable = dict.fromkeys([*block_ids, *self._evictable])
        self.num_evicted -= len(back)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def transfer(self, block_id: int, owner: Hashable, new_owner: Hashable) -> None:
        """Hand an allocated block from ``owner`` to ``new_owner``."""
        if self._owner[block_id] != owner:
            raise RuntimeError(
                f"block {block_id} is owned by {self._owner[block_id]!r}, not by {owner!r}"
            )
        self._owner[block_id] = new_owner

    def allocate(self, n: int, owner: Hashable) -> list[int]:
        """Take ``n`` free blocks for ``owner``; RuntimeError (nothing taken) if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if owner is None:
            raise ValueError("owner must not be None (None marks a free block)")
        if n > len(self._free):
            if n > self.num_free:
                raise RuntimeError(
                    f"out of KV blocks: {n} requested, {self.num_free} of {self._num_blocks} free"
                )
            self._reclaim(n)
        taken = [self._free.pop() for _ in range(n)]
        for block_id in taken:
            self._owner[block_id] = owner
        return taken

    def allocate_each(self, owners: Sequence[Hashable]) -> list[int]:
        """One free block for each of ``owners`` (a batch's new blocks at a block boundary, in
        one call); RuntimeError (nothing taken) if fewer are free."""
        n = len(owners)
        if n > self.num_free:
            raise RuntimeError(
                f"out of KV blocks: {n} requested, {self.num_free} of {self._num_blocks} free"
            )
        if None in owners:
            raise ValueError("owner must not be None (None marks a free block)")
        if n > len(self._free):
            self._reclaim(n)
        free, owner_of = self._free, self._owner
        taken = free[len(free) - n :][::-1]  # the same order n pops would give
        del free[len(free) - n :]
        for block_id, owner in zip(taken, owners, strict=True):
            owner_of[block_id] = owner
        return taken

    def release(self, block_ids: Iterable[int], owner: Hashable | None = None) -> None:
        """Return blocks to the free list; all must be allocated (to ``owner`` when given)."""
        ids = list(block_ids)
        seen: set[int] = set()
        for block_id in ids:
            if isinstance(block_id, bool) or not isinstance(block_id, int):
                raise TypeError(f"block ids must be ints, got {type(block_id).__name__}")
            if not 0 <= block_id < self._num_blocks:
                raise ValueError(f"block id {block_id} outside [0, {self._num_blocks})")
            if block_id in seen:
                raise ValueError(f"block id {block_id} listed twice in one release")
            seen.add(block_id)
            current = self._owner[block_id]
            if current is None:
                raise RuntimeError(f"block {block_id} is already free")
            if owner is not None and current != owner:
                raise RuntimeError(f"block {block_id} is owned by {current!r}, not by {owner!r}")
            if block_id in self._evictable:
                raise RuntimeError(f"block {block_id} is an evictable cached block")
        for block_id in ids:
            self._owner[block_id] = None
            self._free.append(block_id)

    def owner_of(self, block_id: int) -> Hashable | None:
        """The tag owning ``block_id``, or None when it is free."""
        return self._owner[block_id]

    def owned_blocks(self) -> dict[Hashable, list[int]]:
        """Every owner with its blocks (ascending ids); O(num_blocks)."""
        result: dict[Hashable, list[int]] = {}
        for block_id, owner in enumerate(self._owner):
            if owner is not None:
                result.setdefault(owner, []).append(block_id)
        return result

    def check_integrity(self) -> None:
        """RuntimeError unless the free list and the owner table describe the same partition."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("allocator free list holds a block twice")
        for block_id, owner in enumerate(self._owner):
            if (owner is None) != (block_id in free):
                state = "free" if block_id in free else "not free"
                raise RuntimeError(
                    f"allocator block {block_id} is {state} but its owner is {owner!r}"
                )
        for block_id in self._evictable:
            if self._owner[block_id] != CACHED:
                raise RuntimeError(
                    f"evictable block {block_id} is owned by {self._owner[block_id]!r}"
                )
