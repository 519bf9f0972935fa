"""Token transactions: the one open reservation, its undo (old bytes, kept blocks), and closed
tombstones.

A transaction reserves ``num_tokens[i]`` consecutive slots for request ``i`` (one per request for a
decode step, a whole prompt for a prefill). Its device metadata
(:class:`~flashdec.cache.slots.TransactionSlots`, built in ``flashdec.cache.slots``) is what the
per-layer write paths and the decode kernel read.

Callers get a *detached* :class:`TokenTransactionView`: it keeps its own host copies and makes
device tensors only when a field is read, so editing a view can never redirect a write, and
beginning a transaction costs no device copy for the view.

After commit or abort only a tombstone (id, cache version, request ids, final state) is kept, in a
bounded deque, to tell "already committed" from "unknown" for recent handles.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from flashdec.cache.part_types import TableRows
from flashdec.cache.state import RequestId

if TYPE_CHECKING:
    from flashdec.cache.layer_group import LayerGroup
    from flashdec.cache.slots import TransactionSlots

HISTORY_LIMIT = 256


class TransactionState(StrEnum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class TokenTransactionView:
    """A detached, read-only description of a token transaction.

    ``positions``, ``block_ids`` and ``offsets`` have one entry per reserved token
    (``[num_tokens]``, request by request); ``block_tables`` ``[B, max_blocks_per_seq]`` include
    the reserved slots (entries past a request's blocks are 0); ``seq_lens`` ``[B]`` are the
    lengths before the transaction (open/aborted) or after it (the view ``commit_token`` returns).
    Tensors live on the cache's device and are made on first access from the view's own host
    copies.
    """

    __slots__ = (
        "_device",
        "_host",
        "_table_rows",
        "_table_width",
        "_tensors",
        "cache_version",
        "request_ids",
        "state",
        "transaction_id",
    )

    def __init__(
        self,
        transaction_id: int,
        cache_version: int,
        request_ids: tuple[RequestId, ...],
        state: TransactionState,
        host: dict[str, np.ndarray],
        table_rows: TableRows,
        table_width: int,
        device: torch.device,
    ) -> None:
        init = object.__setattr__
        init(self, "transaction_id", transaction_id)
        init(self, "cache_version", cache_version)
        init(self, "request_ids", request_ids)
        init(self, "state", state)
        init(self, "_host", host)
        # (committed row of the request's table, its first held and end block, reserved blocks,
        # the logical index of the first reserved one): committed entries never change while the
        # row object lives (terminal requests get a fresh row), so the table can be built lazily;
        # a callable makes that list on first use (from a snapshot it captured)
        init(self, "_table_rows", table_rows if callable(table_rows) else tuple(table_rows))
        init(self, "_table_width", table_width)
        init(self, "_device", device)
        init(self, "_tensors", {})

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TokenTransactionView is read-only (cannot set {name!r})")

    def _tensor(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            if name == "block_tables":
                table_rows = self._table_rows
                if callable(table_rows):
                    table_rows = table_rows()
                host = np.zeros((len(table_rows), self._table_width), dtype=np.int32)
                for i, (row, first, committed, reserved, start) in enumerate(table_rows):
                    host[i, first:committed] = row[first:committed]
                    host[i, start : start + len(reserved)] = reserved
            else:
                host = self._host[name]
            # always a copy: a caller editing it must not reach the host arrays other views share
            tensor = self._tensors[name] = torch.from_numpy(host).to(self._device, copy=True)
        return tensor

    @property
    def positions(self) -> torch.Tensor:
        """``[num_tokens]`` int32: where each reserved token goes (its position in the request)."""
        return self._tensor("positions")

    @property
    def block_ids(self) -> torch.Tensor:
        """``[num_tokens]`` int32: physical block of each reserved token in group 0 (-1 for a
        token a window group does not store)."""
        return self._tensor("block_ids")

    @property
    def offsets(self) -> torch.Tensor:
        """``[num_tokens]`` int32: slot of each reserved token inside its block."""
        return self._tensor("offsets")

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[B]`` int32: lengths before (open/aborted) or after (committed) the transaction."""
        return self._tensor("seq_lens")

    @property
    def block_tables(self) -> torch.Tensor:
        """``[B, max_blocks_per_seq]`` int32, including the reserved slots, 0-padded."""
        return self._tensor("block_tables")

    @property
    def host_positions(self) -> np.ndarray:
        """``positions`` as a read-only host array (no device copy)."""
        positions = self._host["positions"].view()
        positions.flags.writeable = False
        return positions

    @property
    def host_seq_lens(self) -> np.ndarray:
        """``seq_lens`` as a read-only host array (no device copy)."""
        lens = self._host["seq_lens"].view()
        lens.flags.writeable = False
        return lens

    @property
    def num_tokens(self) -> int:
        return int(self._host["positions"].shape[0])

    def __repr__(self) -> str:
        return (
            f"TokenTransactionView(transaction_id={self.transaction_id}, "
            f"state={self.state.value!r}, request_ids={self.request_ids!r}, "
            f"num_tokens={self.num_tokens}, cache_version={self.cache_version})"
        )


TokenTransaction = TokenTransactionView  # the handle callers hold is the view


@dataclass(frozen=True)
class Tombstone:
    transaction_id: int
    cache_version: int
    request_ids: tuple[RequestId, ...]
    state: TransactionState


class OpenTransaction:
    """Everything the cache keeps for the one open transaction."""

    __slots__ = (
        "attempted",
        "backup_complete",
        "backups",
        "cache_version",
        "counts",
        "group_slots",
        "host",
        "memo",
        "next_layer",
        "num_tokens",
        "one_each",
        "parts",
        "request_ids",
        "reserved",
        "slots",
        "starts",
        "table_rows",
        "transaction_id",
    )

    def __init__(
        self,
        transaction_id: int,
        cache_version: int,
        request_ids: tuple[RequestId, ...],
        counts: list[int],
        reserved: list[dict[RequestId, list[int]]],
        starts: list[dict[RequestId, int]],
        group_slots: list[TransactionSlots],
        host: dict[str, np.ndarray],
        table_rows: TableRows,
    ) -> None:
        self.transaction_id = transaction_id
        self.cache_version = cache_version
        self.request_ids = request_ids
        self.counts = counts  # tokens reserved per request
        self.num_tokens = sum(counts)
        # per KV group: request id -> blocks begin took for it (new blocks only), and the
        # logical index of the first of them
        self.reserved = reserved
        self.starts = starts
        self.group_slots = tuple(group_slots)
        self.slots = group_slots[0]
        self.host = host  # host copies of positions, block_ids, offsets, seq_lens, seq_lens_after
        self.table_rows = table_rows  # group 0's, for the views
        self.parts: list = []  # the cache's per-group reservations, for views of other groups
        self.next_layer = 0  # layers [0, next_layer) are written
        self.attempted = 0  # layers [0, attempted) had a writer called (it may have raised)
        # per group: old K and V bytes of the slots, for abort; complete, or filled by each
        # layer's writer (then valid for the attempted layers only)
        self.backups: list[torch.Tensor] | None = None
        self.backup_complete = True
        self.one_each = False  # one token per request (begin_token)
        self.memo = None  # the repeated batch it was planned from (BatchMemo), if any

    # ---- undo: the old bytes of the reserved slots and the blocks a partial commit keeps ----
    def save_backups(self, groups: Sequence[LayerGroup], by_writer: bool, fixed: bool) -> None:
        """Per group ``[2L, T * Hkv, D]`` old bytes of the reserved slots, for abort (and the
        rejected tokens of a partial commit). ``by_writer``: the writers fill them layer by
        layer (in the slot buffers' writer backup); ``fixed``: a one-token step's reused
        buffer."""
        pairs = zip(groups, self.group_slots, strict=True)
        if by_writer:
            self.backups = [group.writer_backup(s.slot_rows.shape[0])[0] for group, s in pairs]
            self.backup_complete = False
        else:
            self.backups = [group.backup(s.slot_rows, fixed=fixed) for group, s in pairs]

    def writer_backup(self, group: LayerGroup) -> torch.Tensor | None:
        """Where ``group``'s writers save old bytes (the group's dtype), None when the backup is
        not theirs (or there is none)."""
        if self.backups is None or self.backup_complete:
            return None
        return group.writer_backup(self.backups[group.index].shape[1])[1]

    def complete_backup(self, groups: Sequence[LayerGroup]) -> None:
        """Copy every layer's reserved slots into a writers' backup now (no layer written yet)."""
        if self.backups is None or self.backup_complete:
            return
        if self.attempted:
            raise RuntimeError(
                f"token transaction {self.transaction_id} already has layers written; "
                "complete_backup must come before the first"
            )
        for group, backup, slots in zip(groups, self.backups, self.group_slots, strict=True):
            backup.copy_(group.slot_rows.index_select(1, slots.slot_rows))
        self.backup_complete = True

    def restore_all(self, groups: Sequence[LayerGroup]) -> None:
        """Abort: put back the old bytes of every layer a writer was called for (even with no
        layer counted: a writer that raised may have stored part of one)."""
        if self.backups is None:
            return
        complete, attempted = self.backup_complete, self.attempted
        for group, backup, slots in zip(groups, self.backups, self.group_slots, strict=True):
            # writers' backups: only the attempted layers (the group's first ones) hold any
            layers = len(group.layers) if complete else bisect_left(group.layers, attempted)
            group.restore(slots.slot_rows, backup, layers)

    def restore_rejected(self, groups: Sequence[LayerGroup], kept: np.ndarray) -> None:
        """A partial commit: put back the old bytes of the tokens not ``kept`` (``[T]`` bool,
        per token of the transaction). Every layer is written, so each backup is whole."""
        if self.backups is None:
            return
        for group, backup, slots, part in zip(
            groups, self.backups, self.group_slots, self.parts, strict=True
        ):
            stored = kept if part.token_rows is None else kept[part.token_rows]
            rejected = np.flatnonzero(~stored)
            if not rejected.shape[0]:
                continue
            heads = np.arange(group.num_kv_heads)
            rows = (rejected[:, None] * group.num_kv_heads + heads).reshape(-1)
            rows_t = torch.from_numpy(rows).to(group.device)
            group.restore(
                slots.slot_rows.index_select(0, rows_t),
                backup.index_select(1, rows_t),
                len(group.layers),
            )

    def split_reserved(
        self, records: Sequence, accept: Sequence[int], block_sizes: Sequence[int]
    ) -> tuple[list[dict[RequestId, list[int]]], list[list[tuple[RequestId, list[int]]]]]:
        """Per group the reserved blocks the first ``accept[i]`` tokens still need (to publish)
        and those past them (to release), as ``(request id, blocks)``; and the views' tables
        from now on show only the kept ones."""
        kept, gone = [], []
        for per_request, starts, bs in zip(self.reserved, self.starts, block_sizes, strict=True):
            keep_reserved, release = {}, []
            for rec, a in zip(records, accept, strict=True):
                blocks = per_request.get(rec.request_id)
                if not blocks:
                    continue
                needed = -(-(rec.seq_len + a) // bs) - starts[rec.request_id]
                keep_reserved[rec.request_id] = blocks[: max(0, needed)]
                if needed < len(blocks):
                    release.append((rec.request_id, blocks[max(0, needed) :]))
            kept.append(keep_reserved)
            gone.append(release)
        host = self.host
        host["seq_lens_after"] = host["seq_lens"] + np.asarray(accept, dtype=host["seq_lens"].dtype)
        table_rows = self.table_rows() if callable(self.table_rows) else self.table_rows
        first_kept = kept[0]
        self.table_rows = [  # the committed view's tables show only the blocks kept
            (row, first, end, first_kept.get(rid, ()) if taken else taken, start)
            for rid, (row, first, end, taken, start) in zip(
                self.request_ids, table_rows, strict=True
            )
        ]
        return kept, gone

    def view(
        self,
        state: TransactionState,
        cache_version: int,
        width: int,
        device: torch.device,
        group: tuple[np.ndarray, np.ndarray, list] | None = None,
    ) -> TokenTransactionView:
        """A detached view; ``group`` = (block ids, offsets, table rows) of another KV group
        than group 0."""
        host = self.host
        lens = host["seq_lens_after"] if state is TransactionState.COMMITTED else host["seq_lens"]
        block_ids, offsets, table_rows = (
            (host["block_ids"], host["offsets"], self.table_rows) if group is None else group
        )
        return TokenTransactionView(
            transaction_id=self.transaction_id,
            cache_version=cache_version,
            request_ids=self.request_ids,
            state=state,
            host={
                "positions": host["positions"],
                "block_ids": block_ids,
                "offsets": offsets,
                "seq_lens": lens,
            },
            table_rows=table_rows,
            table_width=width,
            device=device,
        )


class TransactionLog:
    """At most one open transaction plus a bounded history of tombstones."""

    def __init__(self, history_limit: int = HISTORY_LIMIT) -> None:
        self._next_id = 1
        self.open: OpenTransaction | None = None
        self.history: deque[Tombstone] = deque(maxlen=history_limit)
        self.history_limit = history_limit
        self.num_committed = 0
        self.num_aborted = 0

    def ensure_none_open(self, action: str) -> None:
        if self.open is not None:
            raise RuntimeError(
                f"cannot {action} while token transaction {self.open.transaction_id} is open; "
                "commit or abort it first"
            )

    def next_id(self) -> int:
        return self._next_id

    def start(self, tx: OpenTransaction) -> None:
        self.ensure_none_open("begin a token transaction")
        if tx.transaction_id != self._next_id:
            raise RuntimeError("transaction ids must be issued in order")
        self._next_id += 1
        self.open = tx

    def resolve(self, handle: object) -> OpenTransaction:
        """The open transaction ``handle`` (a view or its integer id) names, else an error."""
        open_tx = self.open
        if isinstance(handle, TokenTransactionView):
            tx_id = handle.transaction_id
        elif isinstance(handle, int) and not isinstance(handle, bool):
            tx_id = handle
        else:
            raise TypeError(
                "expected a TokenTransactionView or an int transaction id, "
                f"got {type(handle).__name__}"
            )
        if open_tx is not None and open_tx.transaction_id == tx_id:
            return open_tx
        for tomb in self.history:
            if tomb.transaction_id == tx_id:
                raise RuntimeError(
                    f"token transaction {tx_id} was already {tomb.state.value} "
                    f"(at cache version {tomb.cache_version})"
                )
        raise RuntimeError(
            f"unknown token transaction {tx_id}: not open and not among the "
            f"{self.history_limit} most recent closed ones"
        )

    def close(self, state: TransactionState, cache_version: int) -> Tombstone:
        tx = self.open
        if tx is None:
            raise RuntimeError("no token transaction is open")
        tomb = Tombstone(tx.transaction_id, cache_version, tx.request_ids, state)
        self.history.append(tomb)
        self.open = None
        if state is TransactionState.COMMITTED:
            self.num_committed += 1
        else:
            self.num_aborted += 1
        return tomb
