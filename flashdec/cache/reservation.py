"""What a transaction takes, planned on the host before anything changes.

A :class:`Plan` is one transaction's batch (shared by every KV group) and one
:class:`Reservation` per group: the blocks the group's manager took (all or nothing) and where
each token goes. The managers (``flashdec.cache.group_managers``) fill reservations, the slot
builders (``flashdec.cache.slots``) turn them into device metadata, and the transaction keeps
them until commit or abort.
"""

from __future__ import annotations

import numpy as np

from flashdec.cache.part_types import RepeatedBatch, TableRows
from flashdec.cache.state import RequestId, RequestRecord

NO_UPDATES = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
NO_NEW = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def request_owner(request_id: RequestId) -> tuple[str, RequestId]:
    return ("request", request_id)


class Reservation:
    """What a transaction takes in one group, planned on the host before anything changes."""

    __slots__ = (
        "block_ids",
        "new",
        "reserved",
        "starts",
        "table_rows",
        "token_rows",
        "update_arrays",
        "update_batch",
        "updates",
    )

    def __init__(self) -> None:
        self.block_ids: np.ndarray | None = None  # [stored tokens] int64
        self.token_rows: np.ndarray | None = None  # their token indices; None: every token
        self.reserved: dict[RequestId, list[int]] = {}  # new blocks per request
        self.starts: dict[RequestId, int] = {}  # logical index of a request's first new block
        # device-table writes (row, logical block, block id) and, per request, the view's
        # (committed table row, first held block, committed end, reserved blocks, their start)
        self.updates: list[tuple[int, int, int]] = []
        self.update_batch: list[int] = []  # one-token reservations: each update's batch index
        self.table_rows: TableRows = []
        # the repeated-batch path: the updates as (flat index, block id, flat index in the
        # batch's tables) arrays, and (batch indices, blocks) of the new blocks
        self.update_arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.new: tuple[np.ndarray, np.ndarray] = NO_NEW


def every_token(part: Reservation, num_tokens: int) -> np.ndarray:
    """int32 block id of every token of a reservation (-1 where the group stores none)."""
    block_ids = part.block_ids.astype(np.int32)
    if part.token_rows is None:
        return block_ids
    every = np.full(num_tokens, -1, dtype=np.int32)
    every[part.token_rows] = block_ids
    return every


class Plan:
    """A transaction's batch (shared by every group) and one reservation per group."""

    __slots__ = ("counts", "groups", "memo", "positions", "records", "rows")

    def __init__(self, records: list[RequestRecord], counts: list[int], num_groups: int) -> None:
        self.records = records
        self.counts = counts
        self.positions: np.ndarray | None = None  # [T] int64 (int32: a memo plan), every token
        self.groups = [Reservation() for _ in range(num_groups)]
        self.rows: np.ndarray | None = None  # [B] int64 device-table rows, when known
        self.memo: RepeatedBatch | None = None  # the repeated batch (BatchMemo) it came from

    def reserved(self) -> list[dict[RequestId, list[int]]]:
        return [part.reserved for part in self.groups]
