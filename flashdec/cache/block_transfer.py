"""Whole-block copies between one KV group's paged storage and a pinned host buffer.

A group stores ``[2, layers, num_blocks, Hkv, block_size, D]``, so one block is ``2 * layers``
strided pieces. A transfer first gathers (down) or last scatters (up) the blocks on the device,
through one ``index_select`` / ``index_copy_`` over all of them, into a contiguous staging
buffer ``[n, 2, layers, Hkv, block_size, D]``; the host side then moves one contiguous run of
slots per copy, which is what a pinned ``copy_`` is fast at. Everything works on a byte view,
so FP8 groups take the same path.

On CUDA the host copies run on a side stream, so a copy down overlaps the step after the
eviction and a copy up overlaps the running batch's work:

- down: the gather is enqueued on the current stream where the eviction happens, before any
  later kernel can write into the evicted blocks; the side stream waits for the gather only;
- up: the side stream starts the host-to-device copy at once; the current stream waits for it
  before the scatter, so the step that reads the blocks sees them.

One side stream carries both directions, so a host slot reused by a later copy down never
races the copy up that read it. Staging buffers are handed to the other stream with
``record_stream``. On the CPU every copy is a plain synchronous ``copy_``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


def byte_blocks(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[2, layers, num_blocks, Hkv, block_size, D]`` as bytes, block-major:
    ``[num_blocks, 2, layers, Hkv, block_size, D * itemsize]`` (a view)."""
    return kv.view(torch.uint8).permute(2, 0, 1, 3, 4, 5)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first position, first slot, length)`` of each run of consecutive slots in
    ``slots`` (already sorted ascending)."""
    runs: list[tuple[int, int, int]] = []
    for pos, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((pos, slot, 1))
    return runs


class BlockTransfer:
    """Copies blocks of one group's ``kv`` to and from the host buffer ``host``
    (``[capacity, 2, layers, Hkv, block_size, D * itemsize]`` uint8, pinned on CUDA).

    ``seconds_down`` / ``seconds_up`` add up the time the copies took (CUDA: the side stream's
    events, read once they completed; CPU: the wall time of the copies)."""

    def __init__(self, kv: torch.Tensor, host: torch.Tensor) -> None:
        self._blocks = byte_blocks(kv)
        self._host = host
        self._device = kv.device
        self._cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if self._cuda else None
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds_down = 0.0
        self.seconds_up = 0.0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (every layer of the group, K and V)."""
        return self._host[0].numel()

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` on the device, through pinned memory on CUDA: a pageable upload may
        synchronise with the current stream (so the host would wait for the step's kernels,
        and in ``up`` for the whole copy the stream waits for), a pinned one never does (the
        pinned allocator keeps the buffer until the copy has run). ``flashdec.runtime.upload``
        does the same, but the cache may not import the runtime (tests/test_layering.py)."""
        ids = torch.tensor(block_ids, dtype=torch.long, pin_memory=self._cuda)
        return ids.to(self._device, non_blocking=self._cuda)

    def down(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy ``block_ids[i]`` into host slot ``slots[i]`` (``slots`` ascending)."""
        if not block_ids:
            return
        staging = self._blocks.index_select(0, self._index(block_ids))
        if not self._cuda:
            start = time.perf_counter()
            for pos, slot, n in slot_runs(slots):
                self._host[slot : slot + n].copy_(staging[pos : pos + n])
            self.seconds_down += time.perf_counter() - start
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self._device))  # the gather, no more
        with torch.cuda.stream(stream):
            begin, end = self._events()
            begin.record(stream)
            for pos, slot, n in slot_runs(slots):
                self._host[slot : slot + n].copy_(staging[pos : pos + n], non_blocking=True)
            end.record(stream)
        staging.record_stream(stream)
        self._timed.append(("down", begin, end))

    def up(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host slot ``slots[i]`` into block ``block_ids[i]`` (``slots`` ascending); the
        current stream's later work sees the blocks."""
        if not block_ids:
            return
        shape = (len(block_ids), *self._host.shape[1:])
        if not self._cuda:
            start = time.perf_counter()
            staging = torch.empty(shape, dtype=torch.uint8)
            for pos, slot, n in slot_runs(slots):
                staging[pos : pos + n].copy_(self._host[slot : slot + n])
            self._blocks.index_copy_(0, self._index(block_ids), staging)
            self.seconds_up += time.perf_counter() - start
            return
        stream, current = self._stream, torch.cuda.current_stream(self._device)
        with torch.cuda.stream(stream):  # staging belongs to the side stream's pool
            staging = torch.empty(shape, dtype=torch.uint8, device=self._device)
            begin, end = self._events()
            begin.record(stream)
            for pos, slot, n in slot_runs(slots):
                staging[pos : pos + n].copy_(self._host[slot : slot + n], non_blocking=True)
            end.record(stream)
        index = self._index(block_ids)  # before the wait: it runs beside the copy
        current.wait_stream(stream)
        self._blocks.index_copy_(0, index, staging)
        staging.record_stream(current)
        self._timed.append(("up", begin, end))

    @staticmethod
    def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def collect_timings(self) -> None:
        """Add the copies that have completed to ``seconds_down`` / ``seconds_up``."""
        pending = []
        for direction, begin, end in self._timed:
            if not end.query():
                pending.append((direction, begin, end))
                continue
            seconds = begin.elapsed_time(end) / 1e3
            if direction == "down":
                self.seconds_down += seconds
            else:
                self.seconds_up += seconds
        self._timed = pending

    def synchronize(self) -> None:
        """Wait for every copy enqueued so far (CUDA); the timings are then complete."""
        if self._stream is not None:
            self._stream.synchronize()
        self.collect_timings()
