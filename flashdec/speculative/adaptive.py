"""Adaptivity: how many drafts each request brings, and when a step speculates at all.

Rules (all host-side and deterministic, so they are testable without a GPU):

- A step speculates only while its decode batch has at most ``max_batch`` requests: a large
  batch already keeps the GPU busy, and verifying ``n`` tokens per request multiplies its work.
- Each request keeps an exponential moving average ``ema`` of its acceptance (accepted /
  drafted per verification; a lookup that found no draft counts as 0), starting at 1. It
  drafts ``max(1, round(num_tokens * ema))`` tokens.
- When ``ema`` falls below ``off_below`` the request stops drafting for ``cooldown * 2**s``
  steps (``s``: how many times in a row it was switched off, at most ``max_backoff``), then
  tries again from ``ema = retry_ema``. An accepted draft resets ``s``.
- Whatever the acceptance, a batch size whose verification steps give fewer tokens per second
  than plain steps (measured: :class:`SpeculationGate`) stops speculating for a cooldown.

A step where no request of the batch drafts is a plain decode step (CUDA graphs, tokens read a
step late): a request that never matches costs, after its first few steps, only its rare
retries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flashdec._checks import check_positive_int


class DraftController:
    """Per-request draft budgets for a speculative runner (see the module's first three
    rules)."""

    def __init__(
        self,
        num_tokens: int,
        *,
        max_batch: int = 32,
        alpha: float = 0.3,
        off_below: float = 0.1,
        cooldown: int = 16,
        retry_ema: float = 0.5,
        max_backoff: int = 4,
    ) -> None:
        self.num_tokens = check_positive_int("num_tokens", num_tokens)
        self.max_batch = check_positive_int("max_batch", max_batch)
        self.alpha = alpha
        self.off_below = off_below
        self.cooldown = check_positive_int("cooldown", cooldown)
        self.retry_ema = retry_ema
        self.max_backoff = max_backoff
        self._state: dict = {}  # request id -> [ema, steps off left, times off in a row]

    def _of(self, rid) -> list:
        state = self._state.get(rid)
        if state is None:
            state = self._state[rid] = [1.0, 0, 0]
        return state

    def speculates(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` decoding requests may speculate at all."""
        return 0 < batch_size <= self.max_batch

    def budget(self, rid) -> int:
        """Drafts ``rid`` may bring to this step (0: it is switched off for now)."""
        ema, off, _ = self._state.get(rid) or (1.0, 0, 0)
        if off:
            return 0
        return max(1, min(self.num_tokens, round(self.num_tokens * ema)))

    def update(self, rid, drafted: int, accepted: int) -> None:
        """After a step in which ``rid`` had a budget: it drafted ``drafted`` tokens (0: the
        lookup found none) and ``accepted`` of them were accepted."""
        state = self._of(rid)
        observed = accepted / drafted if drafted else 0.0
        state[0] += self.alpha * (observed - state[0])
        if accepted:
            state[2] = 0
        if state[0] < self.off_below:
            state[1] = self.cooldown << min(state[2], self.max_backoff)
            state[2] += 1
            state[0] = self.retry_ema

    def tick(self, rid) -> None:
        """After a step in which ``rid`` decoded: a switched-off request is one step nearer
        to trying again."""
        state = self._state.get(rid)
        if state is not None and state[1]:
            state[1] -= 1

    def forget(self, rid) -> None:
        self._state.pop(rid, None)


@dataclass
class _Rate:
    """Moving averages of one kind of step's wall time and of the tokens a request got from
    it. Its cost per token is their ratio: the average of per-step ratios would overstate a
    kind whose tokens per step vary (1/x is convex: steps of 1 and 5 tokens average 0.6 of
    a step per token, not 1/3)."""

    seconds: float = 0.0
    tokens: float = 0.0  # per request
    samples: int = 0

    @property
    def cost(self) -> float:
        """Seconds per token a request gets."""
        return self.seconds / self.tokens

    def add(self, seconds: float, tokens: float, alpha: float) -> None:
        if self.samples == 0:
            self.seconds, self.tokens = seconds, tokens
        else:
            self.seconds += alpha * (seconds - self.seconds)
            self.tokens += alpha * (tokens - self.tokens)
        self.samples += 1


@dataclass
class _BucketCosts:
    """What the gate knows of one batch-size bucket."""

    plain: _Rate = field(default_factory=_Rate)
    verify: _Rate = field(default_factory=_Rate)
    off: int = 0  # steps left with speculation held off
    backoff: int = 0  # times in a row it was held off
    since_plain: int = 0  # verification steps since the last plain sample


