"""Block accounting of one request in one KV layer group: the one definition, shared by the
cache (which holds the blocks) and the scheduler (which commits to them ahead of time).

A full-attention group keeps every block of a request. A sliding-window group keeps only the
blocks holding a position that some future decode can still read: after ``n`` committed tokens
the next decode (of the token at position ``n``) attends to ``[max(0, n + 1 - window), n + 1)``,
so positions ``[max(0, n + 1 - window), n)`` must stay; blocks wholly before that are released.
"""

from __future__ import annotations

from flashdec._checks import check_positive_int


def _check(num_tokens: object, block_size: object, window: object) -> tuple[int, int, int | None]:
    n = check_positive_int("num_tokens", num_tokens, minimum=0)
    bs = check_positive_int("block_size", block_size)
    if window is not None:
        window = check_positive_int("window", window)
    return n, bs, window


def held_block_range(
    num_tokens: int, block_size: int, window: int | None = None
) -> tuple[int, int]:
    """Logical blocks ``[first, end)`` a request with ``num_tokens`` committed tokens holds.

    ``end`` is ``ceil(num_tokens / block_size)``; ``first`` is 0 for full attention and, for a
    window group, the block of the oldest position a future decode reads (``first == end`` when
    none is left, which only a window of 1 allows).
    """
    return held_range(*_check(num_tokens, block_size, window))


def held_range(num_tokens: int, block_size: int, window: int | None) -> tuple[int, int]:
    """:func:`held_block_range` without the argument checks (the cache's hot path)."""
    end = -(-num_tokens // block_size)
    if window is None:
        return 0, end
    start = num_tokens + 1 - window  # oldest position the next decode reads
    if start >= num_tokens:
        return end, end
    return (start // block_size if start > 0 else 0), end


def blocks_for_tokens(num_tokens: int, block_size: int, window: int | None = None) -> int:
    """How many blocks a request with ``num_tokens`` committed tokens holds in a group:
    ``ceil(n / bs)`` for full attention, at most ``ceil(window / bs) + 1`` for a window group."""
    first, end = held_block_range(num_tokens, block_size, window)
    return end - first


def window_block_bound(block_size: int, window: int) -> int:
    """The most blocks a request ever holds in a window group: ``ceil(window / bs) + 1``."""
    bs = check_positive_int("block_size", block_size)
    window = check_positive_int("window", window)
    return -(-window // bs) + 1


def lifetime_blocks(total_tokens: int, block_size: int, window: int | None = None) -> int:
    """The most blocks a request holds in a group over its life, reaching ``total_tokens``
    tokens (counting the slot reserved for the token being appended).

    Appending the token at position ``p`` holds the blocks of ``[max(0, p + 1 - window), p]``;
    the maximum over ``p < total_tokens`` is ``ceil(total / bs)`` for full attention (and while
    the window covers everything), and never more than ``ceil(window / bs) + 1`` otherwise.
    """
    total, bs, window = _check(total_tokens, block_size, window)
    if window is None or total <= window:
        return -(-total // bs)
    # p >= window - 1: the window [s, s + window) with s = p + 1 - window in [0, total - window]
    # spans (s % bs + window - 1) // bs + 1 blocks, largest for the largest reachable s % bs
    return (min(total - window, bs - 1) + window - 1) // bs + 1


def reserved_blocks(start: int, count: int, block_size: int, window: int | None) -> int:
    """New blocks a step of ``count`` tokens after ``start`` committed ones takes in a group
    while it is open (the window's blocks are released only when it commits): for a window
    group, blocks from the first one the window keeps after the step (always the last
    token's) on, less those already held."""
    end = -(-(start + count) // block_size)
    first, held_end = held_range(start, block_size, window)
    if window is None:
        return end - held_end
    stored = min(held_range(start + count, block_size, window)[0], end - 1)
    first_new = stored if first == held_end else max(stored, held_end)
    return max(0, end - first_new)
