"""Baseline policies the lifetime policy is measured against.

``GreedyScheduler`` admits in strict FIFO order while the blocks a request needs *now* (its
context) are free, ignoring the blocks it will need as it decodes. When the pool runs dry, every
request at a block boundary is stuck; if all are, nothing ever frees a block — a deadlock.

``CancelScheduler`` admits like greedy but, when requests of a batch cannot get their next block,
cancels victims until they can: the most recently submitted active requests first (they have the
least work invested), each cancellation releasing that request's private blocks for good.
"""

from __future__ import annotations

from collections.abc import Collection, Set

from flashdec.scheduler.base import BaseScheduler
from flashdec.scheduler.snapshot import SchedulingSnapshot, WaitingRequest
from flashdec.scheduler.spec import RequestId, ceil_div
from flashdec.scheduler.waiting_queue import WaitingView


def blocks_needed_now(request: WaitingRequest, snapshot: SchedulingSnapshot) -> int:
    """Private blocks that importing the request's context takes (its shared prefix is resident)."""
    spec = request.spec
    context_blocks = ceil_div(spec.initial_context_tokens, snapshot.block_size)
    if spec.prefix_id is not None:
        # rejection already guaranteed the prefix is resident and covers the context exactly
        return context_blocks - snapshot.prefix_map[spec.prefix_id].num_blocks
    return context_blocks


class GreedyScheduler(BaseScheduler):
    """Admit FIFO while the context fits in the free blocks; never look ahead."""

    name = "greedy"

    def _admit(
        self, snapshot: SchedulingSnapshot, waiting: WaitingView, rejected: Set[int]
    ) -> list[int]:
        available = snapshot.free_blocks - self.config.reserve_blocks
        slots = self.config.max_active_requests - len(snapshot.active)
        admit: list[int] = []
        for i in range(len(waiting)):
            if slots <= 0:
                break
            if i in rejected:
                continue
            need = blocks_needed_now(waiting[i], snapshot)
            if need > available:
                break  # strict FIFO: nobody overtakes the head of the queue
            admit.append(i)
            available -= need
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
        """
        needing = set(needing_block)
        active = set(snapshot.active_ids)
        unknown = [rid for rid in needing_block if rid not in active]
        if unknown:
            raise ValueError(f"needing_block names ids that are not active: {unknown!r}")
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
