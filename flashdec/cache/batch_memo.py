"""The repeated batch of one-token transactions, kept as arrays.

A decode loop steps the same requests again and again, and between two of its steps the only
change is the one its own commit made: every length grew by one, and at a block boundary each
request holds one more block. :class:`BatchMemo` keeps what ``begin_token`` reads from the
request records — lengths, device-table rows, held blocks and the last block's id per KV group —
as arrays, so the next step of the same batch is planned with a few vector operations instead of
a Python pass over every request.

The memo is valid only at the cache version its last commit left: any other change of the cache
(a lifecycle call, a prefix, a prompt import, another batch, an abort) moves the version, and the
next step takes the general path, which re-checks everything (and raises its exact errors).
Full-attention groups only (``GroupManager.memoizable``): a window group's held range moves on
its own. :meth:`BatchMemo.plan` reserves the next step from the arrays.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from flashdec.cache.part_types import TableRows
from flashdec.cache.reservation import NO_NEW, NO_UPDATES, Plan, request_owner
from flashdec.cache.state import RequestId, RequestRecord

if TYPE_CHECKING:
    from flashdec.cache.group_managers import GroupManager


class BatchMemo:
    """One batch's request state as arrays, valid while the cache is at ``version``."""

    __slots__ = (
        "_pending",
        "counts",
        "held",
        "held_lists",
        "last",
        "last_transaction",
        "lens",
        "records",
        "rids",
        "room",
        "rows",
        "tables",
        "version",
    )

    def __init__(
        self, records: list[RequestRecord], num_groups: int, version: int, transaction_id: int
    ) -> None:
        num = len(records)
        self.last_transaction = transaction_id  # the committed step the memo reflects
        self.records = records
        self.rids: tuple[RequestId, ...] = tuple(rec.request_id for rec in records)
        self.counts = [1] * num  # tokens per request of every step
        self.lens = np.fromiter((rec.seq_len for rec in records), np.int64, num)  # committed
        self.rows = np.fromiter((rec.row for rec in records), np.int64, num)  # device-table rows
        # per group: held blocks, the id of the last one, and every request's host table (an
        # array that keeps its identity until the request ends, which moves the version)
        self.held: list[np.ndarray] = []
        self.last: list[np.ndarray] = []
        self.tables: list[list[np.ndarray]] = []
        for g in range(num_groups):
            runs = [rec.run(g) for rec in records]
            held = np.fromiter((run.num_blocks for run in runs), np.int64, num)
            self.held.append(held)
            self.last.append(
                np.fromiter(
                    (run.table[run.num_blocks - 1] if run.num_blocks else -1 for run in runs),
                    np.int64,
                    num,
                )
            )
            self.tables.append([run.table for run in runs])
        # per group: ``held`` as a list (a view's table-row snapshot; replaced, never edited,
        # when ``held`` changes), and the steps every request can still take in its held blocks
        # (min over requests of held * block_size - length; None: not known, compute it)
        self.held_lists: list[list[int] | None] = [None] * num_groups
        self.room: list[int | None] = [None] * num_groups
        self.version = version
        self._pending: Sequence[tuple[np.ndarray, np.ndarray]] | None = None

    def held_list(self, g: int) -> list[int]:
        """Group ``g``'s ``held`` as a list, shared until ``held`` changes (never edit it)."""
        held = self.held_lists[g]
        if held is None:
            held = self.held_lists[g] = self.held[g].tolist()
        return held

    def matches(self, request_ids: Sequence, version: int) -> bool:
        """Whether ``request_ids`` are this batch's ids — the same objects, in order (equality
        would let ``True`` stand for ``1``) — and the cache is still at this memo's version."""
        rids = self.rids
        return (
            version == self.version
            and len(request_ids) == len(rids)
            and all(map(operator.is_, request_ids, rids))
        )

    def advance(
        self,
        new_blocks: Sequence[tuple[np.ndarray, np.ndarray]],
        version: int,
        transaction_id: int,
    ) -> None:
        """Account for committed step ``transaction_id``: every length + 1, and per group the
        requests ``new_blocks[g][0]`` (batch indices) now end with block ``new_blocks[g][1]``.

        Applied by :meth:`settle` when the next step is planned: the commit itself then runs
        no array operation (the first numpy call after a step's layers is the slow one)."""
        if self._pending is not None:
            self.settle()
        self._pending = new_blocks
        self.version = version
        self.last_transaction = transaction_id

    def settle(self) -> None:
        """Apply the committed step :meth:`advance` recorded (before reading the arrays)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        self.lens += 1
        room = self.room
        for g, (held, last, (index, blocks)) in enumerate(
            zip(self.held, self.last, pending, strict=True)
        ):
            if index.shape[0]:
                held[index] += 1
                last[index] = blocks
                self.held_lists[g] = None
                room[g] = None
            elif room[g] is not None:
                room[g] -= 1  # no block taken: every request has one slot less to go

    def plan(self, managers: Sequence[GroupManager]) -> Plan | None:
        """The repeated batch's one-token reservation, planned on arrays (full-attention groups:
        a request takes a block exactly when its token starts one). None when some request
        would be full or a pool is short: the general path then raises its exact error."""
        self.settle()
        lens = self.lens
        news = []
        for g, (manager, held) in enumerate(zip(managers, self.held, strict=True)):
            room = self.room[g]
            if room is None:
                room = self.room[g] = int((held * manager.block_size - lens).min())
            if room > 0:  # every token lands in a held block (the steady state: no array op)
                news.append((NO_NEW[0], None))
                continue
            logical = lens // manager.block_size
            starting = logical >= held  # the token starts a new block
            index = np.flatnonzero(starting) if starting.any() else NO_NEW[0]
            if index.shape[0] and (
                index.shape[0] > manager.allocator.num_free or logical[index].max() >= manager.width
            ):
                return None
            news.append((index, logical))
        plan = Plan(self.records, self.counts, len(managers))
        # int32 (a copy: the memo's lengths move on): the view's positions as they are
        plan.positions, plan.rows, plan.memo = lens.astype(np.int32), self.rows, self
        rids = self.rids
        try:
            for g, (manager, part, (index, logical), last, tables) in enumerate(
                zip(managers, plan.groups, news, self.last, self.tables, strict=True)
            ):
                block_ids = last.copy()
                if index.shape[0]:
                    picked = index.tolist()
                    owners = [request_owner(rids[i]) for i in picked]
                    blocks = manager.allocator.allocate_each(owners)
                    new_logical = logical[index]
                    block_ids[index] = blocks
                    starts = new_logical.tolist()
                    part.reserved = {o[1]: [b] for o, b in zip(owners, blocks, strict=True)}
                    part.starts = {o[1]: x for o, x in zip(owners, starts, strict=True)}
                    width = manager.width
                    values = np.asarray(blocks, dtype=np.int64)
                    part.update_arrays = (
                        self.rows[index] * width + new_logical,
                        values,
                        index * width + new_logical,
                    )
                    part.new = (index, values)
                    reserved = (picked, blocks, starts)
                else:
                    part.update_arrays = (*NO_UPDATES, NO_UPDATES[0])
                    reserved = None
                part.block_ids = block_ids
                part.table_rows = _lazy_table_rows(tables, self.held_list(g), reserved)
        except BaseException:
            for manager, reserved in zip(managers, plan.reserved(), strict=True):
                manager.release(reserved)
            raise
        return plan


def _lazy_table_rows(tables: list[np.ndarray], held: list[int], reserved) -> TableRows:
    """A view's table rows of a repeated-batch step, made only if the view's block tables are
    read: ``held`` is a snapshot, and committed entries of ``tables`` never change."""

    def rows() -> list:
        out = [(table, 0, n, (), 0) for table, n in zip(tables, held, strict=True)]
        if reserved is not None:
            for i, block, start in zip(*reserved, strict=True):
                out[i] = (tables[i], 0, held[i], (block,), start)
        return out

    return rows
