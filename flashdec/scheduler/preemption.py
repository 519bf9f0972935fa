"""Preemption by swap: which running requests give way to a waiting request the pool cannot
hold, so that new work is not held back behind long-lived commitments.

The lifetime policy (:mod:`flashdec.scheduler.policy`) admits a request only when every block it
can ever need fits beside every active request's remaining commitment, so a waiting request may
sit behind requests that will not need their blocks for a long time. A swap takes some of them
out (their full blocks stay cached and move to the host tier as the pool needs them; they resume
from there), and the waiting request is admitted in their place.

The rule, and why no request is ever stuck:

1. Only the oldest waiting request (the FIFO head) causes a swap, only after it has waited
   ``patience`` steps, only while a slot is free (``max_active_requests``) and only when its
   lifetime blocks do not fit the headroom: blocks are the shortage, not slots. A head that
   was swapped itself never causes a swap (``may_swap`` is False for it): it gave way once,
   and taking the room back from the request it gave way to would undo that swap.
2. Victims are the ``eligible`` running requests (the caller's: those that have decoded and
   were never swapped), newest submission first, taken until the blocks their lifetime
   commitments free make the head fit in every layer group; when all of them together are not
   enough, nobody is swapped.
3. A victim waits again right behind the head (its new submission order lies between the
   head's and the next one's), with the lifetime commitment of what it has left; it is never
   swapped a second time.

So each request is swapped at most once: a run of ``n`` requests has at most ``n`` swaps, and
between two of them the lifetime policy's own guarantee holds (every admitted request runs to
completion without stalling, FIFO + aging bounds every wait). A swapped request is a waiting
request like any other, ahead of every later arrival.
"""

from __future__ import annotations

from collections.abc import Collection

from flashdec.scheduler.policy import lifetime_headrooms
from flashdec.scheduler.snapshot import SchedulingSnapshot
from flashdec.scheduler.spec import RequestId, SchedulerConfig


def swap_victims(
    snapshot: SchedulingSnapshot,
    config: SchedulerConfig,
    eligible: Collection[RequestId],
    patience: int,
    may_swap: bool = True,
) -> tuple[RequestId, ...]:
    """The running requests of ``eligible`` to swap out so that the FIFO head of
    ``snapshot.waiting`` fits (the rule above; ``may_swap``: the head was never swapped
    itself); empty when no swap is due or none would be enough. Reads only."""
    waiting = snapshot.waiting
    if not len(waiting) or len(snapshot.active) >= config.max_active_requests:
        return ()
    head = waiting[0]
    if not may_swap or head.wait_steps < patience:
        return ()
    headroom = lifetime_headrooms(snapshot, config.reserve_blocks)
    need = head.lifetime_private_blocks_by_group or (head.lifetime_private_blocks,)
    short = [n - h for n, h in zip(need, headroom, strict=True)]
    if all(s <= 0 for s in short):
        return ()  # it fits: the policy admits it (or aging will)
    candidates = sorted(
        (row for row in snapshot.active if row.request_id in eligible),
        key=lambda row: row.spec.submission_order,
        reverse=True,
    )
    victims = []
    for row in candidates:
        freed = [g.lifetime_private_blocks for g in row.blocks_in_groups]
        victims.append(row.request_id)
        short = [s - f for s, f in zip(short, freed, strict=True)]
        if all(s <= 0 for s in short):
            return tuple(victims)
    return ()
