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

A step where no request of the batch drafts is a plain decode step (CUDA graphs, tokens read a
step late): a request that never matches costs, after its first few steps, only its rare
retries.
"""

from __future__ import annotations

from flashdec._checks import check_positive_int


class DraftController:
    """Per-request draft budgets for a speculative runner (see the module's rules)."""

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
