"""The serving loop: the one place that moves requests from submission to their last token.

Every step it (1) takes a scheduling snapshot of the engine and plans it with the scheduler it
was given — the lifetime policy or a baseline, behind the same interface — and applies that
decision directly (it planned it itself, from the live state, so there is nothing to re-check);
(2) imports the prompts of the admitted requests through its executor; (3) decodes one token for
the batch — except, with a baseline policy, for requests stuck at a block boundary, after that
policy's victims (if any) are cancelled; (4) finishes requests that reached ``max_new_tokens`` (or
that the executor reports done, e.g. at EOS); (5) advances the fairness counters. The waiting
queue lives in the engine, the counters too; callers only submit and step.

What a step *computes* is the executor's: random K/V for the synthetic workloads, a real model
forward for :class:`flashdec.LLM`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flashdec.engine.engine import DecodeEngine, EngineRequestState
from flashdec.scheduler import (
    BaseScheduler,
    RequestSpec,
    SchedulerDecision,
    SchedulingSnapshot,
    needs_new_block,
)


class StepExecutor(Protocol):
    """What the loop runs for its requests (the engine calls are the executor's to make)."""

    def prefill(self, requests: Sequence[tuple[object, int]]) -> Collection | None:
        """Import ``(request_id, num_tokens)`` prompt tokens for newly admitted requests (all
        or nothing per transaction); return the ids already done (e.g. a model whose first
        token, from the prompt, is EOS): they finish without decoding."""

    def decode(self, batch: Sequence) -> Collection:
        """Decode one token for every request of ``batch`` (one engine step); return the ids
        that finished early (e.g. produced EOS)."""


@dataclass(frozen=True)
class LoopStep:
    """What one step of the loop did."""

    step: int
    admitted: tuple
    rejected: tuple
    batch: tuple  # what the scheduler planned
    served: tuple  # what decoded a token
    stuck: tuple  # batch requests that found no block (baseline policies only)
    cancelled: tuple  # victims the policy cancelled to unblock others
    finished: tuple
    waiting: int  # after the step
    active: int
    free_blocks: int
    max_service_wait: int  # longest any active request has now gone undecoded (steps)
    schedule_s: float  # snapshot + plan + apply
    prefill_s: float
    decode_s: float  # the executor's decode (0 when nothing was decoded)

    @property
    def changed(self) -> bool:
        """Whether the step moved anything (no change for long = a deadlock)."""
        return bool(self.admitted or self.rejected or self.served or self.cancelled)


class ServingLoop:
    """Drives scheduler-managed requests of one engine with one scheduler and one executor."""

    def __init__(
        self,
        engine: DecodeEngine,
        scheduler: BaseScheduler,
        executor: StepExecutor,
        *,
        check_invariants: bool = False,
        on_plan: Callable[[SchedulingSnapshot, SchedulerDecision], None] | None = None,
    ) -> None:
        if not isinstance(engine, DecodeEngine):
            raise TypeError(f"engine must be a DecodeEngine, got {type(engine).__name__}")
        if not isinstance(scheduler, BaseScheduler):
            raise TypeError(f"scheduler must be a scheduler, got {type(scheduler).__name__}")
        self.engine = engine
        self.scheduler = scheduler
        self.executor = executor
        self.check_invariants = check_invariants
        self.on_plan = on_plan  # sees every snapshot and the decision planned from it
        self.step_index = 0
        # per live request (submitted, not yet terminal): nothing stays once it is terminal, so
        # a loop that serves without end keeps what is live (LoopStep says who decoded a token)
        self.generated: dict = {}  # request id -> tokens decoded so far
        self._live: set = set()

    # ------------------------------------------------------------------ requests
    def submit(self, spec: RequestSpec) -> None:
        self.engine.submit_request(spec)
        self.generated[spec.request_id] = 0
        self._live.add(spec.request_id)

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        return not self._live

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def live_ids(self) -> frozenset:
        """Submitted requests that are not terminal yet."""
        return frozenset(self._live)

    # ------------------------------------------------------------------ one step
    def step(self) -> LoopStep:
        engine, cache = self.engine, self.engine.cache
        index = self.step_index
        start = time.perf_counter()
        snapshot = engine.scheduling_snapshot(index)
        decision = self.scheduler.plan(snapshot)
        if self.on_plan is not None:
            self.on_plan(snapshot, decision)
        engine.apply_trusted_decision(decision)
        self._forget(decision.reject)
        scheduled = time.perf_counter()

        imports = []
        for rid in decision.admit:
            spec = engine.request_spec(rid)
            missing = spec.initial_context_tokens - cache.seq_len(rid)  # a prefix covers it all
            if missing > 0:
                imports.append((rid, missing))
        done_at_prefill = set(self.executor.prefill(imports) or ()) if imports else set()
        prefilled = time.perf_counter()

        batch = [rid for rid in decision.batch if rid not in done_at_prefill]
        stuck, victims = self._unblock(batch, index)
        served = [rid for rid in batch if rid not in stuck and rid not in victims]
        done_early: Collection = ()
        decode_s = 0.0
        if served:
            t0 = time.perf_counter()
            done_early = self.executor.decode(served)
            decode_s = time.perf_counter() - t0

        finished = [rid for rid in decision.admit if rid in done_at_prefill]
        for rid in served:
            self.generated[rid] += 1
            if rid in done_early or self.generated[rid] >= engine.request_spec(rid).max_new_tokens:
                finished.append(rid)
        # an executor that reads tokens late may report a request that was not in this batch
        finished += [
            rid
            for rid in done_early
            if rid in self._live and rid not in finished and rid not in victims
        ]
        for rid in finished:
            engine.finish_request(rid)
        self._forget(finished)
        self._forget(victims)
        engine.advance_fairness(decision, served=set(served), departed=[*finished, *victims])
        if self.check_invariants:
            cache.validate_invariants()
        self.step_index += 1
        active = len(snapshot.active) + len(decision.admit) - len(finished) - len(victims)
        return LoopStep(
            step=index,
            admitted=decision.admit,
            rejected=decision.reject,
            batch=decision.batch,
            served=tuple(served),
            stuck=tuple(stuck),
            cancelled=tuple(victims),
            finished=tuple(finished),
            waiting=len(snapshot.waiting) - len(decision.admit) - len(decision.reject),
            active=active,
            free_blocks=cache.num_free_blocks,
            max_service_wait=engine.max_service_wait(),
            schedule_s=scheduled - start,
            prefill_s=prefilled - scheduled,
            decode_s=decode_s,
        )

    def _forget(self, rids: Iterable) -> None:
        """Drop what the loop keeps of requests that became terminal."""
        for rid in rids:
            self._live.discard(rid)
            self.generated.pop(rid, None)

    def _unblock(self, batch: list, step: int) -> tuple[list, list]:
        """Requests of ``batch`` that cannot get their next block, after the policy's victims.

        Under the lifetime policy every admitted request's blocks are set aside, so this never
        finds one; the greedy and cancel baselines can run dry at a block boundary.
        """
        engine, cache = self.engine, self.engine.cache
        shapes = engine.group_shapes
        if shapes:
            return self._unblock_groups(batch, step, shapes)
        bs = cache.block_size
        needing = [rid for rid in batch if cache.seq_len(rid) % bs == 0]
        if len(needing) <= cache.num_free_blocks:
            return [], []
        victims = list(self.scheduler.select_victims(engine.scheduling_snapshot(step), needing))
        for rid in victims:
            engine.cancel_request(rid)
        needing = [rid for rid in needing if rid not in victims]
        return needing[cache.num_free_blocks :], victims

    def _unblock_groups(self, batch: list, step: int, shapes) -> tuple[list, list]:
        """``_unblock`` with KV layer groups: a request is stuck when some group has no block
        for it (each group's pool serves the batch in batch order)."""
        engine, cache = self.engine, self.engine.cache
        lens = {rid: cache.seq_len(rid) for rid in batch}

        def needing_in(g: int, ids: list) -> list:
            bs, window = shapes[g]
            return [rid for rid in ids if needs_new_block(lens[rid], bs, window)]

        groups = range(len(shapes))
        if all(len(needing_in(g, batch)) <= cache.group_free_blocks(g) for g in groups):
            return [], []
        needing = [rid for rid in batch if any(needing_in(g, [rid]) for g in groups)]
        victims = list(self.scheduler.select_victims(engine.scheduling_snapshot(step), needing))
        for rid in victims:
            engine.cancel_request(rid)
        left = [rid for rid in batch if rid not in victims]
        stuck = set()
        for g in groups:
            stuck.update(needing_in(g, left)[cache.group_free_blocks(g) :])
        return [rid for rid in left if rid in stuck], victims

    # ------------------------------------------------------------------ running and stopping
    def close(self) -> tuple[tuple, tuple]:
        """Cancel every request still running or waiting (an early stop, a deadlock); returns
        ``(active_ids, waiting_ids)`` as they were."""
        active, waiting = [], []
        for rid in self.engine.request_ids():
            if rid not in self._live:
                continue
            state = self.engine.request_state(rid)
            if state is EngineRequestState.ACTIVE:
                active.append(rid)
            elif state is EngineRequestState.WAITING:
                waiting.append(rid)
        for rid in (*active, *waiting):
            self.engine.cancel_request(rid)
        self._live.clear()
        self.generated.clear()
        return tuple(active), tuple(waiting)


@dataclass(frozen=True)
class LoopRun:
    """How :func:`run_loop` ended."""

    steps: tuple[LoopStep, ...]
    num_steps: int  # steps elapsed, idle ones (waiting for an arrival) included
    deadlock: bool  # nothing moved for ``patience`` steps while requests remained
    stopped_early: bool  # ``max_steps`` reached with requests left
    unfinished_active: tuple  # admitted but not finished: cancelled by the final clean-up
    unfinished_waiting: tuple  # never admitted (or never arrived): cancelled / not submitted

    @property
    def unfinished(self) -> tuple:
        return self.unfinished_active + self.unfinished_waiting


def run_loop(
    loop: ServingLoop,
    arrivals: Iterable[tuple[int, RequestSpec]],
    *,
    max_steps: int,
    patience: int | None = None,
    on_step: Callable[[LoopStep], None] | None = None,
) -> LoopRun:
    """Submit each spec at its arrival step and step the loop until every request is terminal,
    ``max_steps`` pass, or (with ``patience``) nothing moves for that many steps. Whatever is
    still waiting or running at the end is cancelled, so the cache is clean afterwards."""
    pending = sorted(arrivals, key=lambda a: (a[0], a[1].submission_order))
    steps: list[LoopStep] = []
    idle_steps = 0
    deadlock = False
    next_arrival = 0
    while loop.step_index < max_steps:
        now = loop.step_index
        while next_arrival < len(pending) and pending[next_arrival][0] <= now:
            loop.submit(pending[next_arrival][1])
            next_arrival += 1
        if loop.idle and next_arrival == len(pending):
            break
        record = loop.step()  # an idle step (waiting for an arrival) costs one empty plan
        steps.append(record)
        if on_step is not None:
            on_step(record)
        idle_steps = 0 if record.changed else idle_steps + 1
        if patience is not None and idle_steps >= patience:
            deadlock = True
            break
    stopped_early = not deadlock and (not loop.idle or next_arrival < len(pending))
    active, waiting = loop.close()
    unarrived = tuple(spec.request_id for _, spec in pending[next_arrival:])
    return LoopRun(
        tuple(steps), loop.step_index, deadlock, stopped_early, active, waiting + unarrived
    )
