"""The scheduler-managed requests of one engine: their specs, the waiting queue and the
fairness counters.

:class:`SubmissionQueue` holds what a scheduler plans from beside the cache: each scheduled
request's spec (while it waits or runs), the persistent waiting queue with its wait/skip
counters (a snapshot takes an O(1) view of it), the active requests' service waits, and the
decision applied last (so a failed serving step can take it back). The counters stay zero unless
a :class:`~flashdec.engine.loop.ServingLoop` advances them (``advance_fairness``): the loop owns
the fairness step, the revert and the trusted apply. ``DecodeEngine.submit_request``,
``scheduling_snapshot``, ``apply_scheduler_decision`` (SPEC §5) delegate here.

The request lifecycle stays the engine's (waiting, rejected, cancelled before admission; the
cache for the rest): this queue updates it through the engine when it admits, rejects or takes
back, and every call checks, as the engine's own, that no step is open.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

from flashdec.cache import RequestState
from flashdec.cache.history import IdSet
from flashdec.engine.snapshot import (
    cache_snapshot,
    grouped_active_row,
    one_group_active_row,
    shared_hits,
    snapshot_from_cache,
)
from flashdec.engine.states import EngineRequestState
from flashdec.scheduler import (
    ActiveRequest,
    BlockAwareScheduler,
    PrefixInfo,
    RequestSpec,
    SchedulerDecision,
    SchedulingSnapshot,
    WaitingQueue,
    WaitingView,
    counters_of,
)


class SubmissionQueue:
    """Scheduler-managed requests of one :class:`DecodeEngine` (its ``submissions``)."""

    def __init__(self, engine) -> None:
        # engine: the DecodeEngine whose lifecycle this updates (not imported: engine.py
        # imports this module)
        self._engine = engine
        self._cache = engine.cache
        self._specs: dict[Any, RequestSpec] = {}  # scheduler-managed, waiting or active
        self._orders = IdSet()  # submission orders ever used (never reused, like ids)
        # scheduler-managed waiting requests with their wait/skip counters (a persistent
        # structure: a snapshot takes an O(1) view) and the active ones' service-wait counters;
        # both stay zero unless a ServingLoop advances them (advance_fairness)
        self._queue = WaitingQueue()
        self._service_wait: dict[Any, int] = {}
        self._active_rows: dict[Any, ActiveRequest] = {}  # reused while a request is unchanged
        # the decision applied last and the queue before it, while revert_decision may undo it
        self._applied: tuple[SchedulerDecision, Any] | None = None
        # automatic prefix caching: a waiting request's prompt block hashes (its submitter's,
        # cache.prefix_cache.block_hashes); at admission it starts with the cached run they match
        self.block_hashes: dict[Any, list[bytes]] = {}
        # generated text cached at finish: each request's prompt tokens after its last full
        # block (remember_prompt), and where its generated token ids are read when it finishes
        # (its submitter's: flashdec.LLM reads ModelRunner.requests[rid].tokens)
        self.prompt_tails: dict[Any, list[int]] = {}
        self.generated_tokens: Callable[[Any], Sequence[int]] | None = None

    @property
    def specs(self) -> Mapping[Any, RequestSpec]:
        """Every waiting or active scheduler-managed request's spec (read-only use)."""
        return self._specs

    def remove(self, request_id) -> None:
        """Take a request that leaves the waiting state (admitted, rejected, cancelled) out of
        the queue."""
        self._queue.remove(request_id)

    def forget(self, request_id) -> None:
        """Drop what is kept of a request that just became terminal."""
        self._specs.pop(request_id, None)
        self.block_hashes.pop(request_id, None)
        self.prompt_tails.pop(request_id, None)
        self._service_wait.pop(request_id, None)
        self._active_rows.pop(request_id, None)

    def remember_prompt(self, request_id, token_ids: Sequence[int]) -> None:
        """Keep what automatic prefix caching needs of a request about to be submitted: its
        prompt's block hashes (looked up at admission) and the tokens after its last full
        block (with its generated ones they make the blocks cached when it finishes)."""
        hashes = self._cache.prefix_cache.block_hashes(token_ids)
        self.block_hashes[request_id] = hashes
        self.prompt_tails[request_id] = list(token_ids[len(hashes) * self._cache.block_size :])

    def cache_finished_blocks(self, request_id) -> None:
        """Before an active request finishes: extend its block hashes over the full blocks of
        its prompt + generated tokens that the cache holds (those the host has read), so the
        finish keeps them cached — a next chat turn that repeats the answer hits through it.
        Does nothing without ``generated_tokens``, block hashes or a prompt tail."""
        source, cache = self.generated_tokens, self._cache
        known = self.block_hashes.get(request_id)
        tail = self.prompt_tails.get(request_id)
        spec = self._specs.get(request_id)
        if (
            source is None
            or known is None
            or tail is None
            or spec is None
            or spec.prefix_id is not None
        ):
            return  # not looked up by its hashes (a caller-built prefix's request keeps none)
        bs = cache.block_size
        # only tokens whose K/V the cache holds (a request's last token has none)
        held = cache.seq_len(request_id) - len(known) * bs
        tokens = [*tail, *source(request_id)][: max(held, 0)]
        if len(tokens) < bs:
            return
        parent = known[-1] if known else None
        more = cache.prefix_cache.block_hashes(tokens, parent=parent)
        cache.prefix_cache.cache_request_blocks(request_id, [*known, *more])

    def preempt(self, request_id, spec: RequestSpec, context: Sequence[int]) -> None:
        """Swap the active request ``request_id`` out and let it wait again as ``spec``: its
        context is now ``context`` (its prompt and the tokens it generated), whose full blocks
        stay cached (``cache_finished_blocks``; with a host tier they move there as the pool
        needs them), so that its admission resumes from them and recomputes only the rest.

        ``spec`` keeps the id, takes an unused submission order and covers ``context``;
        checked before anything changes."""
        engine = self._engine
        engine._require_no_open_step("preempt")
        engine._require_state(request_id, EngineRequestState.ACTIVE, "preempt")
        old = self._specs.get(request_id)
        if old is None or old.prefix_id is not None or request_id not in self.block_hashes:
            raise RuntimeError(
                f"request {request_id!r} cannot be swapped: only a scheduler-managed request "
                "looked up by its block hashes resumes from the prefix cache"
            )
        if not isinstance(spec, RequestSpec) or spec.request_id != request_id:
            raise ValueError(f"spec must be a RequestSpec of request {request_id!r}")
        if spec.initial_context_tokens != len(context) or spec.prefix_id is not None:
            raise ValueError("spec must cover the context exactly, without a prefix")
        if spec.submission_order in self._orders:
            raise ValueError(f"submission_order {spec.submission_order} is already used")
        self.cache_finished_blocks(request_id)  # its generated blocks join its hash chain
        self._cache.prefix_cache.preempt_request(request_id)
        self._service_wait.pop(request_id, None)
        self._active_rows.pop(request_id, None)
        self.remember_prompt(request_id, context)
        self._queue.submit(
            spec,
            block_size=engine._block_size,
            prefixes=self._prefix_infos(),
            group_shapes=engine.group_shapes,
        )
        self._orders.add(spec.submission_order)
        self._specs[request_id] = spec
        engine._waiting[request_id] = spec

    def submit_request(self, spec: RequestSpec) -> None:
        """Queue a scheduler-managed request; the scheduler admits or rejects it later.

        A request with a prefix needs that prefix resident now, covering its whole context.
        """
        self._engine._require_no_open_step("submit_request")
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(spec).__name__}")
        self._engine._check_new_id(spec.request_id, "scheduled")
        if spec.prefix_id is not None:
            if spec.prefix_id not in self._cache.prefix_ids():
                raise ValueError(
                    f"prefix {spec.prefix_id!r} must be registered before requests use it"
                )
            num_tokens = self._cache.prefix_state(spec.prefix_id).num_tokens
            if spec.initial_context_tokens != num_tokens:
                raise ValueError(
                    f"a prefix request's context must be its prefix: prefix {spec.prefix_id!r} "
                    f"holds {num_tokens} tokens, spec says {spec.initial_context_tokens}"
                )
        if spec.submission_order in self._orders:
            raise ValueError(f"submission_order {spec.submission_order} is already used")
        # the queue checks the order against every waiting request and takes the lifetime
        # geometry of the resident prefixes (which cannot change while anything waits)
        self._queue.submit(
            spec,
            block_size=self._engine._block_size,
            prefixes=self._prefix_infos(),
            group_shapes=self._engine.group_shapes,
        )
        self._engine._mode = "scheduled"
        self._orders.add(spec.submission_order)
        self._specs[spec.request_id] = spec
        self._engine._waiting[spec.request_id] = spec

    def request_spec(self, request_id: object) -> RequestSpec:
        """The spec of a waiting or active scheduler-managed request (a terminal request's
        is not kept)."""
        state = self._engine.request_state(request_id)
        spec = self._specs.get(request_id)
        if spec is None:
            if self._engine._mode == "scheduled":  # every request is then: this one is terminal
                raise ValueError(
                    f"request {request_id!r} is {state.value}: only a waiting or active "
                    "request's spec is kept"
                )
            raise ValueError(f"request {request_id!r} is not scheduler-managed")
        return spec

    def scheduling_snapshot(
        self,
        step: int,
        waiting_wait_steps: Mapping | None = None,
        waiting_skip_counts: Mapping | None = None,
        active_service_wait_steps: Mapping | None = None,
    ) -> SchedulingSnapshot:
        """K/V-free metadata for the scheduler, read from the live cache.

        Without counter arguments the snapshot carries this queue's own counters (zero unless a
        :class:`ServingLoop` advances them) and costs O(active requests): the waiting queue is
        an O(1) view of a persistent structure. Explicit counters build every row (O(waiting)).
        """
        self._engine._require_no_open_step("scheduling_snapshot")
        if (
            waiting_wait_steps is None
            and waiting_skip_counts is None
            and (active_service_wait_steps is None)
        ):
            return self._own_snapshot(step)
        return snapshot_from_cache(
            self._cache,
            step=step,
            specs=self._specs,
            waiting_ids=[rid for rid, spec in self._engine._waiting.items() if spec is not None],
            active_ids=self._scheduled_active_ids(),
            waiting_wait_steps=waiting_wait_steps,
            waiting_skip_counts=waiting_skip_counts,
            active_service_wait_steps=active_service_wait_steps,
            block_hashes=self.block_hashes,
        )

    def _prefix_infos(self) -> tuple[PrefixInfo, ...]:
        cache = self._cache
        states = (cache.prefix_state(pid) for pid in cache.prefix_ids())
        return tuple(
            PrefixInfo(p.prefix_id, p.num_blocks, p.num_tokens, p.refcount) for p in states
        )

    def _own_snapshot(self, step: int) -> SchedulingSnapshot:
        """The snapshot with this queue's counters, in O(active): rows of unchanged active
        requests are reused (equal snapshots then compare element by identity). A cache with
        KV layer groups (or one window group) gets every group's pool and each request's
        blocks per group."""
        cache, specs, shapes = self._cache, self._specs, self._engine.group_shapes
        prefixes = self._prefix_infos()
        prefix_map = {p.prefix_id: p for p in prefixes}
        if shapes:
            make_row = partial(grouped_active_row, cache, shapes, prefix_map)
        else:
            make_row = partial(one_group_active_row, cache, self._engine._block_size, prefix_map)
        rows, cached = [], self._active_rows
        for rid in self._scheduled_active_ids():
            tokens = cache.seq_len(rid)
            wait = self._service_wait.get(rid, 0)
            row = cached.get(rid)
            if row is None or row.committed_tokens != tokens or row.service_wait_steps != wait:
                row = cached[rid] = make_row(specs[rid], tokens, wait)
            rows.append(row)
        waiting = self._engine._waiting
        hits = shared_hits(
            cache, specs, self.block_hashes, [rid for rid in self.block_hashes if rid in waiting]
        )
        return cache_snapshot(
            cache, step, prefixes, tuple(rows), self._queue.view(), grouped=bool(shapes), hits=hits
        )

    def _scheduled_active_ids(self) -> list:
        if self._engine._mode != "scheduled":
            return []
        return self._cache.request_ids(RequestState.ACTIVE)

    def apply_scheduler_decision(
        self,
        decision: SchedulerDecision,
        *,
        scheduler: BlockAwareScheduler,
        snapshot: SchedulingSnapshot,
    ) -> SchedulerDecision:
        """Admit and reject what ``decision`` says, after proving it is current and canonical.

        The snapshot is rebuilt from the live engine (keeping the snapshot's fairness counters)
        and the canonical lifetime policy ``BlockAwareScheduler(scheduler.config)`` is re-run on
        it; the decision must equal that result exactly. Anything else — a stale snapshot, a
        decision from another snapshot or config, an edited or non-canonical decision — is
        rejected before any request is admitted or rejected. Returns the applied decision.
        """
        self._engine._require_no_open_step("apply_scheduler_decision")
        if not isinstance(decision, SchedulerDecision):
            raise TypeError(f"decision must be a SchedulerDecision, got {type(decision).__name__}")
        if not isinstance(scheduler, BlockAwareScheduler):
            raise TypeError(
                f"scheduler must be a BlockAwareScheduler, got {type(scheduler).__name__}"
            )
        if not isinstance(snapshot, SchedulingSnapshot):
            raise TypeError(f"snapshot must be a SchedulingSnapshot, got {type(snapshot).__name__}")
        if decision.snapshot != snapshot:
            raise ValueError("decision was not planned from the given snapshot")
        if decision.config != scheduler.config:
            raise ValueError(
                f"decision was planned with {decision.config}, the scheduler has {scheduler.config}"
            )
        if isinstance(snapshot.waiting, WaitingView):  # built from this engine's own counters
            live = self.scheduling_snapshot(snapshot.step)
        else:
            live = self.scheduling_snapshot(snapshot.step, **counters_of(snapshot).as_kwargs())
        if live != snapshot:
            raise RuntimeError(
                "stale scheduler decision: the engine changed since the snapshot was taken "
                f"(cache version {snapshot.cache_version} -> {live.cache_version})"
            )
        canonical = BlockAwareScheduler(scheduler.config).plan(live)
        if canonical != decision:
            raise ValueError(
                "decision is not the canonical lifetime-policy decision for this snapshot "
                f"(expected admit={canonical.admit}, reject={canonical.reject}, "
                f"batch={canonical.batch}; got admit={decision.admit}, "
                f"reject={decision.reject}, batch={decision.batch})"
            )
        self.apply_trusted_decision(decision)
        return decision

    def apply_trusted_decision(self, decision: SchedulerDecision) -> None:
        """Admit and reject without re-planning: for a decision the caller planned itself from
        a snapshot of this engine taken since its last change (the serving loop's path, also for
        the greedy and cancel baselines). All or nothing: an admission that raises (a host tier
        copy interrupted, say) takes back the ones before it, then the error propagates."""
        self._engine._require_no_open_step("apply_trusted_decision")
        checkpoint = self._queue.checkpoint()
        added = []  # in the cache: each admitted request, and one whose admission raised
        try:
            for rid in decision.admit:
                spec = self._specs[rid]
                self._cache.add_request(rid)
                added.append(rid)
                if spec.prefix_id is not None:
                    self._cache.attach_prefix(rid, spec.prefix_id)
                elif rid in self.block_hashes:
                    hashes = self.block_hashes[rid]
                    self._cache.prefix_cache.attach_cached_prefix(
                        rid, hashes, spec.initial_context_tokens
                    )
                self._engine._leave_queue(rid, None)
            for rid in decision.reject:
                self._engine._leave_queue(rid, EngineRequestState.REJECTED)
        except BaseException:
            self._take_back(decision, checkpoint, added)
            raise
        self._applied = (decision, checkpoint)

    def revert_decision(self, decision: SchedulerDecision) -> None:
        """Take back the decision applied last, for a serving step that failed before it
        decoded anything: its admitted requests leave the cache (with any prompt imported for
        them) and its rejected ones wait again, all with the fairness counters they had.

        RuntimeError (nothing changed) unless ``decision`` is the one applied last, the waiting
        queue has not changed since (no submission, cancellation or ``advance_fairness``) and
        no request it admitted has finished, been cancelled or decoded a token.
        """
        self._engine._require_no_open_step("revert_decision")
        applied = self._applied
        if applied is None or applied[0] is not decision:
            raise RuntimeError(
                "only the decision applied last can be reverted, before the step ends"
            )
        cache, specs = self._cache, self._specs
        for rid in decision.admit:
            context = specs[rid].initial_context_tokens
            if cache.request_state(rid) is not RequestState.ACTIVE or cache.seq_len(rid) > context:
                raise RuntimeError(f"request {rid!r} has moved on since it was admitted")
        self._take_back(decision, applied[1], decision.admit)
        self._applied = None

    def _take_back(self, decision: SchedulerDecision, checkpoint: Any, added: Sequence) -> None:
        """Undo ``decision`` as far as it was applied since the queue's ``checkpoint``: the
        requests ``added`` to the cache leave it, and those that left the queue (admitted or
        rejected) wait again. The queue is restored first: its RuntimeError changes nothing."""
        waiting = self._engine._waiting
        removed = [rid for rid in (*decision.admit, *decision.reject) if rid not in waiting]
        self._queue.restore(checkpoint, removed)
        for rid in added:
            self._cache.discard_request(rid)
            self._service_wait.pop(rid, None)
            self._active_rows.pop(rid, None)
        queued = decision.snapshot.waiting_view
        for rid in decision.reject:  # rejecting forgot the spec: the snapshot still has it
            if rid in removed:
                self._engine._closed.discard(rid)
                self._specs[rid] = queued.get(rid).spec
        for rid in removed:
            waiting[rid] = self._specs[rid]

    def advance_fairness(
        self, decision: SchedulerDecision, served: Collection, departed: Collection
    ) -> None:
        """Move the counters past the step ``decision`` planned (after it was applied): every
        request still waiting waits one step more and counts a skip if a later submission was
        admitted; a served active request's service wait resets, any other's grows. O(log n +
        active). The serving loop calls this; manual scheduling leaves the counters at zero."""
        self._applied = None  # the step is over: its decision can no longer be reverted
        admitted = decision.admit
        # an admitted request may be terminal already (done at its prompt): its spec is then
        # the snapshot's
        specs, waiting = self._specs, decision.snapshot.waiting_view
        newest = max(
            (
                (specs[rid] if rid in specs else waiting.get(rid).spec).submission_order
                for rid in admitted
            ),
            default=None,
        )
        self._queue.advance(newest)
        service = self._service_wait
        for rid in departed:
            service.pop(rid, None)
            self._active_rows.pop(rid, None)
        for rid in self._scheduled_active_ids():
            service[rid] = 0 if rid in served else service.get(rid, 0) + 1

    def max_service_wait(self) -> int:
        """The longest any active request has gone undecoded (steps), as the loop counts."""
        return max(self._service_wait.values(), default=0)
