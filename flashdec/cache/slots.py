"""A step's device metadata: :class:`TransactionSlots`, the fixed-address :class:`SlotBuffers`
of one-token steps, and building both from a planned reservation.

This is the device side of a transaction (the cache's reservation is host bookkeeping): the
cache calls :func:`fresh_slots` (prompt imports, legacy append: new tensors) or
:func:`fixed_slots` (one-token steps: the group's fixed buffers, so a CUDA graph captured over a
step's layers replays for the next step of the same batch) once per group and step, and reads
nothing else from here.
"""

from __future__ import annotations

import numpy as np
import torch

from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.reservation import NO_UPDATES, Plan, Reservation

PAD_BLOCK_ID = -1  # block id of a padding row: writers skip it, decode sees seq_len 0


class TransactionSlots:
    """Device metadata of one reservation, read by the write paths and by decode.

    One row per reserved token (``positions``, ``block_ids``, ``offsets``; ``slot_rows`` has
    ``num_kv_heads`` rows per token: the token's rows in a layer viewed as
    ``[blocks * Hkv * block_size, D]``) and one row per request (``seq_lens``,
    ``seq_lens_after``, ``block_tables``, ``request_slots``: a stable index per active request,
    below ``cache.layout.num_request_slots``, that a caller can key per-request device state
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


Update = tuple[int, int, int]  # a device-table write: (row, logical block, block id)


def _flush_updates(group: LayerGroup, updates: list[Update]) -> list[Update]:
    """The group's pending device-table writes (an attached prefix's) and then ``updates``."""
    pending = group.pending_updates
    updates = pending + updates if pending else updates
    group.pending_updates = []
    return updates


def _flat_updates(updates: list[Update], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Device-table writes ``(row, logical block, block id)`` as flat indices and values."""
    if not updates:
        return NO_UPDATES
    arr = np.asarray(updates, dtype=np.int64)
    return arr[:, 0] * width + arr[:, 1], arr[:, 2]


# int64 elements per 16 bytes: Triton specialises a kernel on each pointer's 16-byte alignment,
# so a part starting after an odd-length one would compile another variant mid-serving
_ALIGN = 2


def _aligned_upload(pieces: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """``pieces`` (int64) on ``device`` in one copy, each part starting 16-byte aligned."""
    sizes = [piece.shape[0] for piece in pieces]
    starts = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in sizes])
    host = np.zeros(int(starts[-1]), dtype=np.int64)
    for start, piece in zip(starts, pieces, strict=False):
        host[start : start + piece.shape[0]] = piece
    dev = torch.from_numpy(host).to(device)
    return [dev[start : start + n] for start, n in zip(starts, sizes, strict=False)]


def fresh_slots(group: LayerGroup, plan: Plan, part: Reservation) -> TransactionSlots:
    """Device metadata in new tensors (prompt imports, legacy append)."""
    positions, block_ids = plan.positions, part.block_ids
    if part.token_rows is not None:
        positions = positions[part.token_rows]
    bs, hkv = group.block_size, group.num_kv_heads
    offsets = positions % bs
    starts = np.asarray([rec.seq_len for rec in plan.records], dtype=np.int64)
    after = starts + np.asarray(plan.counts, dtype=np.int64)
    heads = np.arange(hkv, dtype=np.int64)
    slot_rows = (block_ids.astype(np.int64)[:, None] * hkv + heads) * bs + offsets[:, None]
    flat, values = _flat_updates(_flush_updates(group, part.updates), group.width)
    rows = np.asarray([rec.row for rec in plan.records], dtype=np.int64)
    token_rows = part.token_rows if part.token_rows is not None else np.zeros(0, np.int64)
    pieces = (
        positions,
        block_ids,
        offsets,
        starts,
        after,
        rows,
        flat,
        values,
        token_rows,
        slot_rows.reshape(-1),
    )
    t, b, u = positions.shape[0], starts.shape[0], flat.shape[0]
    parts = _aligned_upload(pieces, group.device)
    if u:
        group.tables.write(parts[6], parts[7])
    tables = torch.empty(b, group.width, dtype=torch.int64, device=group.device)
    group.tables.gather(parts[5], out=tables)
    return TransactionSlots(
        batch=b,
        num_rows=b,
        num_tokens=t,
        generation=-1,
        positions=parts[0],
        block_ids=parts[1],
        offsets=parts[2],
        seq_lens=parts[3],
        seq_lens_after=parts[4],
        slot_rows=parts[9],
        block_tables=tables,
        request_slots=parts[5],
        token_rows=None if part.token_rows is None else parts[8],
    )


