"""The shapes the cache's storage parts name of one another.

A group holds its slot buffers, which the slot builders (``flashdec.cache.slots``) make from a
group; a plan remembers the batch memo that builds it; a transaction's views read the table rows
a plan made. Importing the owning modules for these names would close import cycles between the
parts, so they name each other through the shapes here. Each Protocol lists the members that
the module naming it reads; the owning class implements it without naming it (and its own
module, which made the object, uses it as that class).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

# per request of a transaction: (committed row of its table, first held block, committed end,
# reserved blocks, logical index of the first reserved one); or a callable that makes that list
TableRow = tuple[np.ndarray, int, int, Sequence[int], int]
TableRows = Sequence[TableRow] | Callable[[], Sequence[TableRow]]


class RepeatedBatch(Protocol):
    """What a plan's ``memo`` (:class:`~flashdec.cache.batch_memo.BatchMemo`) is read for: the
    committed step it reflects, whose metadata the fixed slot buffers may still hold."""

    last_transaction: int


class WriterBackupBuffers(Protocol):
    """What a :class:`~flashdec.cache.layer_group.LayerGroup` uses of its
    :class:`~flashdec.cache.slots.SlotBuffers`: the writer backup it makes there, sized by their
    capacity, its views keyed by their generation."""

    capacity: int
    generation: int
    writer_backup: torch.Tensor | None
