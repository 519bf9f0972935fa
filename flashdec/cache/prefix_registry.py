"""Shared prefixes: immutable full blocks held by the registry and referenced by requests.

The registry owns the prefix blocks it takes from the allocator (owner tag ``("prefix", pid)``),
counts references, and keeps a block budget. When a new prefix does not fit, inactive prefixes
(refcount 0) are evicted least-recently-used first; the plan is made before anything changes,
so a prefix that still does not fit leaves the registry and the allocator untouched.
Copying the K/V bytes is the façade's job: the registry only moves ownership.
"""

from __future__ import annotations

from collections.abc import Mapping

from flashdec.cache.allocator import BlockAllocator
from flashdec.cache.state import PrefixId, PrefixState


def prefix_owner(prefix_id: PrefixId) -> tuple[str, PrefixId]:
    return ("prefix", prefix_id)


class _Prefix:
    __slots__ = ("block_ids", "last_used", "refcount")

    def __init__(self, block_ids: tuple[int, ...], clock: int) -> None:
        self.block_ids = block_ids
        self.refcount = 0
        self.last_used = clock


class PrefixRegistry:
    """Resident prefixes, their refcounts and the LRU budget (capacity 0 = feature off)."""

    def __init__(self, allocator: BlockAllocator, capacity_blocks: int, block_size: int) -> None:
        self._allocator = allocator
        self._capacity = capacity_blocks
        self._block_size = block_size
        self._prefixes: dict[PrefixId, _Prefix] = {}  # insertion order = registration order
        self._clock = 0  # logical time for LRU; bumped on register/attach/detach
        self._num_blocks = 0
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def num_blocks(self) -> int:
        """Blocks held by resident prefixes."""
        return self._num_blocks

    def __len__(self) -> int:
        return len(self._prefixes)

    def __contains__(self, prefix_id: object) -> bool:
        return prefix_id in self._prefixes

    def ids(self) -> list[PrefixId]:
        return list(self._prefixes)

    def block_ids(self, prefix_id: PrefixId) -> tuple[int, ...]:
        return self._get(prefix_id).block_ids

    def refcount(self, prefix_id: PrefixId) -> int:
        return self._get(prefix_id).refcount

    def refcount_total(self) -> int:
        return sum(p.refcount for p in self._prefixes.values())

    def state(self, prefix_id: PrefixId) -> PrefixState:
        entry = self._get(prefix_id)
        return PrefixState(
            prefix_id=prefix_id,
            num_blocks=len(entry.block_ids),
            num_tokens=len(entry.block_ids) * self._block_size,
            block_ids=entry.block_ids,
            refcount=entry.refcount,
            last_used=entry.last_used,
        )

    def _get(self, prefix_id: PrefixId) -> _Prefix:
        entry = self._prefixes.get(prefix_id)
        if entry is None:
            raise ValueError(f"unknown prefix id {prefix_id!r}; resident: {self.ids()}")
        return entry

    # ---- mutations -----------------------------------------------------------------------
    def plan_register(self, prefix_id: PrefixId, num_blocks: int) -> list[PrefixId]:
        """Prefixes to evict (LRU order) so ``num_blocks`` fit; raises and changes nothing else."""
        if not self.enabled:
            raise RuntimeError(
                "the shared-prefix cache is off (prefix_cache_capacity_blocks=0); "
                "construct the cache with prefix_cache_capacity_blocks > 0"
            )
        if prefix_id in self._prefixes:
            raise ValueError(f"prefix {prefix_id!r} is already registered")
        if num_blocks > self._capacity:
            raise RuntimeError(
                f"prefix {prefix_id!r} needs {num_blocks} blocks, more than the prefix cache "
                f"capacity of {self._capacity}"
            )
        budget_free = self._capacity - self._num_blocks
        pool_free = self._allocator.num_free
        victims: list[PrefixId] = []
        inactive = sorted(
            (pid for pid, p in self._prefixes.items() if p.refcount == 0),
            key=lambda pid: self._prefixes[pid].last_used,
        )
        for pid in inactive:
            if num_blocks <= budget_free and num_blocks <= pool_free:
                break
            freed = len(self._prefixes[pid].block_ids)
            budget_free += freed
            pool_free += freed
            victims.append(pid)
        if num_blocks > budget_free or num_blocks > pool_free:
            raise RuntimeError(
                f"cannot register prefix {prefix_id!r} ({num_blocks} blocks): even after evicting "
                f"every inactive prefix, {budget_free} blocks of prefix budget and {pool_free} "
                f"pool blocks would be free"
            )
        return victims

    def register(
        self, prefix_id: PrefixId, num_blocks: int, victims: list[PrefixId] | None = None
    ) -> tuple[list[int], list[PrefixId]]:
        """Evict what the plan says (or ``victims``: a longer LRU run that registries kept in
        lockstep agree on), take the blocks; returns ``(block_ids, evicted ids)``."""
        if victims is None:
            victims = self.plan_register(prefix_id, num_blocks)
        for pid in victims:
            self._drop(pid)
        block_ids = self._allocator.allocate(num_blocks, prefix_owner(prefix_id))
        self._clock += 1
        self._prefixes[prefix_id] = _Prefix(tuple(block_ids), self._clock)
        self._num_blocks += num_blocks
        return block_ids, victims

    def attach(self, prefix_id: PrefixId) -> None:
        entry = self._get(prefix_id)
        self._clock += 1
        entry.refcount += 1
        entry.last_used = self._clock

    def detach(self, prefix_id: PrefixId) -> None:
        entry = self._get(prefix_id)
        if entry.refcount <= 0:
            raise RuntimeError(f"prefix {prefix_id!r} has no reference to drop")
        self._clock += 1
        entry.refcount -= 1
        entry.last_used = self._clock  # it was in use until now

    def check_evictable(self, prefix_id: PrefixId) -> None:
        entry = self._get(prefix_id)
        if entry.refcount > 0:
            raise RuntimeError(
                f"prefix {prefix_id!r} is used by {entry.refcount} active request(s); "
                "finish or cancel them before evicting it"
            )

    def evict(self, prefix_id: PrefixId) -> None:
        self.check_evictable(prefix_id)
        self._drop(prefix_id)

    def _drop(self, prefix_id: PrefixId) -> None:
        entry = self._prefixes.pop(prefix_id)
        self._allocator.release(entry.block_ids, prefix_owner(prefix_id))
        self._num_blocks -= len(entry.block_ids)
        self.num_evictions += 1

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, attached: Mapping[PrefixId, int]) -> None:
        """RuntimeError unless refcounts equal ``attached`` and every block is owned by us."""
        total = 0
        for pid, entry in self._prefixes.items():
            expected = attached.get(pid, 0)
            if entry.refcount != expected:
                raise RuntimeError(
                    f"prefix {pid!r} refcount {entry.refcount} but {expected} active request(s) "
                    "are attached"
                )
            if not entry.block_ids:
                raise RuntimeError(f"prefix {pid!r} holds no blocks")
            for block_id in entry.block_ids:
                owner = self._allocator.owner_of(block_id)
                if owner != prefix_owner(pid):
                    raise RuntimeError(f"prefix {pid!r} block {block_id} is owned by {owner!r}")
            total += len(entry.block_ids)
        for pid in attached:
            if pid not in self._prefixes:
                raise RuntimeError(f"active requests are attached to unknown prefix {pid!r}")
        if total != self._num_blocks:
            raise RuntimeError(f"prefix block count {self._num_blocks} != sum of prefixes {total}")
        if total > self._capacity:
            raise RuntimeError(f"prefixes hold {total} blocks, over the capacity {self._capacity}")
