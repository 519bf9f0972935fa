"""Adaptivity: a request that keeps missing stops drafting for a cooldown that doubles each
time, one that hits keeps its full budget, and a large batch never speculates; a batch size
whose verification steps measure slower than plain ones is held plain (the gate), one where
they pay is not."""

from __future__ import annotations

import itertools

import pytest

from flashdec.speculative import DraftController, SpeculationGate


def test_a_request_that_hits_keeps_its_budget():
    ctl = DraftController(4)
    assert ctl.budget("a") == 4
    for _ in range(50):
        ctl.update("a", 4, 4)
    assert ctl.budget("a") == 4
    ctl.update("a", 4, 2)
    assert 1 <= ctl.budget("a") < 4  # half accepted: fewer drafts


def test_misses_switch_a_request_off_with_a_doubling_cooldown():
    ctl = DraftController(4, cooldown=3)
    misses = 0
    while ctl.budget("a"):
        ctl.update("a", 0, 0)  # the lookup found nothing
        misses += 1
    assert misses == 7  # ema 1 -> 0.7, 0.49, ... < 0.1 after 7 misses
    for _ in range(3):
        assert ctl.budget("a") == 0
        ctl.tick("a")
    assert ctl.budget("a") == 2  # back, from ema 0.5
    while ctl.budget("a"):
        ctl.update("a", 2, 0)
    offs = 0
    while not ctl.budget("a"):
        ctl.tick("a")
        offs += 1
    assert offs == 6  # twice the cooldown: it was switched off twice in a row
    ctl.update("a", 2, 1)  # an accepted draft resets the back-off
    assert ctl._state["a"][2] == 0
    ctl.forget("a")
    assert ctl.budget("a") == 4


def test_large_batches_do_not_speculate():
    ctl = DraftController(4, max_batch=8)
    assert ctl.speculates(1) and ctl.speculates(8)
    assert not ctl.speculates(9) and not ctl.speculates(0)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_budgets_are_rejected(bad):
    with pytest.raises(ValueError):
        DraftController(bad)
    with pytest.raises(TypeError):
        DraftController(2.0)


class _Loop:
    """Drives a gate the way the runner does, on a fake clock: a verification step takes
    ``verify_s`` and gives ``tokens`` per request (a number, or a sequence cycled over the
    verification steps), a plain step ``plain_s`` and one token. Three samples decide."""

    def __init__(self, gate_kwargs=None, *, verify_s=2.0, plain_s=1.0, tokens=3, requests=1):
        self.t = 0.0
        kwargs = {"min_samples": 3, **(gate_kwargs or {})}
        self.gate = SpeculationGate(clock=lambda: self.t, **kwargs)
        self.verify_s, self.plain_s = verify_s, plain_s
        self.tokens = itertools.cycle(tokens if isinstance(tokens, (list, tuple)) else [tokens])
        self.requests = requests
        self.kinds: list[bool] = []

    def step(self, pause: float = 0.0) -> bool:
        self.gate.started()
        verified = self.gate.allows(self.requests)
        self.t += (self.verify_s if verified else self.plain_s) + pause
        tokens = next(self.tokens) if verified else 1
        self.gate.finished(self.requests, tokens * self.requests, verified)
        self.kinds.append(verified)
        return verified

    def run(self, steps: int) -> list[bool]:
        start = len(self.kinds)
        for _ in range(steps):
            self.step()
        return self.kinds[start:]


def test_verification_slower_than_plain_is_held_off_with_a_doubling_cooldown():
    # 3 tokens for 4 s against 1 token a second: verification loses
    loop = _Loop({"cooldown": 5}, verify_s=4.0)
    first = loop.run(4)
    assert first == [True] * 4  # one step unmeasured (the first), then 3 samples
    probe = loop.run(4)
    assert probe == [False] * 4  # plain decoding measured: 1 unmeasured + 3 samples
    held = loop.run(5)
    assert held == [False] * 5  # verification costs 4/3 s a token, plain 1: held 5 steps
    back = loop.run(4)
    assert back == [True] * 4  # measured afresh
    assert loop.run(10) == [False] * 10  # still slower: twice the cooldown


def test_verification_that_pays_keeps_running_and_plain_is_measured_again_later():
    loop = _Loop({"refresh": 20}, verify_s=1.5)  # 3 tokens for 1.5 s: twice plain's rate
    kinds = loop.run(50)
    assert kinds[:4] == [True] * 4 and kinds[4:8] == [False] * 4  # the one plain probe
    assert all(kinds[8:29])  # 20 measured verification steps (and the unmeasured first)...
    assert kinds[29:33] == [False] * 4  # ...then plain decoding is measured again
    assert kinds.count(False) == 8


def test_min_speedup_sets_how_much_verification_must_win():
    # verification 1.2x plain's rate: it passes at min_speedup 1.0, not at 1.5
    assert _Loop({"min_speedup": 1.0}, verify_s=2.5).run(40).count(False) == 4
    assert _Loop({"min_speedup": 1.5}, verify_s=2.5).run(40).count(False) > 20


def test_the_cost_is_time_over_tokens_not_the_mean_of_per_step_ratios():
    """Verification steps of 2 s giving 1 or 5 tokens in turn: 3 tokens per 2 s on average,
    1.5x plain decoding's rate, so it keeps running (the mean of the per-step costs, 1.2 s a
    token, would have held it off)."""
    loop = _Loop({"alpha": 0.5}, verify_s=2.0, tokens=[1, 5])
    assert loop.run(60).count(False) == 4  # the plain probe only


def test_a_pause_between_steps_is_not_taken_for_their_cost():
    loop = _Loop(verify_s=1.5)
    loop.run(8)
    loop.step(pause=100.0)  # the caller waited: not a verification cost
    assert loop.run(30).count(False) == 0


def test_each_batch_size_bucket_is_measured_on_its_own():
    small = _Loop(verify_s=4.0)  # loses at batch 1
    small.run(40)
    assert small.kinds[-1] is False
    small.requests = 16  # a new bucket: verification is tried there from scratch
    assert small.step() is True


@pytest.mark.parametrize(
    ("kwargs", "exc"), [({"min_samples": 0}, ValueError), ({"cooldown": 1.5}, TypeError)]
)
def test_bad_gate_settings_are_rejected(kwargs, exc):
    with pytest.raises(exc):
        SpeculationGate(**kwargs)
