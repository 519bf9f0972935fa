"""Properties of WaitingQueue-driven scheduling against the scanning oracle.

A state machine submits, cancels, re-submits, advances and runs whole scheduling rounds on a
``WaitingQueue`` and on a plain model of it. Every round plans each policy on a snapshot built on
the queue's view and compares it with ``reference_plan`` on the equal tuple-built snapshot; the
engine's step (remove the admitted and rejected, ``advance``) must leave the counters that
``advance_fairness_counters`` computes; every view taken stays what it was.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flashdec.scheduler import (
    POLICIES,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
    SchedulingSnapshot,
    WaitingQueue,
    WaitingRequest,
    advance_fairness_counters,
    lifetime_private_blocks,
    make_scheduler,
)
from tests.profiles import examples
from tests.scheduler.reference_policy import reference_plan
from tests.scheduler.strategies import active_row

pool_configs = st.builds(
    SchedulerConfig,
    max_active_requests=st.integers(1, 12),
    max_batch_size=st.integers(1, 8),
    reserve_blocks=st.integers(0, 3),
    aging_threshold=st.one_of(st.none(), st.integers(0, 4)),
)


class QueueMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8, 16]),
        prefix_blocks=st.lists(st.integers(0, 3), max_size=3),
    )
    def setup(self, block_size, prefix_blocks):
        self.bs = block_size
        self.prefixes = tuple(
            PrefixInfo(f"p{i}", nb, nb * block_size, 0) for i, nb in enumerate(prefix_blocks)
        )
        self.pmap = {p.prefix_id: p for p in self.prefixes}
        self.queue = WaitingQueue()
        self.model: dict = {}  # rid -> [spec, wait_steps, skip_count]
        self.active: dict = {}  # rid -> [spec, committed_tokens, service_wait_steps]
        self.cancelled: list = []  # ids that left the queue unadmitted: may come back
        self.next_id = 0
        self.orders: set = set()  # never reused, so active and waiting orders stay distinct
        self.history: list = []  # (view, the rows it held)

    # ------------------------------------------------------------------ helpers
    def _order(self, wanted):
        while wanted in self.orders:
            wanted += 1
        self.orders.add(wanted)
        return wanted

    def _spec(self, rid, ctx, new, order, prefix_pick):
        pid = None
        if prefix_pick == 1 and self.prefixes:
            prefix = self.prefixes[(ctx + new) % len(self.prefixes)]
            pid, ctx = prefix.prefix_id, prefix.num_tokens  # covers its context
        elif prefix_pick == 2 and self.prefixes:
            pid = self.prefixes[new % len(self.prefixes)].prefix_id  # may not cover
        elif prefix_pick == 3:
            pid = "ghost"  # never resident
        return RequestSpec(rid, ctx, new, self._order(order), pid)

    def _submit(self, spec):
        self.queue.submit(spec, block_size=self.bs, prefixes=self.prefixes)
        self.model[spec.request_id] = [spec, 0, 0]

    def _expected(self):
        rows = sorted(self.model.values(), key=lambda m: m[0].submission_order)
        return tuple(
            WaitingRequest(
                spec.request_id,
                spec,
                lifetime_private_blocks(spec, self.bs, self.pmap),
                wait,
                skip,
            )
            for spec, wait, skip in rows
        )

    def _step_model(self, newest):
        for m in self.model.values():
            m[1] += 1
            if newest is not None and m[0].submission_order < newest:
                m[2] += 1

    # ------------------------------------------------------------------ rules
    @rule(
        ctx=st.integers(0, 40),
        new=st.integers(1, 40),
        order=st.integers(0, 400),
        prefix_pick=st.integers(0, 3),
    )
    def submit(self, ctx, new, order, prefix_pick):
        self.next_id += 1
        self._submit(self._spec(f"r{self.next_id}", ctx, new, order, prefix_pick))

    @rule(count=st.integers(10, 300), seed=st.integers(0, 2**16))
    def submit_many(self, count, seed):
        rng = random.Random(seed)
        for _ in range(count):
            self.next_id += 1
            spec = self._spec(
                self.next_id,  # int ids too
                rng.randint(0, 64),
                rng.randint(1, 64),
                rng.randint(0, 4000),
                rng.choice([0, 0, 0, 1, 2, 3]),
            )
            self._submit(spec)

    @precondition(lambda self: self.cancelled)
    @rule(data=st.data())
    def resubmit(self, data):
        rid = data.draw(st.sampled_from(self.cancelled))
        self.cancelled.remove(rid)
        self._submit(self._spec(rid, 4, 4, data.draw(st.integers(0, 400)), 0))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model, key=str)))
        assert self.queue.remove(rid) == self.model.pop(rid)[0]
        self.cancelled.append(rid)

    @rule(newest=st.one_of(st.none(), st.integers(0, 4100)))
    def advance(self, newest):
        self.queue.advance(newest)
        self._step_model(newest)

    @rule(
        config=pool_configs,
        free=st.integers(0, 40),
        hidden=st.integers(0, 2),
        width=st.integers(1, 40),
        policy=st.sampled_from(sorted(POLICIES)),
        data=st.data(),
    )
    def round(self, config, free, hidden, width, policy, data):
        act = tuple(active_row(s, self.bs, self.prefixes, t, w) for s, t, w in self.active.values())
        used = sum(p.num_blocks for p in self.prefixes) + sum(
            r.committed_private_blocks for r in act
        )
        total = max(1, used + free + hidden)
        fields = {
            "step": 0,
            "cache_version": 0,
            "block_size": self.bs,
            "total_blocks": total,
            "free_blocks": free,
            "max_blocks_per_seq": width,
            "prefixes": self.prefixes,
            "active": act,
        }
        on_view = SchedulingSnapshot(**fields, waiting=self.queue.view())
        on_tuple = SchedulingSnapshot(**fields, waiting=self._expected())
        assert on_view == on_tuple
        for name in POLICIES:
            planned = make_scheduler(name, config).plan(on_view)
            expected = reference_plan(name, on_tuple, config)
            assert (planned.admit, planned.reject, planned.batch) == (
                expected.admit,
                expected.reject,
                expected.batch,
            )
            assert planned == expected
        decision = reference_plan(policy, on_tuple, config)
        # the step: the batch decodes one token each; finished ones depart
        finished = []
        for rid in decision.batch:
            row = self.active.get(rid)
            if row is None:
                spec = self.model[rid][0]
                row = self.active[rid] = [spec, spec.initial_context_tokens, 0]
            row[1] += 1
            if row[1] == row[0].total_tokens:
                finished.append(rid)
        for rid in decision.admit:
            if rid not in self.active:
                spec = self.model[rid][0]
                self.active[rid] = [spec, spec.initial_context_tokens, 0]
        counters = advance_fairness_counters(on_tuple, decision, departed_ids=finished)
        # what the engine does with the queue
        for rid in decision.admit + decision.reject:
            self.queue.remove(rid)
            del self.model[rid]
        admitted = [on_tuple.waiting_view.get(rid).spec.submission_order for rid in decision.admit]
        self.queue.advance(max(admitted, default=None))
        self._step_model(max(admitted, default=None))
        view = self.queue.view()
        assert tuple((r.request_id, r.wait_steps) for r in view) == counters.waiting_wait_steps
        assert tuple((r.request_id, r.skip_count) for r in view) == counters.waiting_skip_counts
        for rid in finished:
            del self.active[rid]
        for rid, wait in counters.active_service_wait_steps:
            if rid in self.active:
                self.active[rid][2] = wait

    # ------------------------------------------------------------------ invariants
    @invariant()
    def queue_equals_model(self):
        if not hasattr(self, "queue"):
            return
        view, expected = self.queue.view(), self._expected()
        assert view == expected and len(self.queue) == len(expected)
        self.history.append((view, expected))

    def teardown(self):
        for view, expected in getattr(self, "history", []):
            assert view == expected and tuple(view) == expected
            for i, row in enumerate(expected):
                assert view.has_id(row.request_id) and view.position(row.request_id) == i
                assert view.get(row.request_id) == row
            for rid in self.cancelled[:5]:
                assert view.has_id(rid) == any(r.request_id == rid for r in expected)


QueueMachine.TestCase.settings = settings(
    max_examples=examples(60, ci=15), stateful_step_count=25, deadline=None
)
TestWaitingQueueScheduling = pytest.mark.large(QueueMachine.TestCase)


def test_large_queue_rounds_match_the_oracle():
    """A few thousand waiting requests, most too large to fit now, some aged, 64 active."""
    rng = random.Random(7)
    bs = 16
    prefixes = (PrefixInfo("sys", 8, 128, 0),)
    queue = WaitingQueue()
    for i in range(3000):
        pid = "sys" if i % 9 == 0 else None
        ctx = 128 if pid else rng.randint(1, 3000)
        queue.submit(
            RequestSpec(i, ctx, rng.randint(1, 600), i, pid), block_size=bs, prefixes=prefixes
        )
    for k in range(40):  # early arrivals overtaken: some become aged
        queue.advance(2000 + k)
    active = tuple(
        active_row(RequestSpec(f"a{i}", 64, 256, 10_000 + i), bs, prefixes, 100 + i)
        for i in range(64)
    )
    used = 8 + sum(r.committed_private_blocks for r in active)
    for free in (0, 30, 300, 3000):
        fields = {
            "step": 0,
            "cache_version": 0,
            "block_size": bs,
            "total_blocks": used + free,
            "free_blocks": free,
            "max_blocks_per_seq": 200,
            "prefixes": prefixes,
            "active": active,
        }
        on_view = SchedulingSnapshot(**fields, waiting=queue.view())
        on_tuple = SchedulingSnapshot(**fields, waiting=tuple(queue.view()))
        for policy in POLICIES:
            for aging in (None, 0, 8, 30):
                config = SchedulerConfig(96, 64, reserve_blocks=4, aging_threshold=aging)
                planned = make_scheduler(policy, config).plan(on_view)
                assert planned == reference_plan(policy, on_tuple, config)
