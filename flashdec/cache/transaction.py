"""Token transactions: the one open reservation, its device metadata, and closed tombstones.

A transaction reserves ``num_tokens[i]`` consecutive slots for request ``i`` (one per request for a
decode step, a whole prompt for a prefill). Its device metadata (:class:`TransactionSlots`) is
what the per-layer write paths and the decode kernel read; it lives in fixed-address buffers
(:class:`SlotBuffers`) for one-token transactions, so a step that was captured in a CUDA graph can
be replayed for the next step of the same batch after only the host-side ``begin_token``.

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

import numpy as np
import torch

from flashdec.cache.state import RequestId

HISTORY_LIMIT = 256
# per request of a transaction: (committed row of its table, first held block, committed end,
# reserved blocks, logical index of the first reserved one); or a callable that makes that list
TableRow = tuple[np.ndarray, int, int, Sequence[int], int]
TableRows = Sequence[TableRow] | Callable[[], Sequence[TableRow]]
PAD_BLOCK_ID = -1  # block id of a padding row: writers skip it, decode sees seq_len 0


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


class TransactionSlots:
    """Device metadata of one reservation, read by the write paths and by decode.

    One row per reserved token (``positions``, ``block_ids``, ``offsets``; ``slot_rows`` has
    ``num_kv_heads`` rows per token: the token's rows in a layer viewed as
    ``[blocks * Hkv * block_size, D]``) and one row per request (``seq_lens``,
    ``seq_lens_after``, ``block_tables``, ``request_slots``: a stable index per active request,
    below :attr:`PagedKVCache.num_request_slots`, that a caller can key per-request device state
    on). ``token_rows`` (None: row ``t`` is token ``t``) maps each row to the transaction's
    token it stores, when a window group stores only some tokens of a prompt import; writers
    then store ``k[token_rows]``. ``num_rows`` >= batch counts padding rows (block id
    ``PAD_BLOCK_ID``, length 0, slot 0) that a CUDA graph captured for a bigger batch reads.
    These are the cache's own tensors: read them, never write them.
    """

    __slots__ = (
        "batch",
        "block_ids",
        "block_tables",
        "generation",
        "num_rows",
        "num_tokens",
        "offsets",
        "positions",
        "request_slots",
        "seq_lens",
        "seq_lens_after",
        "slot_rows",
        "token_rows",
    )

    def __init__(self, **fields: object) -> None:
        for name in self.__slots__:
            setattr(self, name, fields[name])


class SlotBuffers:
    """Fixed-address device buffers for one-token transactions of up to ``capacity`` rows.

    Every transaction fills one pageable host staging buffer and copies it to the device in one
    transfer; the block tables are then gathered on the device from the cache's persistent
    :class:`~flashdec.cache.device_tables.DeviceTables`. Views of these buffers keep their
    addresses across transactions (and are built once per batch shape); the cache replaces the
    whole object (new ``generation``) only when a bigger batch needs more rows. int64 throughout:
    the index ops that read these buffers take int64 without a conversion launch.
    """

    # regions of ``capacity`` entries each, then the slot rows (capacity * num_kv_heads)
    POSITIONS, BLOCK_IDS, OFFSETS, SEQ_LENS, SEQ_LENS_AFTER, TABLE_ROWS = range(6)
    # device-table writes: flat index, block id, and the flat index of the same entry in the
    # batch's gathered tables (applied there too when the gather is skipped)
    UPDATE_INDEX, UPDATE_VALUE, UPDATE_BATCH = 6, 7, 8
    NUM_REGIONS = 9

    def __init__(
        self, capacity: int, num_kv_heads: int, width: int, device: torch.device, generation: int
    ) -> None:
        self.capacity = capacity
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.generation = generation
        # [2 * layers, capacity * Hkv, D]: the old bytes of a transaction's slots when its
        # writers save them (made on first use; replaced with these buffers, so a CUDA graph
        # that wrote it is recaptured through the generation like the rest)
        self.writer_backup: torch.Tensor | None = None
        size = self.NUM_REGIONS * capacity + capacity * num_kv_heads
        # pageable, one copy, no events: a non_blocking copy from pageable memory stages the host
        # bytes before it returns (measured on the H200 host: 5 us, and rewriting the buffer right
        # after never changed what arrived), while pinned memory needs an event per upload (record
        # ~11 us with its current_stream lookup, plus a synchronize before the buffer is reused)
        self._staging = torch.zeros(size, dtype=torch.int64)
        self._host = self._staging.numpy()
        self._per_row = self._host[: 6 * capacity].reshape(6, capacity)
        # padding rows: position 0, block id PAD_BLOCK_ID, offset 0, lengths 0, table row 0
        self._padding = np.array([[0], [PAD_BLOCK_ID], [0], [0], [0], [0]], dtype=np.int64)
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.tables = torch.zeros(capacity, width, dtype=torch.int64, device=device)
        self.tables_flat = self.tables.view(-1)
        # what ``tables`` holds: the device-table rows gathered (as bytes), their count and the
        # device tables' version then; None when unknown
        self._gathered: tuple[bytes, int, int] | None = None
        self._views: dict[tuple, object] = {}  # fixed views, made once per shape
        # whose metadata ``device_buffer`` holds: (transaction id, batch, rows), or None
        self.resident: tuple[int, int, int] | None = None
        self._increments: dict[tuple[int, int], torch.Tensor] = {}  # see advance_resident
        self._heads = np.arange(num_kv_heads, dtype=np.int64)

    def _at(self, region: int, count: int) -> slice:
        start = region * self.capacity
        return slice(start, start + count)

    def upload(
        self,
        positions: np.ndarray,
        block_ids: np.ndarray,
        table_rows: np.ndarray,
        updates: tuple[np.ndarray, np.ndarray, np.ndarray],
        block_size: int,
        num_rows: int,
        transaction_id: int,
    ) -> None:
        """Pack transaction ``transaction_id`` into the staging buffer and copy it to the device.

        Rows ``[len(positions), num_rows)`` become padding (block id ``PAD_BLOCK_ID``, length 0).
        ``updates``: the device-table writes (flat index, block id, flat index in the batch's
        tables; the last may be empty when the tables are gathered anew).
        """
        host = self._host
        per_row = self._per_row  # [6, capacity] view of the six per-row regions
        batch = positions.shape[0]
        offsets = positions % block_size
        # one assignment per line of fields (few numpy calls: each costs microseconds)
        per_row[:, :batch] = (positions, block_ids, offsets, positions, positions + 1, table_rows)
        if num_rows > batch:
            per_row[:, batch:num_rows] = self._padding
        count = updates[0].shape[0]
        if count:
            host[self._at(self.UPDATE_INDEX, count)] = updates[0]
            host[self._at(self.UPDATE_VALUE, count)] = updates[1]
            if updates[2].shape[0]:
                host[self._at(self.UPDATE_BATCH, count)] = updates[2]
        start = self.NUM_REGIONS * self.capacity
        slot_rows = host[start : start + batch * self.num_kv_heads].reshape(batch, -1)
        # row of (block, head, offset) in a layer viewed as [blocks * Hkv * block_size, D]
        heads = self._heads
        np.add(
            (block_ids * (heads.shape[0] * block_size) + offsets)[:, None],
            heads * block_size,
            out=slot_rows,
        )
        self.device_buffer.copy_(self._staging, non_blocking=True)
        self.resident = (transaction_id, batch, num_rows)

    def advance_resident(
        self, previous_id: int, transaction_id: int, batch: int, num_rows: int
    ) -> bool:
        """When the device buffer holds transaction ``previous_id``'s metadata for this batch
        shape, move it on the device to the next token of every row — positions, offsets, both
        lengths and slot rows + 1, block ids and table rows as they are — and mark it as
        ``transaction_id``'s: one small add instead of packing and copying. Valid only when no
        row's next token starts a block (the caller knows). False, nothing done, otherwise."""
        if self.resident != (previous_id, batch, num_rows):
            return False
        increment = self._increments.get((batch, num_rows))
        if increment is None:
            if len(self._increments) >= 8:
                self._increments.clear()
            ones = np.zeros(self.device_buffer.shape[0], dtype=np.int64)
            for region in (self.POSITIONS, self.OFFSETS, self.SEQ_LENS, self.SEQ_LENS_AFTER):
                ones[self._at(region, batch)] = 1
            start = self.NUM_REGIONS * self.capacity
            ones[start : start + batch * self.num_kv_heads] = 1
            increment = torch.from_numpy(ones).to(self.device)
            self._increments[(batch, num_rows)] = increment
        self.device_buffer.add_(increment)
        self.resident = (transaction_id, batch, num_rows)
        return True

    def gathered(self, rows: np.ndarray, num_rows: int, version: int) -> bool:
        """Whether ``tables`` already holds device-table rows ``rows`` (then ``num_rows``
        total) as of device-table ``version``: the same batch as the last step, nothing else
        written since. Padding rows keep a copy of row 0 from some earlier gather: they are
        never read (length 0), and hold in-range ids either way."""
        gathered = self._gathered
        return (
            gathered is not None
            and gathered[1] == num_rows
            and gathered[2] == version
            and gathered[0] == rows.tobytes()
        )

    def set_gathered(self, rows: np.ndarray | None, num_rows: int, version: int) -> None:
        self._gathered = None if rows is None else (rows.tobytes(), num_rows, version)

    def region(self, region: int, count: int) -> torch.Tensor:
        key = (region, count)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.device_buffer[self._at(region, count)]
        return view

    def slots(self, batch: int, num_rows: int) -> TransactionSlots:
        key = ("slots", batch, num_rows)
        slots = self._views.get(key)
        if slots is None:
            start = self.NUM_REGIONS * self.capacity
            slots = self._views[key] = TransactionSlots(
                batch=batch,
                num_rows=num_rows,
                num_tokens=batch,
                generation=self.generation,
                positions=self.region(self.POSITIONS, num_rows),
                block_ids=self.region(self.BLOCK_IDS, num_rows),
                offsets=self.region(self.OFFSETS, num_rows),
                seq_lens=self.region(self.SEQ_LENS, num_rows),
                seq_lens_after=self.region(self.SEQ_LENS_AFTER, num_rows),
                slot_rows=self.device_buffer[start : start + batch * self.num_kv_heads],
                block_tables=self.tables[:num_rows],
                request_slots=self.region(self.TABLE_ROWS, num_rows),
                token_rows=None,
            )
        return slots


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
