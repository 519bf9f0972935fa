"""Block accounting (flashdec/_blocks.py) against brute force over positions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashdec._blocks import (
    blocks_for_tokens,
    held_block_range,
    lifetime_blocks,
    window_block_bound,
)

windows = st.one_of(st.none(), st.integers(1, 40))


def _needed_positions(num_tokens: int, window: int | None) -> range:
    start = 0 if window is None else max(0, num_tokens + 1 - window)
    return range(start, num_tokens)


@given(st.integers(0, 200), st.integers(1, 9), windows)
def test_blocks_for_tokens_counts_the_blocks_of_readable_positions(n, bs, window):
    blocks = {p // bs for p in _needed_positions(n, window)}
    assert blocks_for_tokens(n, bs, window) == len(blocks)
    first, end = held_block_range(n, bs, window)
    assert end == -(-n // bs)
    if blocks:
        assert (first, end) == (min(blocks), max(blocks) + 1)
    else:
        assert first == end
    if window is not None:
        assert blocks_for_tokens(n, bs, window) <= window_block_bound(bs, window)


@given(st.integers(0, 200), st.integers(1, 9), windows)
def test_lifetime_blocks_is_the_peak_over_every_append(total, bs, window):
    peak = 0
    for p in range(total):  # appending position p holds the readable blocks plus p's own
        positions = [*_needed_positions(p, window), p]
        peak = max(peak, len({q // bs for q in positions}))
    assert lifetime_blocks(total, bs, window) == peak
    if window is None:
        assert peak == -(-total // bs)
    else:
        assert peak <= window_block_bound(bs, window)


def test_window_groups_stay_bounded_while_full_groups_grow():
    assert blocks_for_tokens(10_000, 16) == 625
    assert blocks_for_tokens(10_000, 16, window=32) == 2  # [9969, 10000): blocks 623, 624
    assert lifetime_blocks(10_000, 16, window=32) == window_block_bound(16, 32) == 3
    assert lifetime_blocks(20, 16, window=32) == 2  # the window never fills


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda: blocks_for_tokens(-1, 16), ValueError),
        (lambda: blocks_for_tokens(4, 0), ValueError),
        (lambda: blocks_for_tokens(4, 16, window=0), ValueError),
        (lambda: lifetime_blocks(4.0, 16), TypeError),
        (lambda: lifetime_blocks(4, 16, window="8"), TypeError),
        (lambda: window_block_bound(16, None), TypeError),
    ],
)
def test_bad_arguments(call, exc):
    with pytest.raises(exc):
        call()
