"""The device mirror of every active request's block table.

Each request resident in the cache owns one row of a ``[rows, max_blocks_per_seq]`` int32 device
tensor. A transaction writes only the entries it changes (a new block at a block boundary, a
prompt's blocks, an attached prefix) and gathers the rows of its batch on the device, so the host
work of a decode step is proportional to the batch, not to the table width.

Entries past a request's committed blocks may hold stale ids (of an aborted reservation or of the
row's previous owner): nothing reads them, since every reader is bounded by the request's length.
"""

from __future__ import annotations

import torch


class DeviceTables:
    """Rows of device block tables handed out to requests; grows by doubling. int64, like the
    slot buffers, so writes and gathers need no index conversion."""

    def __init__(self, width: int, device: torch.device, rows: int = 16) -> None:
        self.width = width
        self.device = device
        self.tensor = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self._flat = self.tensor.view(-1)
        self._free = list(range(rows - 1, -1, -1))
        # bumped by every change of the tensor's contents or address: a copy of some rows
        # gathered at one version is still exact while the version holds
        self.version = 0

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[0]

    def acquire(self) -> int:
        """A free row for a new request (the tensor doubles when none is left)."""
        if not self._free:
            old = self.tensor
            rows = old.shape[0]
            self.tensor = torch.zeros(2 * rows, self.width, dtype=torch.int64, device=self.device)
            self.tensor[:rows] = old
            self._flat = self.tensor.view(-1)
            self._free = list(range(2 * rows - 1, rows - 1, -1))
            self.version += 1
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)

    def write(self, flat_index: torch.Tensor, values: torch.Tensor) -> None:
        """``tensor.view(-1)[flat_index[i]] = values[i]`` (``flat = row * width + column``)."""
        self._flat.index_copy_(0, flat_index, values)
        self.version += 1

    def gather(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rows ``rows`` (int64 indices) into ``out`` ``[len(rows), width]``."""
        return torch.index_select(self.tensor, 0, rows, out=out)
