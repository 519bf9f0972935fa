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


class RequestRecord:
    """Mutable per-request bookkeeping, owned by the cache.

    ``table`` is a zero-padded host copy of the request's block table so that building a batch's
    block tables is a row copy per request instead of a Python list conversion.
    """

    __slots__ = (
        "num_blocks",
        "num_prefix_blocks",
        "prefix_id",
        "request_id",
        "row",
        "seq_len",
        "state",
        "table",
    )

    def __init__(self, request_id: RequestId, max_blocks_per_seq: int, row: int) -> None:
        self.request_id = request_id
        self.state = RequestState.ACTIVE
        self.seq_len = 0  # committed tokens (prefix tokens included)
        self.table = np.zeros(max_blocks_per_seq, dtype=np.int32)
        self.num_blocks = 0  # used entries of table: prefix blocks first, then private ones
        self.num_prefix_blocks = 0
        self.prefix_id: PrefixId | None = None
        self.row = row  # its row of the cache's device block tables (-1 once terminal)

    @property
    def block_ids(self) -> list[int]:
        return self.table[: self.num_blocks].tolist()

    @property
    def private_block_ids(self) -> list[int]:
        return self.table[self.num_prefix_blocks : self.num_blocks].tolist()

    def push_block(self, block_id: int) -> None:
        self.table[self.num_blocks] = block_id
        self.num_blocks += 1

    def clear(self) -> None:
        """Forget every block (after release); the committed length is kept for reporting.

        The table gets a fresh array: transaction views built earlier keep reading the old one.
        """
        self.table = np.zeros_like(self.table)
        self.num_blocks = 0
        self.num_prefix_blocks = 0
        self.prefix_id = None