def fixed_slots(
    group: LayerGroup, plan: Plan, part: Reservation, num_rows: int, transaction_id: int
) -> TransactionSlots:
    """Device metadata of a one-token transaction in the group's fixed-address buffers."""
    buffers = group.slot_buffers
    if buffers is None or num_rows > buffers.capacity:
        capacity = 1 << max(3, (num_rows - 1).bit_length())
        generation = 0 if buffers is None else buffers.generation + 1
        buffers = group.slot_buffers = SlotBuffers(
            capacity, group.num_kv_heads, group.width, group.device, generation
        )
    num = len(plan.records)
    memo, tx_id = plan.memo, transaction_id
    if (
        memo is not None
        and part.update_arrays is not None
        and not part.update_arrays[0].shape[0]
        and not group.pending_updates
        and buffers.advance_resident(memo.last_transaction, tx_id, num, num_rows)
    ):  # the last step's metadata, one token on: nothing to pack, copy or gather
        return buffers.slots(num, num_rows)
    width, tables = group.width, group.tables
    if part.update_arrays is not None:
        if group.pending_updates:  # never with a valid memo; kept exact all the same
            pending = _flat_updates(_flush_updates(group, []), width)
            tables.write(*(torch.from_numpy(a).to(group.device) for a in pending))
        flat, values, in_batch = part.update_arrays
    else:
        pending = bool(group.pending_updates)
        flat, values = _flat_updates(_flush_updates(group, part.updates), width)
        in_batch = NO_UPDATES[0]
        if not pending and part.update_batch:  # the same entries in the batch's tables
            in_batch = np.asarray(part.update_batch, dtype=np.int64) * width + flat % width
        elif pending:
            buffers.set_gathered(None, 0, 0)  # other rows' writes: gather anew
    if flat.shape[0] > buffers.capacity:  # a long prefix attached since the last step
        tables.write(*(torch.from_numpy(a).to(group.device) for a in (flat, values)))
        flat, values, in_batch = (*NO_UPDATES, NO_UPDATES[0])
        buffers.set_gathered(None, 0, 0)
    rows = plan.rows
    if rows is None:
        rows = np.fromiter((rec.row for rec in plan.records), dtype=np.int64, count=num)
    # the batch's tables as of the last step, when nothing but its own writes came since
    reuse = buffers.gathered(rows, num_rows, tables.version) and (
        in_batch.shape[0] == flat.shape[0]
    )
    buffers.upload(
        plan.positions,
        part.block_ids,
        rows,
        (flat, values, in_batch),
        group.block_size,
        num_rows,
        tx_id,
    )
    count = flat.shape[0]
    slots = buffers.slots(num, num_rows)
    if count:
        update_values = buffers.region(buffers.UPDATE_VALUE, count)
        tables.write(buffers.region(buffers.UPDATE_INDEX, count), update_values)
        if reuse:
            buffers.tables_flat.index_copy_(
                0, buffers.region(buffers.UPDATE_BATCH, count), update_values
            )
    if not reuse:
        tables.gather(buffers.region(buffers.TABLE_ROWS, num_rows), out=slots.block_tables)
    buffers.set_gathered(rows, num_rows, tables.version)
    return slots
