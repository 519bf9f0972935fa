"""Token transactions: the one open reservation, its device metadata, and closed tombstones.

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

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from flashdec.cache.state import RequestId

if TYPE_CHECKING:
    from flashdec.cache.slots import TransactionSlots

HISTORY_LIMIT = 256
# per request of a transaction: (committed row of its table, first held block, committed end,
# reserved blocks, logical index of the first reserved one); or a callable that makes that list
TableRow = tuple[np.ndarray, int, int, Sequence[int], int]
TableRows = Sequence[TableRow] | Callable[[], Sequence[TableRow]]


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
