"""Baseline policies the lifetime policy is measured against.

``GreedyScheduler`` admits in strict FIFO order while the blocks a request needs *now* (its
context) are free, ignoring the blocks it will need as it decodes. When the pool runs dry, every
request at a block boundary is stuck; if all are, nothing ever frees a block — a deadlock.

``CancelScheduler`` admits like greedy but, when requests of a batch cannot get their next block,
cancels victims until they can: the most recently submitted active requests first (they have the
least work invested), each cancellation releasing that request's private blocks for good.

With KV layer groups both count blocks group by group, against each group's own pool.
"""

from __future__ import annotations

from collections.abc import Collection, Set

from flashdec._blocks import lifetime_blocks
from flashdec.scheduler.base import BaseScheduler
from flashdec.scheduler.groups import needs_new_block
from flashdec.scheduler.snapshot import SchedulingSnapshot, WaitingRequest
from flashdec.scheduler.spec import RequestId, ceil_div
from flashdec.scheduler.waiting_queue import WaitingView


def blocks_needed_now(request: WaitingRequest, snapshot: SchedulingSnapshot) -> int:
    """Private blocks that importing the request's context takes (its shared prefix is resident);
    group 0's with layer groups (see ``blocks_needed_now_by_group``)."""
    if snapshot.groups:
        return blocks_needed_now_by_group(request, snapshot)[0]
    spec = request.spec
    context_blocks = ceil_div(spec.initial_context_tokens, snapshot.block_size)
    if spec.prefix_id is not None:
        # rejection already guaranteed the prefix is resident and covers the context exactly
        return context_blocks - snapshot.prefix_map[spec.prefix_id].num_blocks
    return context_blocks


def blocks_needed_now_by_group(
    request: WaitingRequest, snapshot: SchedulingSnapshot
) -> tuple[int, ...]:
    """``blocks_needed_now`` in every layer group (one entry for a snapshot without groups).

    A window group's import holds at most the window's blocks (its bound for a request as long
    as the context); the context after a shared prefix starts on a block boundary in every group.
    """
    if not snapshot.groups:
        return (blocks_needed_now(request, snapshot),)
    spec = request.spec
    own = spec.initial_context_tokens
    if spec.prefix_id is not None:
        own -= snapshot.prefix_map[spec.prefix_id].num_tokens
    return tuple(lifetime_blocks(own, bs, window) for bs, window in snapshot.group_shapes)


class GreedyScheduler(BaseScheduler):
    """Admit FIFO while the context fits in the free blocks; never look ahead."""

    name = "greedy"

    def _admit(
        self, snapshot: SchedulingSnapshot, waiting: WaitingView, rejected: Set[int]
    ) -> list[int]:
        reserve = self.config.reserve_blocks
        # one entry per layer group (one for a snapshot without groups), as the needs come
        pools = snapshot.groups or (snapshot,)
        available = [pool.free_blocks - reserve for pool in pools]
        slots = self.config.max_active_requests - len(snapshot.active)
        admit: list[int] = []
        for i in range(len(waiting)):
            if slots <= 0:
                break
            if i in rejected:
                continue
            need = blocks_needed_now_by_group(waiting[i], snapshot)
            if any(n > a for n, a in zip(need, available, strict=True)):
                break  # strict FIFO: nobody overtakes the head of the queue
            admit.append(i)
            available = [a - n for a, n in zip(available, need, strict=True)]
            slots -= 1
        return admit


class CancelScheduler(GreedyScheduler):
    """Greedy admission; at a block shortage, cancel the newest active requests."""

    name = "cancel"

    def select_victims(
        self, snapshot: SchedulingSnapshot, needing_block: Collection[RequestId]
    ) -> tuple[RequestId, ...]:
        """Newest-submitted active requests first, until the remaining ones needing a block fit.

        A victim that itself needed a block no longer does; every victim frees its private blocks.
        With layer groups, until every group has a block for each remaining request that needs
        one there.
        """
        needing = set(needing_block)
        active = set(snapshot.active_ids)
        unknown = [rid for rid in needing_block if rid not in active]
        if unknown:
            raise ValueError(f"needing_block names ids that are not active: {unknown!r}")
        if snapshot.groups:
            return self._victims_by_group(snapshot, needing)
        need = len(needing)
        free = snapshot.free_blocks
        victims: list[RequestId] = []
        for r in sorted(snapshot.active, key=lambda r: -r.spec.submission_order):
            if need <= free:
                break
            victims.append(r.request_id)
            free += r.committed_private_blocks
            if r.request_id in needing:
                need -= 1
        return tuple(victims)

    def _victims_by_group(
        self, snapshot: SchedulingSnapshot, needing: set[RequestId]
    ) -> tuple[RequestId, ...]:
        shapes = snapshot.group_shapes

        def wants(r) -> list[int]:  # per group: 1 if its next token takes a block there
            if r.request_id not in needing:
                return [0] * len(shapes)
            return [int(needs_new_block(r.committed_tokens, bs, w)) for bs, w in shapes]

        need = [0] * len(shapes)
        for r in snapshot.active:
            need = [a + b for a, b in zip(need, wants(r), strict=True)]
        free = [pool.free_blocks for pool in snapshot.groups]
        victims: list[RequestId] = []
        for r in sorted(snapshot.active, key=lambda r: -r.spec.submission_order):
            if all(n <= f for n, f in zip(need, free, strict=True)):
                break
            victims.append(r.request_id)
            free = [
                f + b.committed_private_blocks
                for f, b in zip(free, r.blocks_in_groups, strict=True)
            ]
            need = [n - w for n, w in zip(need, wants(r), strict=True)]
        return tuple(victims)
