"""``BlockAwareScheduler``: the "lifetime" policy.

A waiting request is admitted only when every block it can ever need fits beside the remaining
lifetime commitment of every active request and the reserve. Since every active request's future
blocks are already set aside, no admitted request can stall at a block boundary, and nothing ever
has to be cancelled to make room.

Waiting order is FIFO by submission order, with backfilling: a request that does not fit yet may
be overtaken by later, smaller ones — but once it has been overtaken ``aging_threshold`` times it
blocks every later arrival until it is admitted, which bounds its wait.

With automatic prefix caching a waiting request whose hit would share blocks active requests
already hold (``snapshot.shared_hits``) needs only its other blocks: it fits when those fit. The
order rule is unchanged — among the requests that fit, FIFO; a cached request that fits only
thanks to its hit may overtake earlier ones that do not fit (as any backfill may), and an aged
request still stops every later one. So under memory pressure what is cached goes first, and
aging still bounds every wait.

With KV layer groups the same holds group by group: a request is committed in every group, at that
group's own bound (a sliding-window group's is ``ceil(window / block_size) + 1`` however long the
request runs), against that group's own pool, and it fits only if it fits in all of them.
"""

from __future__ import annotations

from collections.abc import Set

from flashdec.scheduler.base import BaseScheduler, next_candidate
from flashdec.scheduler.snapshot import SchedulingSnapshot
from flashdec.scheduler.waiting_queue import WaitingView


def lifetime_headroom(snapshot: SchedulingSnapshot, reserve_blocks: int) -> int:
    """Blocks a new request may commit to without endangering any active request.

    Two views of the same quantity; the smaller wins, so blocks held by anything the snapshot does
    not describe (visible only as fewer free blocks) are never promised twice:
    pool − reserve − resident prefixes − Σ active lifetime private blocks, and
    free − reserve − Σ active private blocks still to be taken. (Active rows count the cached
    blocks they share as their own: the pool side adds back the references beyond the first.)
    """
    by_pool = (
        snapshot.total_blocks
        + snapshot.shared_block_refs
        - reserve_blocks
        - snapshot.resident_prefix_blocks
        - sum(r.lifetime_private_blocks for r in snapshot.active)
    )
    by_free = (
        snapshot.free_blocks
        - reserve_blocks
        - sum(r.remaining_private_blocks for r in snapshot.active)
    )
    return min(by_pool, by_free)


def lifetime_headrooms(snapshot: SchedulingSnapshot, reserve_blocks: int) -> tuple[int, ...]:
    """``lifetime_headroom`` of every layer group, each against its own pool (the reserve is
    kept in each); one entry for a snapshot without groups. ``lifetime_headroom`` is entry 0."""
    if not snapshot.groups:
        return (lifetime_headroom(snapshot, reserve_blocks),)
    rows = [r.blocks_in_groups for r in snapshot.active]
    headrooms = []
    for g, (pool, prefix_blocks) in enumerate(
        zip(snapshot.groups, snapshot.resident_prefix_blocks_by_group, strict=True)
    ):
        lifetime = sum(row[g].lifetime_private_blocks for row in rows)
        remaining = sum(row[g].remaining_private_blocks for row in rows)
        by_pool = pool.total_blocks + pool.shared_block_refs - reserve_blocks - prefix_blocks
        by_pool -= lifetime
        by_free = pool.free_blocks - reserve_blocks - remaining
        headrooms.append(min(by_pool, by_free))
    return tuple(headrooms)


class BlockAwareScheduler(BaseScheduler):
    """Lifetime-commitment admission with FIFO + aging (SPEC §6)."""

    name = "lifetime"

    def _admit(
        self, snapshot: SchedulingSnapshot, waiting: WaitingView, rejected: Set[int]
    ) -> list[int]:
        # Walking the candidates in order, each either fits the headroom left (admitted), or is
        # aged and does not fit (nobody submitted after it may take the blocks it is waiting
        # for: stop), or is passed over. So jump from one fitting candidate to the next, and stop
        # at an aged candidate that comes before it. With layer groups the headroom has one entry
        # per group and a candidate fits only where it fits in every group.
        config = self.config
        threshold = config.aging_threshold
        grouped = bool(snapshot.groups)
        if grouped:
            headroom = lifetime_headrooms(snapshot, config.reserve_blocks)
            first_fitting = waiting.first_fitting_groups
        else:
            headroom = lifetime_headroom(snapshot, config.reserve_blocks)
            first_fitting = waiting.first_fitting
        slots = config.max_active_requests - len(snapshot.active)
        admit: list[int] = []
        start = 0
        none_aged = len(waiting)
        aged = -1  # first aged candidate at or after ``start`` (``none_aged``: none); -1: unknown
        # cached candidates (few): a request the tree passes over may fit less its shared blocks
        hits = [
            (pos, shared) for pos, shared in snapshot.shared_hit_positions if pos not in rejected
        ]
        discount = dict(hits)
        next_hit = 0
        while slots > 0:
            fit = next_candidate(first_fitting, start, headroom, rejected)
            while next_hit < len(hits) and hits[next_hit][0] < start:
                next_hit += 1
            for pos, shared in hits[next_hit:]:
                if fit is not None and pos >= fit:
                    break
                if self._fits(self._need(waiting[pos], shared, grouped), headroom, grouped):
                    fit = pos
                    break
            if fit is None:
                break
            if threshold is not None:
                if aged < start:
                    found = next_candidate(waiting.first_aged, start, threshold, rejected)
                    aged = none_aged if found is None else found
                if aged < fit:
                    break
            admit.append(fit)
            need = self._need(waiting[fit], discount.get(fit), grouped)
            if grouped:
                headroom = tuple(h - n for h, n in zip(headroom, need, strict=True))
            else:
                headroom -= need
            slots -= 1
            start = fit + 1
        return admit

    @staticmethod
    def _need(row, shared: tuple[int, ...] | None, grouped: bool):
        """The new blocks ``row`` commits to: its lifetime private blocks less the ones it
        would share with active requests (per group when ``grouped``)."""
        if grouped:
            needs = row.lifetime_private_blocks_by_group
            if shared is None:
                return needs
            return tuple(n - s for n, s in zip(needs, shared, strict=True))
        return row.lifetime_private_blocks - (shared[0] if shared else 0)

    @staticmethod
    def _fits(need, headroom, grouped: bool) -> bool:
        if grouped:
            return all(n <= h for n, h in zip(need, headroom, strict=True))
        return need <= headroom
