"""Lifecycle states and the frozen records the cache hands out.

``RequestRecord`` is the cache's private, mutable bookkeeping for one request; the public
``RequestState`` and ``PrefixState`` are what callers see.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

RequestId = str | int
PrefixId = str | int


class RequestState(StrEnum):
    """Where a request is in its life; compares equal to its string value."""

    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class PrefixState:
    """A resident shared prefix as seen from outside (a snapshot, not a live object)."""

    prefix_id: PrefixId
    num_blocks: int
    num_tokens: int
    block_ids: tuple[int, ...]  # physical ids in logical order
    refcount: int  # active requests attached to it now
    last_used: int  # registry clock of the last register/attach/detach (bigger = more recent)


class BlockRun:
    """One request's blocks in one layer group: a zero-padded host copy of its block table.

    Logical blocks ``[first_block, num_blocks)`` are held (shared blocks first — a registered
    prefix's or automatically cached ones, below ``num_prefix_blocks`` — then private ones); a
    sliding-window group releases blocks wholly before the window, so ``first_block``
    moves up and table entries before it are stale (never read). ``first_block == num_blocks``
    means nothing is held. The host table lets a batch's block tables be built by a row copy per
    request instead of a Python list conversion.
    """

    __slots__ = ("first_block", "num_blocks", "num_prefix_blocks", "table")

    def __init__(self, max_blocks_per_seq: int) -> None:
        self.table = np.zeros(max_blocks_per_seq, dtype=np.int32)
        self.num_blocks = 0  # logical end of the held blocks
        self.first_block = 0  # logical start of the held blocks (0 for full attention)
        self.num_prefix_blocks = 0

    @property
    def block_ids(self) -> list[int]:
        """Held physical ids in logical order."""
        return self.table[self.first_block : self.num_blocks].tolist()

    @property
    def num_held(self) -> int:
        return self.num_blocks - self.first_block

    @property
    def private_block_ids(self) -> list[int]:
        start = max(self.num_prefix_blocks, self.first_block)
        return self.table[start : self.num_blocks].tolist()

    def push_block(self, block_id: int) -> None:
        self.table[self.num_blocks] = block_id
        self.num_blocks += 1


class RequestRecord(BlockRun):
    """Mutable per-request bookkeeping, owned by the cache.

    The record itself is the request's :class:`BlockRun` of layer group 0 (the only one of a
    single-group cache, so the decode hot path reads it directly); ``others`` holds the runs of
    groups 1, 2, ...
    """

    __slots__ = ("block_hashes", "others", "prefix_id", "request_id", "row", "seq_len", "state")

    def __init__(
        self, request_id: RequestId, max_blocks_per_seq: int, row: int, others_widths=()
    ) -> None:
        super().__init__(max_blocks_per_seq)
        self.request_id = request_id
        self.state = RequestState.ACTIVE
        self.seq_len = 0  # committed tokens (prefix tokens included)
        self.prefix_id: PrefixId | None = None
        # automatic prefix caching: the chained hashes of its content's full blocks (None: off)
        self.block_hashes: list[bytes] | None = None
        self.row = row  # its row of the cache's device block tables (-1 once terminal)
        self.others = tuple(BlockRun(width) for width in others_widths)

    def run(self, group: int) -> BlockRun:
        return self if group == 0 else self.others[group - 1]

    def retire(self, state: RequestState) -> None:
        """Become terminal: forget every block of every group and the device-table row, keep
        the committed length for reporting. The tables become one shared empty array (earlier
        transaction views keep reading the old ones), so a terminal record holds no table."""
        self.table = _NO_TABLE
        self.num_blocks = self.first_block = self.num_prefix_blocks = 0
        self.others = (_NO_BLOCKS,) * len(self.others)
        self.prefix_id = None
        self.block_hashes = None
        self.row = -1
        self.state = state


class RetiredRequest:
    """A terminal request whose record left the cache's bounded history: its state is known
    for ever (ids are not reused) and it holds nothing; its final length is no longer kept."""

    __slots__ = ("request_id", "state")
    prefix_id = None
    row = -1

    def __init__(self, request_id: RequestId, state: RequestState) -> None:
        self.request_id = request_id
        self.state = state

    def run(self, group: int) -> BlockRun:
        return _NO_BLOCKS

    @property
    def seq_len(self) -> int:
        raise ValueError(
            f"request {self.request_id!r} is {self.state.value} and its final seq_len is no "
            "longer kept (only the newest terminal requests' are)"
        )


_NO_TABLE = np.zeros(0, dtype=np.int32)
_NO_TABLE.flags.writeable = False
_NO_BLOCKS = BlockRun(0)  # what a terminal request holds in any group (never written)
_NO_BLOCKS.table = _NO_TABLE
