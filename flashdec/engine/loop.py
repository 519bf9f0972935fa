"""The serving loop: the one place that moves requests from submission to their last token.

Every step it (1) takes a scheduling snapshot of the engine and plans it with the scheduler it
was given — the lifetime policy or a baseline, behind the same interface — and applies that
decision directly (it planned it itself, from the live state, so there is nothing to re-check);
(2) imports the prompts of the admitted requests through its executor; (3) decodes one token for
the batch (several, with a speculative executor) — except, with a baseline policy, for requests
stuck at a block boundary, after that policy's victims (if any) are cancelled; (4) finishes
requests that reached ``max_new_tokens`` (or that the executor reports done, e.g. at EOS); (5)
advances the fairness counters. The waiting queue and the counters are the engine's
``submissions`` (:class:`SubmissionQueue`, beside the cache's lifecycle), which the loop
drives: the trusted apply, the fairness step and the revert of a failed step are its calls
alone; callers only submit and step.

What a step *computes* is the executor's: random K/V for the synthetic workloads, a real model
forward for :class:`flashdec.LLM`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from flashdec._blocks import reserved_blocks
from flashdec._checks import check_positive_int
from flashdec.engine.engine import DecodeEngine
from flashdec.engine.preemption import SwapPreemption
from flashdec.engine.states import EngineRequestState
from flashdec.scheduler import (
    BaseScheduler,
    RequestSpec,
    SchedulerDecision,
    SchedulingSnapshot,
    WaitingRequest,
    lifetime_private_blocks,
    lifetime_private_blocks_by_group,
    needs_new_block,
    rejection_reason,
)


class StepExecutor:
    """What the loop runs for its requests (the engine calls are the executor's to make).

    An executor defines ``prefill`` and ``decode``; ``run`` is one loop step's work and by
    default does them in turn (two engine steps). An executor that can put both in one
    engine step (a mixed-token step, :class:`flashdec.LLM`'s) overrides ``run``.
    """

    def prefill(self, requests: Sequence[tuple[object, int]]) -> Collection | None:
        """Import ``(request_id, num_tokens)`` prompt tokens at each request's length (a
        prompt may come in several chunks, over several steps); return the ids already done
        (e.g. a model whose first token, from the prompt, is EOS): they finish without
        decoding. When it raises, the loop takes the step back: it must record nothing
        then."""
        raise NotImplementedError

    def decode(self, batch: Sequence) -> Collection:
        """Decode one token for every request of ``batch`` (one engine step); return the ids
        that finished early (e.g. produced EOS). When it raises, the engine step must not have
        been committed (abort it): the loop then takes the step back.

        An executor that keeps per-request state may also define ``revert_admission(ids)``:
        the loop calls it after taking those admissions back, to forget what ``prefill``
        recorded for them."""
        raise NotImplementedError

    def tokens_served(self, request_id: object) -> int:
        """Tokens the last :meth:`run` gave ``request_id`` of its batch: one by default; a
        speculative executor commits several (or none, for a request it found already done)."""
        return 1

    def run(
        self, batch: Sequence, chunks: Sequence[tuple[object, int]]
    ) -> tuple[Collection, Collection]:
        """One step: import ``chunks`` and decode one token for ``batch`` (disjoint); returns
        ``(done at prefill, done early)`` as :meth:`prefill` and :meth:`decode` say."""
        done = set(self.prefill(chunks) or ()) if chunks else set()
        return done, (self.decode(batch) if batch else ())


@dataclass(frozen=True)
class LoopStep:
    """What one step of the loop did."""

    step: int
    admitted: tuple
    rejected: tuple
    batch: tuple  # what the scheduler planned
    served: tuple  # what decoded a token
    prefilled: tuple  # what imported prompt tokens (a chunk of its prompt, or all of it)
    stuck: tuple  # batch requests that found no block (baseline policies only)
    cancelled: tuple  # victims the policy cancelled to unblock others
    finished: tuple
    waiting: int  # after the step
    active: int
    free_blocks: int
    max_service_wait: int  # longest any active request has now gone undecoded (steps)
    schedule_s: float  # snapshot + plan + apply
    run_s: float  # the executor's prompt chunks and decode
    rejection_reasons: tuple[str, ...] = ()  # why each of ``rejected`` can never run
    swapped: tuple = ()  # running requests swapped out before the plan (preemption by swap)

    @property
    def changed(self) -> bool:
        """Whether the step moved anything (no change for long = a deadlock)."""
        return bool(
            self.admitted
            or self.rejected
            or self.served
            or self.prefilled
            or self.cancelled
            or self.swapped
        )


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
        max_step_tokens: int | None = None,
        preemption: SwapPreemption | None = None,
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
        # tokens one step brings at most, decode tokens first (None: whole prompts each step)
        if max_step_tokens is not None:
            check_positive_int("max_step_tokens", max_step_tokens)
        self.max_step_tokens = max_step_tokens
        # swaps running requests out for a waiting one the pool is short for (None: never)
        self.preemption = preemption
        # admitted requests whose prompt is not all imported yet -> tokens left, in admission
        # order (they are active but do not decode until their prompt is in)
        self._prompt_left: dict = {}
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

    def importing(self, request_id: object) -> bool:
        """Whether ``request_id`` is admitted with prompt tokens still to import."""
        return request_id in self._prompt_left

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        return not self._live

    @property
    def num_live(self) -> int:
        return len(self._live)

    def is_live(self, request_id: object) -> bool:
        """Whether ``request_id`` was submitted and is not terminal yet (O(1))."""
        try:
            return request_id in self._live
        except TypeError:  # unhashable: never submitted
            return False

    @property
    def live_ids(self) -> frozenset:
        """Submitted requests that are not terminal yet."""
        return frozenset(self._live)

    def rejection_reason(self, spec: RequestSpec) -> str | None:
        """Why the scheduler would reject ``spec`` on this pool (it could never run: the
        scheduler's own rule, naming the blocks it needs and the blocks there are), or None.
        Changes nothing; costs one scheduling snapshot (O(active))."""
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(spec).__name__}")
        snapshot = self.engine.scheduling_snapshot(self.step_index)
        prefixes = snapshot.prefix_map
        if snapshot.groups:
            needs = lifetime_private_blocks_by_group(spec, snapshot.group_shapes, prefixes)
            row = WaitingRequest(spec.request_id, spec, needs[0], 0, 0, needs)
        else:
            blocks = lifetime_private_blocks(spec, snapshot.block_size, prefixes)
            row = WaitingRequest(spec.request_id, spec, blocks)
        return rejection_reason(row, snapshot, self.scheduler.config)

    # ------------------------------------------------------------------ one step
    def step(self) -> LoopStep:
        """One step. A step that raises before its decode is committed — in the policy, an
        admission (its host tier copies), a prompt import or the decode itself (a
        KeyboardInterrupt, a model error) — leaves every request as it found it: its admissions
        and rejections are taken back (an imported prompt with them; an admission that raised
        takes back its own), the counters are unchanged, and stepping on gives what an
        uninterrupted run gives. Only the victims a baseline policy cancelled and the requests
        swapped out stay so."""
        engine, cache = self.engine, self.engine.cache
        submissions = engine.submissions
        index = self.step_index
        start = time.perf_counter()
        snapshot = submissions.scheduling_snapshot(index)
        swapped = () if self.preemption is None else self.preemption.before_step(self, snapshot)
        if swapped:  # committed on their own: they wait again, with their tokens
            snapshot = submissions.scheduling_snapshot(index)
        decision = self.scheduler.plan(snapshot)
        if self.on_plan is not None:
            self.on_plan(snapshot, decision)
        submissions.apply_trusted_decision(decision)
        scheduled = time.perf_counter()
        victims: list = []
        try:
            # prompts still to import: earlier admissions first, then this step's
            prompt_left = dict(self._prompt_left)
            for rid in decision.admit:
                spec = submissions.request_spec(rid)
                missing = spec.initial_context_tokens - cache.seq_len(rid)  # a prefix covers all
                if missing > 0:
                    prompt_left[rid] = missing
            batch = [rid for rid in decision.batch if rid not in prompt_left]
            chunks = self._chunks(prompt_left, len(batch))
            stuck, victims = self._unblock(batch, index, chunks)
            served = [rid for rid in batch if rid not in stuck and rid not in victims]
            t0 = time.perf_counter()
            done_at_prefill, done_early = self.executor.run(served, chunks)
            done_at_prefill = set(done_at_prefill)
            run_s = time.perf_counter() - t0
        except BaseException:
            self._take_back(decision, victims)
            raise

        for rid, n in chunks:
            prompt_left[rid] -= n
            if not prompt_left[rid]:
                del prompt_left[rid]
        self._prompt_left = prompt_left
        # the decode is committed: from here on the step only records what happened
        self._forget(decision.reject)
        finished = [rid for rid, _ in chunks if rid in done_at_prefill]
        for rid in served:
            self.generated[rid] += self.executor.tokens_served(rid)
            limit = submissions.request_spec(rid).max_new_tokens
            if rid in done_early or self.generated[rid] >= limit:
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
        submissions.advance_fairness(
            decision,
            served={*served, *(rid for rid, _ in chunks)},
            departed=[*finished, *victims],
        )
        if self.check_invariants:
            cache.validate_invariants()
        self.step_index += 1
        active = len(snapshot.active) + len(decision.admit) - len(finished) - len(victims)
        config = self.scheduler.config
        waiting = snapshot.waiting_view
        return LoopStep(
            step=index,
            admitted=decision.admit,
            rejected=decision.reject,
            batch=decision.batch,
            served=tuple(served),
            prefilled=tuple(rid for rid, _ in chunks),
            stuck=tuple(stuck),
            cancelled=tuple(victims),
            finished=tuple(finished),
            waiting=len(snapshot.waiting) - len(decision.admit) - len(decision.reject),
            active=active,
            free_blocks=cache.num_free_blocks,
            max_service_wait=submissions.max_service_wait(),
            schedule_s=scheduled - start,
            run_s=run_s,
            rejection_reasons=tuple(
                rejection_reason(waiting.get(rid), snapshot, config) or "it can never run"
                for rid in decision.reject
            ),
            swapped=swapped,
        )

    def _forget(self, rids: Iterable) -> None:
        """Drop what the loop keeps of requests that became terminal."""
        for rid in rids:
            self._live.discard(rid)
            self.generated.pop(rid, None)
            self._prompt_left.pop(rid, None)
            if self.preemption is not None:
                self.preemption.forget(rid)

    def _chunks(self, prompt_left: dict, num_decoding: int) -> list[tuple[object, int]]:
        """This step's prompt chunks ``(request, tokens)``, in admission order: what
        ``max_step_tokens`` leaves after the decode tokens (at least one prompt token, so a
        full batch never starves the prompts), each within the engine's per-step limit."""
        budget = self.max_step_tokens
        budget = None if budget is None else max(1, budget - num_decoding)
        limit = self.engine.max_tokens_per_request_step
        chunks = []
        for rid, left in prompt_left.items():
            take = left if limit is None else min(left, limit)
            if budget is not None:
                take = min(take, budget)
                budget -= take
            if take:
                chunks.append((rid, take))
            if budget == 0:
                break
        return chunks

    def _take_back(self, decision: SchedulerDecision, victims: list) -> None:
        """Undo a step that failed before its decode committed (the executor aborted its
        transaction): its decision is reverted and the executor forgets what it recorded for
        the requests admitted (``revert_admission``, when it has one)."""
        self.engine.submissions.revert_decision(decision)
        forget = getattr(self.executor, "revert_admission", None)
        if forget is not None and decision.admit:
            forget(decision.admit)
        self._forget(victims)  # cancelled for good

    def _unblock(self, batch: list, step: int, chunks: list) -> tuple[list, list]:
        """Requests of ``batch`` that cannot get their next block once the prompt ``chunks``
        have theirs, after the policy's victims; a request is stuck when some KV group has no
        block for it (each group's pool serves the batch in batch order).

        Under the lifetime policy every admitted request's blocks are set aside, so this never
        finds one; the greedy and cancel baselines can run dry at a block boundary.
        """
        engine, cache = self.engine, self.engine.cache
        shapes = engine.group_shapes or ((cache.block_size, None),)
        groups = range(len(shapes))
        taken = [  # by the prompt chunks, in each group
            sum(reserved_blocks(cache.seq_len(rid), n, *shapes[g]) for rid, n in chunks)
            for g in groups
        ]
        lens = {rid: cache.seq_len(rid) for rid in batch}

        def free(g: int) -> int:  # read live: cancelling a victim frees blocks
            return max(0, cache.layout.group_free_blocks(g) - taken[g])

        def needing_in(g: int, ids: list) -> list:
            bs, window = shapes[g]
            return [rid for rid in ids if needs_new_block(lens[rid], bs, window)]

        if all(len(needing_in(g, batch)) <= free(g) for g in groups):
            return [], []
        needing = [rid for rid in batch if any(needing_in(g, [rid]) for g in groups)]
        victims = list(self.scheduler.select_victims(engine.scheduling_snapshot(step), needing))
        for rid in victims:
            engine.cancel_request(rid)
        left = [rid for rid in batch if rid not in victims]
        stuck = set()
        for g in groups:
            stuck.update(needing_in(g, left)[free(g) :])
        return [rid for rid in left if rid in stuck], victims

    # ------------------------------------------------------------------ running and stopping
    def cancel(self, request_id: object) -> None:
        """Cancel a live request, waiting or running (mid-prompt too): its blocks are free when
        this returns. ValueError for a request that is not live."""
        if not self.is_live(request_id):
            raise ValueError(f"request {request_id!r} is not live (unknown or already ended)")
        self.engine.cancel_request(request_id)
        self._forget([request_id])

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
        if self.preemption is not None:
            for rid in self._live:
                self.preemption.forget(rid)
        self._live.clear()
        self._prompt_left.clear()
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
