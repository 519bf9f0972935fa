"""The device-side round parts against the host rules they replace: the batched n-gram proposer
row by row against ``propose_ngram`` and the batched greedy acceptance against
``accept_greedy`` (random small-vocabulary batches, garbage past each row's length), the token
history against host lists, refusals that change nothing; on a GPU, no host sync and a CUDA
graph replay equal to eager rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdec.speculative import (
    DeviceTokenHistory,
    accept_greedy,
    accept_greedy_device,
    propose_ngram,
    propose_ngram_device,
)
from tests.profiles import examples

PROPERTY = settings(max_examples=examples(400, ci=80), deadline=None)


@st.composite
def contexts(draw):
    """``(tokens [R, C], lengths [R])``: small vocabularies (many recurrences), lengths 0, 1, 2,
    full or anything, and garbage of the same vocabulary past each length (it could fake a
    match if it were read)."""
    capacity = draw(st.integers(1, 24))
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(2, 6))
    length = st.one_of(st.sampled_from([0, 1, 2, capacity]), st.integers(0, capacity))
    lengths = [min(draw(length), capacity) for _ in range(rows)]
    row = st.lists(st.integers(0, vocab - 1), min_size=capacity, max_size=capacity)
    tokens = [draw(row) for _ in range(rows)]
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)


ngram_args = st.tuples(
    st.integers(1, 6),  # num_tokens
    st.integers(1, 4),  # min_ngram
    st.one_of(st.integers(0, 3), st.just(40)),  # max_ngram - min_ngram (40: past any context)
)


def _host_drafts(tokens, lengths, k, lo, hi) -> list[list[int]]:
    return [
        propose_ngram(tokens[r, : lengths[r]].numpy(), k, lo, hi).tolist()
        for r in range(tokens.shape[0])
    ]


def _device_drafts(drafts, num_drafts) -> list[list[int]]:
    return [drafts[r, : num_drafts[r]].tolist() for r in range(drafts.shape[0])]


@pytest.mark.large
@PROPERTY
@given(contexts(), ngram_args)
def test_propose_equals_the_host_lookup_row_by_row(batch, args):
    tokens, lengths = batch
    k, lo, extra = args
    hi = lo + extra
    before = tokens.clone(), lengths.clone()
    drafts, num_drafts = propose_ngram_device(tokens, lengths, k, lo, hi)
    assert drafts.shape == (tokens.shape[0], k) and drafts.dtype == torch.int64
    assert num_drafts.shape == (tokens.shape[0],) and num_drafts.dtype == torch.int64
    assert _device_drafts(drafts, num_drafts) == _host_drafts(tokens, lengths, k, lo, hi)
    padding = torch.arange(k) >= num_drafts.unsqueeze(1)
    assert not drafts[padding].any()  # 0 past num_drafts
    assert torch.equal(tokens, before[0]) and torch.equal(lengths, before[1])  # read-only


@pytest.mark.large
@PROPERTY
@given(contexts(), ngram_args, st.integers(0, 2**16))
def test_garbage_past_the_lengths_changes_nothing(batch, args, seed):
    tokens, lengths = batch
    k, lo, extra = args
    first = propose_ngram_device(tokens, lengths, k, lo, lo + extra)
    garbage = torch.randint(0, 6, tokens.shape, generator=torch.Generator().manual_seed(seed))
    past = torch.arange(tokens.shape[1]) >= lengths.unsqueeze(1)
    again = propose_ngram_device(torch.where(past, garbage, tokens), lengths, k, lo, lo + extra)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_propose_examples_and_tie_breaks():
    # "1 2 3" recurs (followed by 9 9), "3" alone recurs later (followed by 5 7); a periodic row
    # (the most recent full match wins); a row whose only match is too close to the end (the
    # earliest wins, short); an empty row; a row with no recurrence
    rows = [
        [1, 2, 3, 9, 9, 3, 5, 7, 1, 2, 3, 0, 0, 0, 0],
        [4, 5, 6] * 5,
        [1, 2, 1, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [3] * 15,
        list(range(15)),
    ]
    tokens = torch.tensor(rows)
    lengths = torch.tensor([11, 15, 5, 0, 15])
    drafts, num = propose_ngram_device(tokens, lengths, 4, 1, 4)
    assert _device_drafts(drafts, num) == [[9, 9, 3, 5], [4, 5, 6, 4], [2, 1], [], []]
    assert _device_drafts(*propose_ngram_device(tokens, lengths, 2, 1, 1)) == [
        [5, 7],
        [4, 5],
        [2, 1],
        [],
        [],
    ]
    assert _device_drafts(*propose_ngram_device(tokens, lengths, 2, 4, 4))[0] == []
    # a match that runs into the row's start ends there (no token 0 before the row)
    start = torch.tensor([[1, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
    assert _device_drafts(*propose_ngram_device(start, torch.tensor([3, 2]), 2, 2, 3)) == [[], []]
    # int32 inputs give the same int64 drafts; lengths past the capacity count as full
    same = propose_ngram_device(tokens.int(), lengths.int(), 4, 1, 4)
    assert torch.equal(same[0], drafts) and torch.equal(same[1], num)
    over = propose_ngram_device(tokens[1:2], torch.tensor([99]), 4, 1, 4)
    assert _device_drafts(*over) == [[4, 5, 6, 4]]
    # a capacity below 2 never drafts; no rows give empty results
    assert (
        _device_drafts(*propose_ngram_device(tokens[:, :1], lengths.clamp(max=1), 3, 1, 2))
        == [[]] * 5
    )
    empty = propose_ngram_device(tokens[:0], lengths[:0], 3, 1, 2)
    assert empty[0].shape == (0, 3) and empty[1].shape == (0,)


@st.composite
def verifications(draw):
    """``(drafts [R, K], num_drafts [R], targets [R, K + 1])``: targets copy most drafts (long
    accepted prefixes) and padding past ``num_drafts`` often equals the target (never
    accepted)."""
    rows, k, vocab = draw(st.integers(1, 4)), draw(st.integers(0, 5)), draw(st.integers(2, 3))
    token = st.integers(0, vocab - 1)
    drafts = [[draw(token) for _ in range(k)] for _ in range(rows)]
    targets = [
        [d if draw(st.integers(0, 3)) else draw(token) for d in row] + [draw(token)]
        for row in drafts
    ]
    num_drafts = [draw(st.integers(0, k)) for _ in range(rows)]
    return (
        torch.tensor(drafts, dtype=torch.int64).view(rows, k),
        torch.tensor(num_drafts),
        torch.tensor(targets),
    )


@pytest.mark.large
@PROPERTY
@given(verifications())
def test_accept_equals_the_host_rule_row_by_row(case):
    drafts, num_drafts, targets = case
    accepted, next_tokens = accept_greedy_device(drafts, num_drafts, targets)
    assert accepted.dtype == next_tokens.dtype == torch.int64
    for r in range(drafts.shape[0]):
        emitted = accept_greedy(drafts[r, : num_drafts[r]].tolist(), targets[r].tolist())
        assert (int(accepted[r]), int(next_tokens[r])) == (len(emitted) - 1, emitted[-1])


def test_accept_never_takes_padding():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 3]])
    targets = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 0, 7, 8], [1, 2, 3, 4]])
    accepted, nxt = accept_greedy_device(drafts, torch.tensor([3, 1, 3, 0]), targets)
    assert accepted.tolist() == [3, 1, 1, 0]
    assert nxt.tolist() == [8, 6, 0, 1]
    none = accept_greedy_device(
        torch.zeros(2, 0, dtype=torch.long), torch.zeros(2).long(), targets[:2, :1]
    )
    assert none[0].tolist() == [0, 0] and none[1].tolist() == [5, 5]


def _state(history: DeviceTokenHistory) -> tuple[torch.Tensor, torch.Tensor]:
    return history.tokens.clone(), history.lengths.clone()


def _unchanged(history: DeviceTokenHistory, before) -> bool:
    return torch.equal(history.tokens, before[0]) and torch.equal(history.lengths, before[1])


@pytest.mark.large
@settings(max_examples=examples(150, ci=30), deadline=None)
@given(
    st.integers(1, 4),  # slots
    st.integers(1, 12),  # capacity
    st.integers(0, 4),  # width of an append
    st.integers(0, 2**16),
)
def test_appends_equal_host_concatenation_and_stop_at_capacity(num_slots, capacity, width, seed):
    rng = np.random.default_rng(seed)
    history = DeviceTokenHistory(num_slots, capacity)
    host: list[list[int]] = [[] for _ in range(num_slots)]
    for slot in range(num_slots):
        prompt = rng.integers(0, 50, int(rng.integers(0, capacity + 1))).tolist()
        history.load(slot, torch.tensor(prompt, dtype=torch.int64))
        host[slot] = prompt
    for _ in range(6):
        rows = int(rng.integers(0, num_slots + 1))
        slots = rng.permutation(num_slots)[:rows]  # distinct
        new = rng.integers(0, 50, (rows, width))
        counts = rng.integers(-1, width + 2, rows)  # out of [0, W] too: clamped
        history.append(torch.tensor(slots), torch.tensor(new), torch.tensor(counts))
        for slot, row, count in zip(slots, new, counts, strict=True):
            taken = row[: max(0, min(int(count), width))].tolist()
            host[slot] = (host[slot] + taken)[:capacity]  # what does not fit is dropped
        if rng.integers(0, 4) == 0:
            slot = int(rng.integers(0, num_slots))
            history.clear(slot)
            host[slot] = []
        assert [history.context(s).tolist() for s in range(num_slots)] == host
        assert history.lengths.tolist() == [len(h) for h in host]


def test_an_overflow_never_reaches_another_slot():
    history = DeviceTokenHistory(3, 4)
    for slot in range(3):
        history.load(slot, torch.full((3,), 10 * (slot + 1)))
    history.append(torch.tensor([0, 1]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([3, 1]))
    assert history.tokens.tolist() == [[10, 10, 10, 1], [20, 20, 20, 4], [30, 30, 30, 0]]
    assert history.lengths.tolist() == [4, 4, 3]
    history.append(torch.tensor([0]), torch.tensor([[7, 7]]), torch.tensor([2]))  # full: dropped
    assert history.lengths.tolist() == [4, 4, 3]
    assert history.tokens[1:].tolist() == [[20, 20, 20, 4], [30, 30, 30, 0]]
    # a row naming a slot out of range is dropped, the others are written
    history.append(torch.tensor([5, -1, 2]), torch.tensor([[8], [8], [9]]), torch.tensor([1, 1, 1]))
    assert history.tokens.tolist() == [[10, 10, 10, 1], [20, 20, 20, 4], [30, 30, 30, 9]]
    assert history.lengths.tolist() == [4, 4, 4]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda h: h.load(3, torch.tensor([1])), ValueError, r"slot must be in \[0, 3\)"),
        (lambda h: h.load(-1, torch.tensor([1])), ValueError, "slot must be in"),
        (lambda h: h.load(True, torch.tensor([1])), TypeError, "slot must be an int"),
        (lambda h: h.load(0, torch.arange(5)), ValueError, "more than the capacity 4"),
        (lambda h: h.load(0, torch.ones(2)), TypeError, "ids must have dtype"),
        (lambda h: h.load(0, torch.ones(1, 2).long()), ValueError, "ids must be 1-D"),
        (lambda h: h.load(0, [1, 2]), TypeError, "ids must be a torch.Tensor"),
        (lambda h: h.clear(3), ValueError, "slot must be in"),
        (
            lambda h: h.append(torch.tensor([0]), torch.ones(2, 2).long(), torch.tensor([1, 1])),
            ValueError,
            r"slots must have shape \(2,\)",
        ),
        (
            lambda h: h.append(torch.tensor([0]), torch.ones(1, 2).long(), torch.tensor([1, 1])),
            ValueError,
            "counts must have shape",
        ),
        (
            lambda h: h.append(torch.tensor([0]), torch.ones(1, 2), torch.tensor([1])),
            TypeError,
            "new_tokens must have dtype",
        ),
        (
            lambda h: h.append(torch.tensor([0.0]), torch.ones(1, 2).long(), torch.tensor([1])),
            TypeError,
            "slots must have dtype",
        ),
        (
            lambda h: h.append(torch.tensor(0), torch.ones(1, 2).long(), torch.tensor([1])),
            ValueError,
            "slots must be 1-D",
        ),
    ],
)
def test_history_refusals_change_nothing(call, error, match):
    history = DeviceTokenHistory(3, 4)
    history.load(0, torch.tensor([1, 2]))
    history.load(2, torch.tensor([3, 4, 5, 6]))
    before = _state(history)
    with pytest.raises(error, match=match):
        call(history)
    assert _unchanged(history, before)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 4), ValueError, "num_slots must be >= 1"),
        ((2, 0), ValueError, "capacity must be >= 1"),
        ((2.0, 4), TypeError, "num_slots must be an int"),
    ],
)
def test_history_sizes_are_checked(args, error, match):
    with pytest.raises(error, match=match):
        DeviceTokenHistory(*args)


TOKENS, LENGTHS = torch.tensor([[1, 2, 1, 2]]), torch.tensor([4])


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((TOKENS.float(), LENGTHS, 2, 1, 2), TypeError, "tokens must have dtype"),
        ((TOKENS[0], LENGTHS, 2, 1, 2), ValueError, "tokens must be 2-D"),
        ((TOKENS, torch.tensor([4, 4]), 2, 1, 2), ValueError, r"lengths must have shape \(1,\)"),
        ((TOKENS, LENGTHS.float(), 2, 1, 2), TypeError, "lengths must have dtype"),
        ((TOKENS, LENGTHS, 0, 1, 2), ValueError, "num_tokens must be >= 1"),
        ((TOKENS, LENGTHS, True, 1, 2), TypeError, "num_tokens must be an int"),
        ((TOKENS, LENGTHS, 2, 0, 2), ValueError, "min_ngram must be >= 1"),
        ((TOKENS, LENGTHS, 2, 3, 2), ValueError, r"max_ngram \(2\) must be >= min_ngram \(3\)"),
        ((TOKENS, LENGTHS, 2, 1, 2.0), TypeError, "max_ngram must be an int"),
    ],
)
def test_propose_refusals(args, error, match):
    with pytest.raises(error, match=match):
        propose_ngram_device(*args)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((TOKENS.float(), LENGTHS, TOKENS), TypeError, "drafts must have dtype"),
        ((TOKENS, LENGTHS, TOKENS), ValueError, r"targets must have shape \(1, 5\)"),
        ((TOKENS, torch.tensor([[4]]), TOKENS), ValueError, "num_drafts must be 1-D"),
        ((TOKENS, torch.tensor([4, 4]), TOKENS), ValueError, "num_drafts must have shape"),
        ((TOKENS, LENGTHS, torch.ones(1, 5)), TypeError, "targets must have dtype"),
    ],
)
def test_accept_refusals(args, error, match):
    with pytest.raises(error, match=match):
        accept_greedy_device(*args)


@pytest.mark.gpu
def test_a_round_needs_no_host_sync_and_replays_in_a_cuda_graph():
    """append, propose and accept wait for nothing on the host (torch's sync debug mode counts
    zero), and one round captured in a CUDA graph replays like eager rounds."""
    from flashdec.runtime import capture_cuda_graph
    from tests.helpers import device_syncs

    slots, capacity, k = 4, 48, 3
    gen = torch.Generator().manual_seed(0)
    eager = DeviceTokenHistory(slots, capacity, "cuda")
    graphed = DeviceTokenHistory(slots, capacity, "cuda")
    for slot, size in enumerate([0, 1, 9, 20]):
        prompt = torch.randint(0, 4, (size,), generator=gen)
        eager.load(slot, prompt)
        graphed.load(slot, prompt)
    all_slots = torch.arange(slots, device="cuda")
    new = torch.zeros(slots, k + 1, dtype=torch.int64, device="cuda")
    counts = torch.zeros(slots, dtype=torch.int64, device="cuda")
    targets = torch.zeros(slots, k + 1, dtype=torch.int64, device="cuda")

    def one_round(history):
        history.append(all_slots, new, counts)
        drafts, num_drafts = propose_ngram_device(history.tokens, history.lengths, k, 1, 3)
        accepted, next_tokens = accept_greedy_device(drafts, num_drafts, targets)
        return drafts, num_drafts, accepted, next_tokens

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels load, allocator pools settle
        for _ in range(2):
            one_round(graphed)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # counts are 0: the warm-up appended nothing, so both histories still agree
    assert torch.equal(graphed.tokens, eager.tokens) and torch.equal(graphed.lengths, eager.lengths)
    history = DeviceTokenHistory(slots, capacity, "cuda")
    assert device_syncs(lambda: history.append(all_slots, new, counts)) == 0
    assert device_syncs(lambda: propose_ngram_device(history.tokens, history.lengths, k, 1, 3)) == 0
    drafts = torch.zeros(slots, k, dtype=torch.int64, device="cuda")
    assert device_syncs(lambda: accept_greedy_device(drafts, counts, targets)) == 0

    graph = torch.cuda.CUDAGraph()
    with capture_cuda_graph(graph):
        static = one_round(graphed)
    for _ in range(6):
        new.copy_(torch.randint(0, 4, (slots, k + 1), generator=gen))
        counts.copy_(torch.randint(0, k + 2, (slots,), generator=gen))
        targets.copy_(torch.randint(0, 4, (slots, k + 1), generator=gen))
        graph.replay()
        expected = one_round(eager)
        assert all(torch.equal(s, e) for s, e in zip(static, expected, strict=True))
        assert torch.equal(graphed.lengths, eager.lengths)
        assert torch.equal(graphed.tokens, eager.tokens)
        host = _host_drafts(eager.tokens.cpu(), eager.lengths.cpu(), k, 1, 3)
        assert _device_drafts(static[0].cpu(), static[1].cpu()) == host
