"""KV layer groups as a scheduler sees them: each group's own pool, and what a request needs there.

A cache with several layer groups (SPEC §8.2) keeps one block pool per group, and a request holds
blocks in every group at once — ``ceil(tokens / block_size)`` in a full-attention group, at most
``ceil(window / block_size) + 1`` in a sliding-window group, whose blocks before the window go back
to the pool as the request advances. A scheduler therefore commits a request in *each* group, at
that group's own bound, against that group's own pool: a windowed group's commitment stays flat
however long the request runs, so more requests fit.

How many blocks a request holds, and holds at most, in one group is ``flashdec._blocks``' (the
cache's own accounting). A snapshot of a one-group, full-attention cache leaves ``groups`` empty
and describes its pool in its top-level fields, exactly as before groups existed; this module is
only used otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from flashdec._checks import check_positive_int

# (block_size, window): what a request's block needs in a group follow from
GroupShape: TypeAlias = tuple[int, int | None]


def check_window(name: str, window: object) -> int | None:
    """A window is ``None`` (full attention) or a positive int of tokens."""
    if window is None:
        return None
    return check_positive_int(name, window)


@dataclass(frozen=True)
class GroupPool:
    """One layer group's block pool at snapshot time.

    ``window`` is the group's sliding window in tokens (``None``: full attention). Its
    ``max_blocks_per_seq`` bounds the *logical* block table (a windowed request's table still
    spans its whole length; only the entries before the window are released).

    ``shared_block_refs``: references to automatically cached blocks beyond the first (the
    active requests' rows count each cached block they share as their own, so their block
    counts add up to ``total_blocks + shared_block_refs``); ``total_blocks`` stays the real pool.
    """

    block_size: int
    total_blocks: int
    free_blocks: int
    max_blocks_per_seq: int
    window: int | None = None
    shared_block_refs: int = 0

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)
        check_positive_int("total_blocks", self.total_blocks)
        check_positive_int("free_blocks", self.free_blocks, minimum=0)
        check_positive_int("max_blocks_per_seq", self.max_blocks_per_seq)
        check_window("window", self.window)
        check_positive_int("shared_block_refs", self.shared_block_refs, minimum=0)
        if self.free_blocks > self.total_blocks:
            raise ValueError(
                f"free_blocks ({self.free_blocks}) must be <= total_blocks ({self.total_blocks})"
            )

    @property
    def shape(self) -> GroupShape:
        return (self.block_size, self.window)

    @property
    def max_tokens(self) -> int:
        """The longest request this group's block table can hold."""
        return self.max_blocks_per_seq * self.block_size


def needs_new_block(num_tokens: int, block_size: int, window: int | None) -> bool:
    """Whether appending the next token (at position ``num_tokens``) takes a block in a group:
    its block is not among those the request holds (a window of 1 keeps none between tokens)."""
    return num_tokens % block_size == 0 or window == 1
