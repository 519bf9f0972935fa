"""Multi-layer token transactions: the one open reservation and the tombstones of closed ones.

``begin_token`` reserves one slot per request; its positions, physical block ids, offsets, block
tables and lengths are packed into one host buffer and copied to the device once. The cache
keeps those device tensors here, looked up by transaction id, so the per-layer write path needs
no host work beyond structural checks. Callers get a *detached* ``TokenTransactionView`` (its own
copies), so editing the view cannot redirect a write.

After commit or abort only a tombstone (id, cache version, request ids, final state) is kept,
in a bounded deque, to tell "already committed" from "unknown" for recent handles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from flashdec.cache.state import RequestId

HISTORY_LIMIT = 256


class TransactionState(StrEnum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True, eq=False)
class TokenTransactionView:
    """A detached snapshot of a token transaction; editing its tensors changes nothing.

    ``block_tables`` include the slot reserved for the new token. ``seq_lens`` are the lengths
    before the token (open/aborted) or after it (the view ``commit_token`` returns).
    """

    transaction_id: int
    cache_version: int
    request_ids: tuple[RequestId, ...]
    positions: torch.Tensor  # [B] int32, where the new token goes (= pre-append seq_len)
    block_ids: torch.Tensor  # [B] int32, physical block of the new token
    offsets: torch.Tensor  # [B] int32, slot inside that block
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    state: TransactionState


TokenTransaction = TokenTransactionView  # the handle callers hold is the view


@dataclass(frozen=True)
class Tombstone:
    transaction_id: int
    cache_version: int
    request_ids: tuple[RequestId, ...]
    state: TransactionState


class TransactionMetadata:
    """Device tensors of one reservation, all slices of a single int32 buffer."""

    __slots__ = (
        "block_ids",
        "block_tables",
        "buffer",
        "offsets",
        "positions",
        "seq_lens",
        "seq_lens_after",
        "slot_rows",
    )

    def __init__(self, buffer: torch.Tensor, batch: int, width: int) -> None:
        self.buffer = buffer
        rows = buffer[: 5 * batch].view(5, batch)
        self.positions = rows[0]
        self.block_ids = rows[1]
        self.offsets = rows[2]
        self.seq_lens = rows[3]
        self.seq_lens_after = rows[4]
        table_end = 5 * batch + batch * width
        self.block_tables = buffer[5 * batch : table_end].view(batch, width)
        # [B * Hkv] rows of the new token's slots in a layer viewed as [blocks*Hkv*bs, D]
        self.slot_rows = buffer[table_end:]

    @classmethod
    def upload(
        cls,
        positions: list[int],
        block_ids: list[int],
        tables: Sequence[np.ndarray],
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> TransactionMetadata:
        """Pack on the host and copy to ``device`` in one transfer (pinned + async on CUDA).

        ``tables`` are the requests' committed table rows; each new token's block id is written
        at its logical index, so the uploaded tables already cover the reserved slot.
        """
        batch, width = len(tables), tables[0].shape[0]
        pinned = device.type == "cuda"
        table_end = 5 * batch + batch * width
        host = torch.empty(table_end + batch * num_kv_heads, dtype=torch.int32, pin_memory=pinned)
        arr = host.numpy()
        pos = np.asarray(positions, dtype=np.int32)
        ids = np.asarray(block_ids, dtype=np.int32)
        arr[0:batch] = pos
        arr[batch : 2 * batch] = ids
        arr[2 * batch : 3 * batch] = pos % block_size
        arr[3 * batch : 4 * batch] = pos
        arr[4 * batch : 5 * batch] = pos + 1
        table_rows = arr[5 * batch : table_end].reshape(batch, width)
        np.stack(tables, out=table_rows)  # rows copied straight into the upload buffer
        table_rows[np.arange(batch), pos // block_size] = ids
        heads = np.arange(num_kv_heads, dtype=np.int32)
        slot_rows = (ids[:, None] * num_kv_heads + heads[None, :]) * block_size + (
            pos % block_size
        )[:, None]
        arr[table_end:] = slot_rows.reshape(-1)
        buffer = host.to(device, non_blocking=True) if pinned else host
        return cls(buffer, batch, width)

    def detached(self) -> TransactionMetadata:
        """A copy for a view (one device copy, no host sync)."""
        batch = self.positions.shape[0]
        return TransactionMetadata(self.buffer.clone(), batch, self.block_tables.shape[1])


class OpenTransaction:
    """Everything the cache keeps for the one open transaction."""

    __slots__ = (
        "backup_k",
        "backup_v",
        "cache_version",
        "metadata",
        "next_layer",
        "request_ids",
        "reserved",
        "transaction_id",
    )

    def __init__(
        self,
        transaction_id: int,
        cache_version: int,
        request_ids: tuple[RequestId, ...],
        reserved: dict[RequestId, int],
        metadata: TransactionMetadata,
    ) -> None:
        self.transaction_id = transaction_id
        self.cache_version = cache_version
        self.request_ids = request_ids
        self.reserved = reserved  # request id -> block begin_token took for it (new blocks only)
        self.metadata = metadata
        self.next_layer = 0  # layers [0, next_layer) are written
        self.backup_k: torch.Tensor | None = None  # old bytes of the reserved slots, for abort
        self.backup_v: torch.Tensor | None = None

    def view(self, state: TransactionState, cache_version: int) -> TokenTransactionView:
        meta = self.metadata.detached()
        seq_lens = meta.seq_lens_after if state is TransactionState.COMMITTED else meta.seq_lens
        return TokenTransactionView(
            transaction_id=self.transaction_id,
            cache_version=cache_version,
            request_ids=self.request_ids,
            positions=meta.positions,
            block_ids=meta.block_ids,
            offsets=meta.offsets,
            block_tables=meta.block_tables,
            seq_lens=seq_lens,
            state=state,
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
        if isinstance(handle, TokenTransactionView):
            tx_id = handle.transaction_id
        elif isinstance(handle, int) and not isinstance(handle, bool):
            tx_id = handle
        else:
            raise TypeError(
                "expected a TokenTransactionView or an int transaction id, "
                f"got {type(handle).__name__}"
            )
        if self.open is not None and self.open.transaction_id == tx_id:
            return self.open
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
