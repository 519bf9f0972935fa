"""``SchedulingSnapshot``: the K/V-free view of the cache a policy plans from.

It is a tree of small frozen dataclasses and tuples (or an immutable ``WaitingView`` for the
waiting queue), so two snapshots built from the same state compare equal field by field and a
policy cannot mutate what it reads. Derived fields (lifetime blocks) are checked against their
definition here, so an inconsistent snapshot cannot exist.

A cache with several KV layer groups (or one sliding-window group) is described by ``groups``:
one ``GroupPool`` per group, each with its own block size, window and pool; the top-level pool
fields then repeat group 0's, and every row carries its blocks per group (``*_by_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdec._blocks import blocks_for_tokens
from flashdec._checks import check_positive_int
from flashdec.scheduler.groups import GroupPool, GroupShape
from flashdec.scheduler.rows import (
    ActiveRequest,
    Geometry,
    GroupBlocks,
    PrefixInfo,
    WaitingRequest,
    geometry_of,
    lifetime_private_blocks,
    lifetime_private_blocks_by_group,
)
from flashdec.scheduler.spec import PrefixId, RequestId, ceil_div
from flashdec.scheduler.waiting_queue import WaitingView

__all__ = [
    "ActiveRequest",
    "GroupBlocks",
    "GroupPool",
    "PrefixInfo",
    "SchedulingSnapshot",
    "WaitingRequest",
    "lifetime_private_blocks",
]


@dataclass(frozen=True)
class SchedulingSnapshot:
    """Everything a policy may read, at one cache version.

    ``waiting`` is in submission order — a tuple, or a ``WaitingView`` of a ``WaitingQueue``
    (then checking it costs O(active + prefixes): its rows were derived at submission, and only
    its geometry is compared with this snapshot's); ``active`` in the order the caller listed it.

    ``groups`` is empty for a cache with one full-attention group (the top-level fields are its
    pool). Otherwise it lists every layer group's pool (a single sliding-window group too), the
    top-level fields equal ``groups[0]``'s, and every prefix and request row carries its block
    counts per group; a request is then committed in each group against that group's pool.
    """

    step: int
    cache_version: int
    block_size: int
    total_blocks: int  # the whole pool
    free_blocks: int
    max_blocks_per_seq: int  # longest block table a request may have
    prefixes: tuple[PrefixInfo, ...] = ()
    active: tuple[ActiveRequest, ...] = ()
    waiting: tuple[WaitingRequest, ...] | WaitingView = ()
    groups: tuple[GroupPool, ...] = ()
    # automatic prefix caching: references to cached blocks beyond the first (group 0's; see
    # GroupPool.shared_block_refs), and each waiting request whose cache hit would share blocks
    # that active requests hold already: (request id, those blocks per pool), in submission
    # order. Such a request needs that many fewer new blocks.
    shared_block_refs: int = 0
    shared_hits: tuple[tuple[RequestId, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        check_positive_int("step", self.step, minimum=0)
        check_positive_int("cache_version", self.cache_version, minimum=0)
        check_positive_int("block_size", self.block_size, minimum=1)
        check_positive_int("total_blocks", self.total_blocks, minimum=1)
        check_positive_int("free_blocks", self.free_blocks, minimum=0)
        check_positive_int("max_blocks_per_seq", self.max_blocks_per_seq, minimum=1)
        check_positive_int("shared_block_refs", self.shared_block_refs, minimum=0)
        self._check_tuple("prefixes", PrefixInfo)
        self._check_tuple("active", ActiveRequest)
        is_view = isinstance(self.waiting, WaitingView)
        if not is_view:
            self._check_tuple("waiting", WaitingRequest, " or a WaitingView")
        self._check_groups()
        prefixes = self.prefix_map
        if len(prefixes) != len(self.prefixes):
            raise ValueError("prefixes must not repeat a prefix_id")
        for p in self.prefixes:
            self._check_prefix(p)
        geometry = self.geometry
        if is_view:
            self._check_waiting_view(self.waiting, geometry)  # type: ignore[arg-type]
        else:
            self._check_waiting_tuple(prefixes)
        for r in self.active:
            # A row's consistency depends only on the geometry, and callers reuse unchanged rows
            # from one snapshot to the next: check each row once per geometry.
            if r.__dict__.get(_CHECKED_UNDER) != geometry:
                self._check_active(r, prefixes)
                object.__setattr__(r, _CHECKED_UNDER, geometry)  # a memo, not a field
        self._check_shared_hits()
        prefix_blocks = self.resident_prefix_blocks_by_group
        for g, pool in enumerate(self.pools):
            used = prefix_blocks[g] + sum(
                r.blocks_in_groups[g].committed_private_blocks for r in self.active
            )
            if pool.free_blocks + used > pool.total_blocks + pool.shared_block_refs:
                where = f"group {g}: " if self.groups else ""
                raise ValueError(
                    f"{where}free_blocks ({pool.free_blocks}) + prefix and private blocks in "
                    f"use ({used}) exceed total_blocks ({pool.total_blocks}) + shared block "
                    f"references ({pool.shared_block_refs})"
                )

    def _check_shared_hits(self) -> None:
        hits = self.shared_hits
        if not isinstance(hits, tuple):
            raise TypeError(f"shared_hits must be a tuple, got {type(hits).__name__}")
        if not hits:
            return
        view = self.waiting_view
        last = -1
        for entry in hits:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], tuple)):
                raise TypeError("shared_hits entries must be (request id, tuple of ints)")
            rid, shared = entry
            row = view.get(rid)
            if row is None:
                raise ValueError(f"shared_hits names {rid!r}, which is not waiting")
            order = row.spec.submission_order
            if order <= last:
                raise ValueError("shared_hits must be in submission order, one entry per id")
            last = order
            needs = row.lifetime_private_blocks_by_group or (row.lifetime_private_blocks,)
            if len(shared) != len(needs):
                raise ValueError(
                    f"shared_hits[{rid!r}] must give one count per pool ({len(needs)}), "
                    f"got {shared}"
                )
            for g, (count, need) in enumerate(zip(shared, needs, strict=True)):
                check_positive_int(f"shared_hits[{rid!r}][{g}]", count, minimum=0)
                if count > need:
                    raise ValueError(
                        f"shared_hits[{rid!r}][{g}] ({count}) exceeds the request's lifetime "
                        f"blocks there ({need})"
                    )

    def _check_groups(self) -> None:
        groups = self.groups
        if not isinstance(groups, tuple) or not all(isinstance(g, GroupPool) for g in groups):
            raise TypeError("groups must be a tuple of GroupPool")
        if not groups:
            return
        if len(groups) == 1 and groups[0].window is None:
            raise ValueError(
                "one full-attention group is described by the top-level fields alone: leave "
                "groups empty"
            )
        top = (
            self.block_size,
            self.total_blocks,
            self.free_blocks,
            self.max_blocks_per_seq,
            self.shared_block_refs,
        )
        first = groups[0]
        if top != (
            first.block_size,
            first.total_blocks,
            first.free_blocks,
            first.max_blocks_per_seq,
            first.shared_block_refs,
        ):
            raise ValueError(
                "block_size, total_blocks, free_blocks, max_blocks_per_seq and "
                f"shared_block_refs must be group 0's ({first}), got {top}"
            )

    def _check_prefix(self, p: PrefixInfo) -> None:
        groups = self.groups
        if not groups:
            if p.num_blocks_by_group:
                raise ValueError(
                    f"prefix {p.prefix_id!r} has blocks per group but the snapshot has no groups"
                )
            if p.num_tokens != p.num_blocks * self.block_size:
                raise ValueError(
                    f"prefix {p.prefix_id!r} must hold full blocks: num_tokens {p.num_tokens} "
                    f"!= num_blocks {p.num_blocks} * block_size {self.block_size}"
                )
            return
        if len(p.num_blocks_by_group) != len(groups):
            raise ValueError(
                f"prefix {p.prefix_id!r} must give its blocks in each of the {len(groups)} groups "
                f"(num_blocks_by_group), got {p.num_blocks_by_group}"
            )
        for g, (blocks, pool) in enumerate(zip(p.num_blocks_by_group, groups, strict=True)):
            if p.num_tokens != blocks * pool.block_size:
                raise ValueError(
                    f"prefix {p.prefix_id!r} must hold full blocks in group {g}: num_tokens "
                    f"{p.num_tokens} != {blocks} blocks * block_size {pool.block_size}"
                )

    def _check_waiting_tuple(self, prefixes: dict[PrefixId, PrefixInfo]) -> None:
        ids = [r.request_id for r in self.active] + [r.request_id for r in self.waiting]
        if len(set(ids)) != len(ids):
            raise ValueError(_REPEATED_ID)
        orders = [r.spec.submission_order for r in self.active + self.waiting]  # type: ignore[operator]
        if len(set(orders)) != len(orders):
            raise ValueError(_REPEATED_ORDER)
        waiting_orders = [r.spec.submission_order for r in self.waiting]
        if waiting_orders != sorted(waiting_orders):
            raise ValueError(f"waiting must be in submission order, got {waiting_orders}")
        shapes = self.group_shapes
        for r in self.waiting:
            if shapes:
                name, value = "lifetime_private_blocks_by_group", r.lifetime_private_blocks_by_group
                expected = lifetime_private_blocks_by_group(r.spec, shapes, prefixes)
            elif r.lifetime_private_blocks_by_group:
                raise ValueError(
                    f"waiting request {r.request_id!r} has blocks per group but the snapshot has "
                    "no groups"
                )
            else:
                name, value = "lifetime_private_blocks", r.lifetime_private_blocks
                expected = lifetime_private_blocks(r.spec, self.block_size, prefixes)
            if value != expected:
                raise ValueError(
                    f"waiting request {r.request_id!r}: {name} {value} != {expected} derived from "
                    "its spec"
                )

    def _check_waiting_view(self, view: WaitingView, geometry: Geometry) -> None:
        if view.geometry is not None and view.geometry != geometry:
            raise ValueError(
                f"waiting requests were derived with block size and prefixes {view.geometry}, "
                f"but this snapshot has {geometry}"
            )
        ids = {r.request_id for r in self.active}
        if len(ids) != len(self.active) or view.has_any_id(ids):
            raise ValueError(_REPEATED_ID)
        orders = {r.spec.submission_order for r in self.active}
        if len(orders) != len(self.active) or view.has_any_submission_order(orders):
            raise ValueError(_REPEATED_ORDER)

    def _check_tuple(self, name: str, kind: type, alternative: str = "") -> None:
        value = getattr(self, name)
        if not isinstance(value, tuple) or not all(isinstance(v, kind) for v in value):
            raise TypeError(f"{name} must be a tuple of {kind.__name__}{alternative}")

    def _check_active(self, r: ActiveRequest, prefixes: dict[PrefixId, PrefixInfo]) -> None:
        prefix = None
        prefix_blocks = 0
        if r.spec.prefix_id is not None:
            prefix = prefixes.get(r.spec.prefix_id)
            if prefix is None:
                raise ValueError(
                    f"active request {r.request_id!r} uses prefix {r.spec.prefix_id!r}, "
                    "which is not resident"
                )
            prefix_blocks = prefix.num_blocks
        if self.groups:
            self._check_active_groups(r, prefix, prefixes)
            return
        if r.blocks_by_group:
            raise ValueError(
                f"active request {r.request_id!r} has blocks per group but the snapshot has no "
                "groups"
            )
        expected = lifetime_private_blocks(r.spec, self.block_size, prefixes)
        if r.lifetime_private_blocks != expected:
            raise ValueError(
                f"active request {r.request_id!r}: lifetime_private_blocks "
                f"{r.lifetime_private_blocks} != {expected} derived from its spec"
            )
        if r.committed_blocks != r.committed_private_blocks + prefix_blocks:
            raise ValueError(
                f"active request {r.request_id!r}: committed_blocks ({r.committed_blocks}) must "
                f"equal committed_private_blocks ({r.committed_private_blocks}) + prefix blocks "
                f"({prefix_blocks})"
            )
        if r.committed_blocks != ceil_div(r.committed_tokens, self.block_size):
            raise ValueError(
                f"active request {r.request_id!r}: committed_blocks ({r.committed_blocks}) must "
                f"be ceil(committed_tokens / block_size) = "
                f"{ceil_div(r.committed_tokens, self.block_size)}"
            )

    def _check_active_groups(
        self, r: ActiveRequest, prefix: PrefixInfo | None, prefixes: dict[PrefixId, PrefixInfo]
    ) -> None:
        shapes = self.group_shapes
        groups = r.blocks_by_group
        if len(groups) != len(shapes):
            raise ValueError(
                f"active request {r.request_id!r} must give its blocks in each of the "
                f"{len(shapes)} groups (blocks_by_group), got {len(groups)}"
            )
        expected = lifetime_private_blocks_by_group(r.spec, shapes, prefixes)
        lifetimes = tuple(b.lifetime_private_blocks for b in groups)
        if lifetimes != expected:
            raise ValueError(
                f"active request {r.request_id!r}: lifetime private blocks per group "
                f"{lifetimes} != {expected} derived from its spec"
            )
        prefix_tokens = 0 if prefix is None else prefix.num_tokens
        own = r.committed_tokens - prefix_tokens
        if own < 0:
            raise ValueError(
                f"active request {r.request_id!r} holds {r.committed_tokens} tokens, fewer than "
                f"its prefix ({prefix_tokens})"
            )
        for g, ((block_size, window), b) in enumerate(zip(shapes, groups, strict=True)):
            shared = 0 if prefix is None else prefix.num_blocks_by_group[g]
            held = blocks_for_tokens(own, block_size, window)
            if (b.committed_blocks, b.committed_private_blocks) != (held + shared, held):
                raise ValueError(
                    f"active request {r.request_id!r} in group {g}: committed (private) blocks "
                    f"must be {held + shared} ({held}) for {r.committed_tokens} tokens, got "
                    f"{b.committed_blocks} ({b.committed_private_blocks})"
                )

    @property
    def group_shapes(self) -> tuple[GroupShape, ...]:
        """Each group's ``(block_size, window)``; empty for a one-group, full-attention
        snapshot."""
        return tuple(pool.shape for pool in self.groups)

    @property
    def pools(self) -> tuple[GroupPool, ...]:
        """Every group's pool: ``groups``, or the top-level fields as one full-attention group."""
        if self.groups:
            return self.groups
        return (
            GroupPool(
                self.block_size,
                self.total_blocks,
                self.free_blocks,
                self.max_blocks_per_seq,
                shared_block_refs=self.shared_block_refs,
            ),
        )

    @property
    def shared_hit_positions(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``shared_hits`` as (position in ``waiting``, shared blocks per pool), ascending."""
        view = self.waiting_view
        return tuple((view.position(rid), shared) for rid, shared in self.shared_hits)

    @property
    def resident_prefix_blocks_by_group(self) -> tuple[int, ...]:
        """Blocks held by resident prefixes in each group (one entry without groups)."""
        if not self.groups:
            return (self.resident_prefix_blocks,)
        totals = [0] * len(self.groups)
        for p in self.prefixes:
            for g, blocks in enumerate(p.num_blocks_by_group):
                totals[g] += blocks
        return tuple(totals)

    @property
    def prefix_map(self) -> dict[PrefixId, PrefixInfo]:
        return {p.prefix_id: p for p in self.prefixes}

    @property
    def geometry(self) -> Geometry:
        """What waiting requests' lifetime blocks are derived from (see ``geometry_of``)."""
        return geometry_of(self.block_size, self.prefixes, self.group_shapes)

    @property
    def resident_prefix_blocks(self) -> int:
        """Blocks held by resident prefixes, counted once however many requests share them."""
        return sum(p.num_blocks for p in self.prefixes)

    @property
    def waiting_view(self) -> WaitingView:
        """``waiting`` as a ``WaitingView`` (a tuple is wrapped once, in O(n), and kept)."""
        if isinstance(self.waiting, WaitingView):
            return self.waiting
        view = self.__dict__.get("_waiting_view")
        if view is None:
            view = WaitingView._wrap(
                self.waiting, self.block_size, self.prefixes, self.group_shapes
            )
            object.__setattr__(self, "_waiting_view", view)  # a cache, not a field
        return view

    @property
    def active_ids(self) -> tuple[RequestId, ...]:
        return tuple(r.request_id for r in self.active)

    @property
    def waiting_ids(self) -> tuple[RequestId, ...]:
        """Waiting ids in submission order (O(n))."""
        if isinstance(self.waiting, WaitingView):
            return self.waiting.request_ids()
        return tuple(r.request_id for r in self.waiting)


_CHECKED_UNDER = "_checked_under_geometry"
_REPEATED_ID = "a request id appears twice among active and waiting requests"
_REPEATED_ORDER = "submission_order must be unique among active and waiting requests"
