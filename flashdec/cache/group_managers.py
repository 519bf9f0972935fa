"""One manager per KV group kind: how a group reserves, publishes and releases blocks.

The cache's transaction spans every group; each group's :class:`GroupManager` decides what its
kind holds. :class:`FullAttentionManager` keeps every block of a request.
:class:`SlidingWindowManager` keeps only the blocks a future decode can still read
(``flashdec._blocks``): a commit releases the ones wholly before the window, and a prompt import
takes blocks only for the tail the window keeps. Everything that depends on ``window`` lives
here; the facade calls each manager once per step, never once per request.

Each manager works on its group's pool (``group.allocator``) and on the requests'
:class:`~flashdec.cache.state.BlockRun` of its group (group 0's run is the record itself, so the
one-group decode path reads it directly).
"""

from __future__ import annotations

import numpy as np

from flashdec._blocks import held_range
from flashdec.cache.kv_spec import KVGroupSpec
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.reservation import Plan, Reservation, request_owner
from flashdec.cache.state import BlockRun, RequestId, RequestRecord


class GroupManager:
    """The parts every kind shares: the room checks' errors and giving blocks back."""

    memoizable = True  # a repeated batch may be planned on arrays (BatchMemo)
    shares_prefixes = True  # shared prefixes may attach (their blocks stay for good)

    def __init__(self, group: LayerGroup, single: bool) -> None:
        self.group = group
        self.index = group.index
        self.block_size = group.block_size
        self.width = group.width
        self.window = group.window
        self.allocator = group.allocator
        self.block_cache = group.block_cache
        self._where = "" if single else f" in KV group {group.index}"

    def _full(self, rec: RequestRecord, n: int, end_blocks: int) -> None:
        raise RuntimeError(
            f"request {rec.request_id!r} is full: {rec.seq_len} + {n} tokens need "
            f"{end_blocks} blocks of {self.block_size}{self._where}, more than "
            f"max_blocks_per_seq={self.width}"
        )

    def _check_free(self, wanted: int) -> None:
        free = self.allocator.num_free
        if wanted > free:
            raise RuntimeError(
                f"out of KV blocks{self._where}: this token needs {wanted} new block(s) but only "
                f"{free} are free; nothing was changed"
            )

    def release(self, reserved: dict[RequestId, list[int]]) -> None:
        """Give a reservation's new blocks back to the pool."""
        release = self.allocator.release
        for rid, block_ids in reserved.items():
            release(block_ids, request_owner(rid))

    def check_partial_commit(self, transaction_id: int, part: Reservation) -> None:
        """Raise (ValueError) when this kind cannot keep only some of ``part``'s tokens."""

    # the kinds implement these (the names are the contract the cache calls)
    def check_room(self, records: list[RequestRecord], counts: list[int]) -> None:
        """Check that ``counts[i]`` more tokens fit for every request (a RuntimeError naming
        the full request or the short pool otherwise); changes nothing."""
        raise NotImplementedError

    def reserve(self, plan: Plan, part: Reservation) -> None:
        """Take the blocks of any number of tokens per request into ``part``."""
        raise NotImplementedError

    def reserve_one_each(self, plan: Plan, part: Reservation) -> None:
        """Take the blocks of one token per request into ``part`` (the decode step)."""
        raise NotImplementedError

    def publish(
        self,
        records: list[RequestRecord],
        counts: list[int],
        reserved: dict[RequestId, list[int]],
        starts: dict[RequestId, int],
    ) -> None:
        """Make a reservation permanent in the runs, before the lengths grow by ``counts``."""
        raise NotImplementedError