class SpeculationGate:
    """Whether speculating pays, by measurement: speculation is held off, per batch-size
    bucket (powers of two), while its tokens per second fall below ``min_speedup`` times plain
    decoding's.

    Why measured: a verification round waits for its acceptance on the host before the next
    step launches, while plain decoding overlaps the host with the GPU. On a small model (a
    short step) that wait can cost more than the accepted drafts save, whatever the acceptance
    rate, so acceptance alone (:class:`DraftController`) cannot tell.

    - A step's wall time runs from its start to the next step's start (the whole loop's
      cycle: plain steps are pipelined, so a plain step's own call is not its cost). Each kind
      keeps moving averages of that time and of the tokens a request got; its cost is seconds
      per token, their ratio. The first step after a switch between plain and verification is
      not counted (it pays for, or skips, the other kind's wait), nor is a step that took more
      than ``max_outlier`` times its kind's average (a pause between calls), nor a step that
      carried prompt chunks (the runner reports it with ``requests = 0``).
    - After ``min_samples`` verification steps of a bucket without a plain measurement, the
      gate runs ``min_samples + 1`` plain steps to take one; every ``refresh`` verification
      steps it takes one again (batch composition drifts).
    - With both measured, verification costing more than plain / ``min_speedup`` holds
      speculation off for ``cooldown * 2**s`` steps (``s``: times in a row, at most
      ``max_backoff``); then it is measured afresh. A verification measurement that wins
      resets ``s``.

    ``clock`` is injectable so that the rules are testable without timing anything.
    """

    def __init__(
        self,
        min_speedup: float = 1.0,
        *,
        alpha: float = 0.25,
        min_samples: int = 6,
        cooldown: int = 32,
        max_backoff: int = 4,
        refresh: int = 256,
        max_outlier: float = 4.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.min_speedup = min_speedup
        self.alpha = alpha
        self.min_samples = check_positive_int("min_samples", min_samples)
        self.cooldown = check_positive_int("cooldown", cooldown)
        self.max_backoff = max_backoff
        self.refresh = check_positive_int("refresh", refresh)
        self.max_outlier = max_outlier
        self.clock = clock
        self._buckets: dict[int, _BucketCosts] = {}
        self._start = 0.0  # when the current step started
        self._open: tuple[float, int, int, bool] | None = None  # (start, requests, tokens, kind)
        self._kind: bool | None = None  # the kind of the step before the open one

    def _bucket(self, requests: int) -> _BucketCosts:
        key = max(1, requests).bit_length()
        costs = self._buckets.get(key)
        if costs is None:
            costs = self._buckets[key] = _BucketCosts()
        return costs

    def allows(self, requests: int) -> bool:
        """Whether a step of ``requests`` decoding requests may verify drafts (call once per
        step that could: a False uses up one step of the bucket's hold)."""
        c = self._bucket(requests)
        if c.off == 0 and c.verify.samples >= self.min_samples:
            if c.plain.samples < self.min_samples or c.since_plain >= self.refresh:
                c.plain, c.since_plain = _Rate(), 0  # measure plain decoding (again)
                c.off = self.min_samples + 1
            elif c.verify.cost * self.min_speedup > c.plain.cost:
                c.off = self.cooldown << min(c.backoff, self.max_backoff)
                c.backoff += 1
                c.verify = _Rate()  # measured afresh when it comes back
            else:
                c.backoff = 0
        if c.off:
            c.off -= 1
            return False
        return True

    def started(self) -> None:
        """A step starts: the previous one's wall time is complete."""
        start = self._start = self.clock()
        if self._open is None:
            return
        began, requests, tokens, verified = self._open
        self._open = None
        switched, self._kind = self._kind is not verified, verified
        if switched or requests <= 0 or tokens <= 0:
            return
        c = self._bucket(requests)
        rate = c.verify if verified else c.plain
        elapsed = start - began
        if rate.samples and elapsed > self.max_outlier * rate.seconds:
            return
        rate.add(elapsed, tokens / requests, self.alpha)
        if verified:
            c.since_plain += 1
        else:
            c.since_plain = 0

    def finished(self, requests: int, tokens: int, verified: bool) -> None:
        """The step that :meth:`started` last gave ``tokens`` to ``requests`` decoding
        requests, by verification or plainly (``requests = 0``: a step not to measure)."""
        self._open = (self._start, requests, tokens, verified)
