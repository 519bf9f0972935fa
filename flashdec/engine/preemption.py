"""Preemption by swap in the serving loop: when the FIFO head of the waiting queue has waited
``patience`` steps because the pool is short (:func:`flashdec.scheduler.swap_victims` says
whom and why no request gets stuck), the chosen running requests are swapped out before the
step is planned, so the head is admitted in their place.

A swap needs no copy of its own: the victim's committed full blocks stay in the prefix cache
under the hash chain of its prompt and generated tokens (evictable; the host tier takes them
when the GPU pool needs their room), and the victim waits again with that text as its context.
Its admission starts from the longest cached run, from the GPU pool or copied up from the host,
and recomputes only the rest: at least its last, partial block. Greedy output is unchanged.

A swap is a committed scheduling choice: a step that fails after it leaves the victim waiting
(with its tokens), which is a state any schedule could reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from flashdec._checks import check_positive_int
from flashdec.engine.engine import DecodeEngine
from flashdec.scheduler import (
    ActiveRequest,
    BaseScheduler,
    RequestSpec,
    SchedulingSnapshot,
    swap_victims,
)


class _Loop(Protocol):
    """What a swap reads and moves of the serving loop (``flashdec.engine.loop.ServingLoop``,
    which imports this module)."""

    engine: DecodeEngine
    scheduler: BaseScheduler
    generated: dict

    def importing(self, request_id: object) -> bool: ...


# submission orders per request: a swapped request takes one of the orders right after the
# request it gave way to (flashdec.LLM spaces its requests' orders by this much)
ORDER_STRIDE = 1 << 16


class SwapPreemption:
    """Swaps running requests out for the FIFO head (``patience``: the steps it waits first).

    ``make_spec(request_id, context_tokens, new_tokens, order)``: the spec of a request that
    resumes with ``context_tokens`` of context and ``new_tokens`` still to generate.
    """

    def __init__(
        self,
        runner: Any,  # a flashdec.engine.runner.ModelRunner (it imports the loop)
        make_spec: Callable[[object, int, int, int], RequestSpec],
        patience: int,
    ) -> None:
        self.runner = runner
        self.make_spec = make_spec
        self.patience = check_positive_int("patience", patience, minimum=0)
        self.swapped: set = set()  # every request swapped so far, live or not (never twice)
        self.num_swaps = 0
        self._next_order: dict = {}  # head's submission order -> the next order behind it

    def forget(self, request_id) -> None:
        """``request_id`` ended: a request id is never reused."""
        self.swapped.discard(request_id)

    def before_step(self, loop: _Loop, snapshot: SchedulingSnapshot) -> tuple:
        """Swap out what :func:`swap_victims` names, planned on ``snapshot`` (``loop``'s, taken
        for its next step); returns the requests swapped (the loop then snapshots again)."""
        waiting = snapshot.waiting
        if not len(waiting) or waiting[0].wait_steps < self.patience:
            return ()  # the common case costs this test alone
        runner = self.runner
        runner.collect()  # every candidate's tokens on the host (a swap is rare: one sync)
        eligible = {row.request_id for row in snapshot.active if self._eligible(row, loop)}
        first = waiting[0].request_id not in self.swapped
        victims = swap_victims(snapshot, loop.scheduler.config, eligible, self.patience, first)
        head = waiting[0].spec.submission_order
        submissions, swapped = loop.engine.submissions, []
        for rid in victims:
            order = self._next_order.get(head, head + 1)
            if order >= head + ORDER_STRIDE:
                break  # no order left behind this head: the rest keep running
            req = runner.requests[rid]
            context = req.prompt.tolist() + req.tokens
            spec = self.make_spec(rid, len(context), req.max_new_tokens - len(req.tokens), order)
            submissions.preempt(rid, spec, context)
            req.fold()
            if runner.speculative is not None:  # its draft state (a draft model's blocks)
                runner.drafter.forget(rid)
            loop.generated[rid] = 0
            self._next_order[head] = order + 1
            self.swapped.add(rid)
            swapped.append(rid)
        self.num_swaps += len(swapped)
        return tuple(swapped)

    def _eligible(self, row: ActiveRequest, loop: _Loop) -> bool:
        """A running request that decoded, has two or more tokens left, was never swapped and
        has not ended on the host yet."""
        rid = row.request_id
        req = self.runner.requests.get(rid)
        return (
            req is not None
            and rid not in self.swapped
            and not loop.importing(rid)
            and req.finished_at is None
            and len(req.tokens) > 0
            and req.max_new_tokens - len(req.tokens) >= 2
        )
