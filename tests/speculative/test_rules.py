"""The accept rules: greedy takes the matching prefix plus the target's token; speculative
sampling emits every token with the target's distribution (chi-square over 200k seeded trials
at p > 1e-6, which a correct rule fails once in a million seeds — and the seed is fixed)."""

from __future__ import annotations

import pytest
import torch

from flashdec.speculative import accept_greedy, accept_sampled


def test_greedy_accepts_the_matching_prefix_plus_one():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))  # chi2 survival


def test_speculative_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    vocab, k, trials = 5, 2, 200_000
    probs = torch.softmax(torch.randn(k + 1, vocab, dtype=torch.float64), -1)
    drafts = torch.tensor([1, 3])  # each with a middling probability
    assert all(0.05 < probs[i, drafts[i]] < 0.9 for i in range(k))
    gen = torch.Generator().manual_seed(1234)
    accepted, nxt = accept_sampled(probs.expand(trials, -1, -1), drafts.expand(trials, -1), gen)
    first = torch.where(accepted >= 1, drafts[0], nxt)
    assert _chi2_pvalue(torch.bincount(first, minlength=vocab).double(), probs[0]) > 1e-6
    # given the first draft was emitted, the second token follows row 1
    after = accepted >= 1
    second = torch.where(accepted[after] >= 2, drafts[1], nxt[after])
    assert _chi2_pvalue(torch.bincount(second, minlength=vocab).double(), probs[1]) > 1e-6
    # both drafts emitted: the bonus token follows row 2
    third = nxt[accepted == 2]
    assert _chi2_pvalue(torch.bincount(third, minlength=vocab).double(), probs[2]) > 1e-6
    # the acceptance itself is p(draft) (a loose check: 200k trials, 8 sigma)
    rate = (accepted >= 1).double().mean()
    assert abs(rate - probs[0, 1]) < 8 * (probs[0, 1] * (1 - probs[0, 1]) / trials) ** 0.5


def test_certain_and_impossible_drafts():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]]).expand(1000, -1, -1)
    gen = torch.Generator().manual_seed(0)
    accepted, nxt = accept_sampled(probs, torch.tensor([[1]]).expand(1000, -1), gen)
    assert accepted.eq(1).all() and nxt.ne(1).all()  # p = 1: always taken; bonus from row 1
    accepted, nxt = accept_sampled(probs[:, 1:], torch.tensor([[1]]).expand(1000, -1), gen)
    assert accepted.eq(0).all() and nxt.ne(1).all()  # p = 0: never taken, never redrawn


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_generators_reproduce(k):
    probs = torch.softmax(torch.randn(4, k + 1, 7, generator=torch.Generator().manual_seed(0)), -1)
    drafts = torch.randint(0, 7, (4, k), generator=torch.Generator().manual_seed(1))
    runs = [accept_sampled(probs, drafts, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
