"""Adaptivity: a request that keeps missing stops drafting for a cooldown that doubles each
time, one that hits keeps its full budget, and a large batch never speculates."""

from __future__ import annotations

import pytest

from flashdec.speculative import DraftController


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