class FullAttentionManager(GroupManager):
    """A full-attention group: a request holds every block of its ``seq_len`` tokens."""

    def check_room(self, records: list[RequestRecord], counts: list[int]) -> None:
        bs, width, index = self.block_size, self.width, self.index
        wanted = 0
        for rec, n in zip(records, counts, strict=True):
            end_blocks = -(-(rec.seq_len + n) // bs)
            if end_blocks > width:
                self._full(rec, n, end_blocks)
            # the record is group 0's run (the hot path reads it directly)
            run = rec if index == 0 else rec.others[index - 1]
            wanted += end_blocks - run.num_blocks
        self._check_free(wanted)

    def reserve(self, plan: Plan, part: Reservation) -> None:
        bs, index, allocate = self.block_size, self.index, self.allocator.allocate
        block_ids: list[int] = []
        for rec, n in zip(plan.records, plan.counts, strict=True):
            run = rec if index == 0 else rec.others[index - 1]
            start = rec.seq_len
            committed = run.num_blocks
            new = -(-(start + n) // bs) - committed
            taken = allocate(new, request_owner(rec.request_id)) if new else []
            if taken:
                part.reserved[rec.request_id] = taken
                part.starts[rec.request_id] = committed
                part.updates += [(rec.row, committed + i, b) for i, b in enumerate(taken)]
            part.table_rows.append((run.table, 0, committed, taken, committed))
            table = run.table
            for pos in range(start, start + n):
                logical = pos // bs
                block_ids.append(
                    int(table[logical]) if logical < committed else taken[logical - committed]
                )
        part.block_ids = np.asarray(block_ids, dtype=np.int64)

    def reserve_one_each(self, plan: Plan, part: Reservation) -> None:
        bs, index = self.block_size, self.index
        records = plan.records
        block_ids = np.empty(len(records), dtype=np.int64)
        allocate = self.allocator.allocate
        reserved, starts, updates, table_rows = (
            part.reserved,
            part.starts,
            part.updates,
            part.table_rows,
        )
        update_batch = part.update_batch
        for i, rec in enumerate(records):
            # the record is its own group-0 run; each branch reads one type, so CPython's
            # per-site attribute caches stay hit when several groups take in turn
            if index == 0:
                table, held = rec.table, rec.num_blocks
            else:
                run = rec.others[index - 1]
                table, held = run.table, run.num_blocks
            logical = rec.seq_len // bs
            if logical < held:
                block_ids[i] = table[logical]
                table_rows.append((table, 0, held, (), 0))
            else:
                (block,) = allocate(1, request_owner(rec.request_id))
                reserved[rec.request_id] = [block]
                starts[rec.request_id] = logical
                updates.append((rec.row, logical, block))
                update_batch.append(i)
                block_ids[i] = block
                table_rows.append((table, 0, held, (block,), logical))
        part.block_ids = block_ids

    def publish(
        self,
        records: list[RequestRecord],
        counts: list[int],
        reserved: dict[RequestId, list[int]],
        starts: dict[RequestId, int],
    ) -> None:
        if not reserved:
            return
        index = self.index
        for rec in records:
            blocks = reserved.get(rec.request_id)
            if blocks:
                run = rec if index == 0 else rec.others[index - 1]
                for block_id in blocks:
                    run.push_block(block_id)


def _window_span(run: BlockRun, start: int, count: int, bs: int, window: int) -> tuple[int, int]:
    """For a window group: ``(first stored logical block, first new logical block)`` of a
    reservation of ``count`` tokens after ``start`` committed ones.

    Tokens in blocks the window keeps after the commit are stored, and always the last token
    (its own decode reads it, even with a window of 1); blocks from the second value on are
    taken new, everything in between is already held.
    """
    keep, end = held_range(start + count, bs, window)
    stored = min(keep, end - 1)
    if run.first_block == run.num_blocks:  # nothing held
        return stored, stored
    return stored, max(stored, run.num_blocks)


class SlidingWindowManager(GroupManager):
    """A sliding-window group: a request holds only the blocks a future decode can read."""

    memoizable = False  # its held range moves on its own: every step is planned afresh
    shares_prefixes = False  # it would release a prefix's blocks

    def check_room(self, records: list[RequestRecord], counts: list[int]) -> None:
        bs, width, window, index = self.block_size, self.width, self.window, self.index
        wanted = 0
        for rec, n in zip(records, counts, strict=True):
            end_blocks = -(-(rec.seq_len + n) // bs)
            if end_blocks > width:
                self._full(rec, n, end_blocks)
            run = rec if index == 0 else rec.others[index - 1]
            if n == 1:  # one token: a new block unless its block is held
                wanted += not run.first_block <= rec.seq_len // bs < run.num_blocks
            else:
                wanted += end_blocks - _window_span(run, rec.seq_len, n, bs, window)[1]
        self._check_free(wanted)

    def reserve_one_each(self, plan: Plan, part: Reservation) -> None:
        """The token's block is held, or it is new (the block after the held ones, or the only
        one when none is held)."""
        bs, index = self.block_size, self.index
        records = plan.records
        block_ids = np.empty(len(records), dtype=np.int64)
        allocate = self.allocator.allocate
        for i, rec in enumerate(records):
            run = rec if index == 0 else rec.others[index - 1]
            logical = rec.seq_len // bs
            if run.first_block <= logical < run.num_blocks:
                block_ids[i] = run.table[logical]
                part.table_rows.append((run.table, run.first_block, run.num_blocks, (), 0))
            else:
                (block,) = allocate(1, request_owner(rec.request_id))
                part.reserved[rec.request_id] = [block]
                part.starts[rec.request_id] = logical
                part.updates.append((rec.row, logical, block))
                part.update_batch.append(i)
                block_ids[i] = block
                part.table_rows.append(
                    (run.table, run.first_block, run.num_blocks, (block,), logical)
                )
        part.block_ids = block_ids

    def reserve(self, plan: Plan, part: Reservation) -> None:
        """Blocks only for the tokens the window keeps (and the last one); the other tokens are
        not stored (``part.token_rows`` lists the stored)."""
        bs, window, index = self.block_size, self.window, self.index
        allocate = self.allocator.allocate
        block_ids: list[int] = []
        token_rows: list[int] = []
        row = 0
        for rec, n in zip(plan.records, plan.counts, strict=True):
            run = rec if index == 0 else rec.others[index - 1]
            start = rec.seq_len
            stored, first_new = _window_span(run, start, n, bs, window)
            new = -(-(start + n) // bs) - first_new
            taken = allocate(new, request_owner(rec.request_id)) if new else []
            if taken:
                part.reserved[rec.request_id] = taken
                part.starts[rec.request_id] = first_new
                part.updates += [(rec.row, first_new + i, b) for i, b in enumerate(taken)]
            part.table_rows.append((run.table, run.first_block, run.num_blocks, taken, first_new))
            table = run.table
            for pos in range(max(start, stored * bs), start + n):
                logical = pos // bs
                block_ids.append(
                    int(table[logical]) if logical < first_new else taken[logical - first_new]
                )
                token_rows.append(row + pos - start)
            row += n
        part.block_ids = np.asarray(block_ids, dtype=np.int64)
        if len(token_rows) != row:
            part.token_rows = np.asarray(token_rows, dtype=np.int64)

    def publish(
        self,
        records: list[RequestRecord],
        counts: list[int],
        reserved: dict[RequestId, list[int]],
        starts: dict[RequestId, int],
    ) -> None:
        """Reserved blocks join the runs, and the blocks now wholly before the window (held or
        just reserved) go back to the pool."""
        bs, window, index = self.block_size, self.window, self.index
        release = self.allocator.release
        for rec, n in zip(records, counts, strict=True):
            run = rec if index == 0 else rec.others[index - 1]
            blocks = reserved.get(rec.request_id) if reserved else None
            keep, end = held_range(rec.seq_len + n, bs, window)
            first, held_end = run.first_block, run.num_blocks
            if not blocks and keep <= first:  # the common step: nothing moves
                continue
            # held blocks before the window go back, then reserved ones before it (an import
            # skips whole blocks, so the reserved run may start past the held one)
            gone = run.table[first : min(held_end, keep)].tolist() if first < held_end else []
            if blocks:
                start = starts[rec.request_id]
                run.table[start : start + len(blocks)] = blocks
                gone += blocks[: max(0, keep - start)]
            shared = min(run.num_prefix_blocks, keep) - first  # cached blocks it held
            if shared > 0:  # automatically cached blocks: one reference less, not freed
                self.block_cache.release(gone[:shared])
                gone = gone[shared:]
            if gone:
                release(gone, request_owner(rec.request_id))
            run.first_block, run.num_blocks = keep, end

    def check_partial_commit(self, transaction_id: int, part: Reservation) -> None:
        if part.token_rows is not None:  # the kept tokens may be among the unstored ones
            raise ValueError(
                f"transaction {transaction_id} did not store every token in "
                f"sliding-window KV group {self.index} (more tokens than its window "
                f"{self.window} keeps): it commits whole or aborts"
            )


def manager_kind(spec: KVGroupSpec) -> type[GroupManager]:
    """The manager class of a group of ``spec``."""
    return FullAttentionManager if spec.window is None else SlidingWindowManager


def make_manager(group: LayerGroup, single: bool) -> GroupManager:
    """The manager of ``group``'s kind (``single``: the cache has no other group)."""
    return manager_kind(group.spec)(group, single)
