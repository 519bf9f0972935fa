"""The n-gram drafter: the longest recurring suffix's continuation, against a brute-force
lookup on random contexts; incremental contexts equal a fresh lookup."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdec.speculative import NgramDrafter, propose_ngram


def _brute(context: list[int], k: int, lo: int, hi: int) -> list[int]:
    size = len(context)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = context[size - n :]
        ends = [e for e in range(n - 1, size - 1) if context[e - n + 1 : e + 1] == suffix]
        if ends:
            full = [e for e in ends if e + 1 + k <= size]
            end = full[-1] if full else ends[0]
            return context[end + 1 : end + 1 + k]
    return []


def _propose(context, k, lo=1, hi=4) -> list[int]:
    return propose_ngram(np.asarray(context, dtype=np.int64), k, lo, hi).tolist()


def test_the_longest_match_wins_and_its_continuation_is_proposed():
    # "1 2 3" recurs (followed by 9 9), "3" alone recurs later (followed by 5)
    context = [1, 2, 3, 9, 9, 3, 5, 7, 1, 2, 3]
    assert _propose(context, 2) == [9, 9]
    assert _propose(context, 2, lo=4) == []  # no 4-gram recurs
    assert _propose(context, 2, hi=1) == [5, 7]  # 1-grams: the most recent "3" with 2 after


def test_a_periodic_context_drafts_its_period():
    assert _propose([4, 5, 6] * 5, 4) == [4, 5, 6, 4]


def test_no_recurrence_no_draft():
    assert _propose(list(range(10)), 4) == []
    assert _propose([7], 4) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_contexts_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        size = int(rng.integers(2, 60))
        context = rng.integers(0, 4, size).tolist()  # small vocabulary: many recurrences
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        assert _propose(context, k, lo, hi) == _brute(context, k, lo, hi), (context, k, lo, hi)


def test_incremental_contexts_equal_a_fresh_lookup():
    rng = np.random.default_rng(0)
    prompt = torch.tensor(rng.integers(0, 5, 30))
    drafter = NgramDrafter(1, 3)
    tokens: list[int] = []
    for step in range(200):  # the buffer grows several times
        tail = [int(rng.integers(0, 5))] if step % 3 == 0 else []
        context = prompt.tolist() + tokens + tail
        assert drafter.propose("r", prompt, tokens, 3, tail) == _propose(context, 3, 1, 3)
        tokens += rng.integers(0, 5, int(rng.integers(1, 4))).tolist()
    tokens.clear()  # the request was reset (its admission taken back)
    assert drafter.propose("r", prompt, tokens, 3) == _propose(prompt.tolist(), 3, 1, 3)
    drafter.forget("r")
    assert drafter.propose("r", prompt, [], 3) == _propose(prompt.tolist(), 3, 1, 3)
