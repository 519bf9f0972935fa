"""A fixed-shape extend step (a verification step: ``n`` tokens for every row) in fixed-address
buffers, per KV layer group, so that a CUDA graph captured over its layers replays for a later
step of the same shape.

An extend step's metadata comes from the cache in new tensors every step
(:func:`~flashdec.cache.slots.fresh_slots`): a graph cannot read them. :class:`VerifySlots`
holds a copy in buffers that never move, for ``num_rows`` rows (a batch bucket) of ``n`` tokens:
:meth:`VerifySlots.fill` copies a step's metadata in on the device (no host read) and turns the
rows past the live ones into padding (block id ``PAD_BLOCK_ID``: writers skip them; query
length 0: the extend kernel gives them no tile; length 0, request slot 0).

The extend plan of such a step (:func:`verify_plan`) is sized like decode's, for the
:func:`~flashdec.engine.decode_state.plan_bucket` of the longest request, and its launches
depend on that length only through the split choice (:func:`extend_launch_key`): the grid is
fixed by (rows, n) and each program reads its request's lengths on the device. The CUDA graphs
are keyed by that launch key, as decode's are by :func:`~flashdec.engine.decode_state.launch_key`.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from flashdec.cache import PagedKVCache, TransactionSlots
from flashdec.cache.slots import PAD_BLOCK_ID
from flashdec.kernels import ExtendPlan, plan_extend

_GENERATIONS = itertools.count(1 << 32)  # apart from the cache's slot-buffer generations


def verify_plan(
    cache: PagedKVCache,
    group: int,
    num_rows: int,
    n: int,
    num_q_heads: int,
    planned_len: int,
    dtype: torch.dtype,
) -> ExtendPlan:
    """The extend plan of KV group ``group`` for ``num_rows`` rows of ``n`` tokens each, the
    longest request ``planned_len`` tokens after the step (a ``plan_bucket`` value)."""
    spec = cache.kv_groups[group]
    return plan_extend(
        num_rows,
        num_rows * n,
        num_q_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        planned_len,
        dtype,
        cache.device,
        max_blocks_per_seq=cache.layout.group_max_blocks_per_seq(group),
        max_query_len=n,
        window=spec.window,
        kv_dtype=spec.dtype,
    )


def extend_launch_key(plan: ExtendPlan) -> ExtendPlan:
    """What an extend plan's launches depend on: the plan less the length it was sized for
    (and, in a single pass, less the split length, which the kernel does not read). Plans with
    equal keys launch the same kernel on the same grid, so one CUDA graph serves both."""
    if plan.num_splits == 1:
        return replace(plan, max_seq_len=0, tokens_per_split=0)
    return replace(plan, max_seq_len=0)


class VerifySlots:
    """Fixed-address metadata of steps of ``num_rows`` rows x ``n`` tokens in one KV group.

    ``positions``, ``block_ids``, ``offsets`` ``[num_rows * n]``; ``seq_lens``,
    ``seq_lens_after``, ``request_slots`` ``[num_rows]`` (int64, as the cache's) and
    ``query_lens [num_rows]`` (int32, as an extend step's); ``block_tables [num_rows, width]``.
    """

    def __init__(self, cache: PagedKVCache, group: int, num_rows: int, n: int) -> None:
        device = cache.device
        width = cache.layout.group_max_blocks_per_seq(group)
        tokens = num_rows * n

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.num_rows, self.n = num_rows, n
        self.generation = next(_GENERATIONS)  # what a captured step compares
        self.positions, self.block_ids, self.offsets = longs(tokens), longs(tokens), longs(tokens)
        self.seq_lens, self.seq_lens_after, self.request_slots = (
            longs(num_rows),
            longs(num_rows),
            longs(num_rows),
        )
        self.block_tables = longs(num_rows, width)
        self.query_lens = torch.zeros(num_rows, dtype=torch.int32, device=device)
        self.live = -1  # live rows of the last fill (-1: none yet; the padding is unset)
        self._views: dict[int, TransactionSlots] = {}

    def fill(self, source: TransactionSlots) -> TransactionSlots:
        """Copy the step's metadata ``source`` (the cache's, ``batch`` rows of ``n`` tokens) in
        on the device; returns these buffers as the step's slots (``batch`` live rows of
        ``num_rows``). Rows past the live ones are padding (set when the live count changes)."""
        live, tokens = source.batch, source.num_tokens
        if not 0 < live <= self.num_rows or tokens != live * self.n:
            raise ValueError(
                f"a step of {live} rows and {tokens} tokens does not fit {self.num_rows} rows "
                f"of {self.n} tokens"
            )
        if source.token_rows is not None:
            raise ValueError("a step whose group stores only some of its tokens is not fixed")
        for dst, src in (
            (self.positions, source.positions),
            (self.block_ids, source.block_ids),
            (self.offsets, source.offsets),
        ):
            dst[:tokens].copy_(src)
        for dst, src in (
            (self.seq_lens, source.seq_lens),
            (self.seq_lens_after, source.seq_lens_after),
            (self.request_slots, source.request_slots),
            (self.block_tables, source.block_tables),
        ):
            dst[:live].copy_(src)
        if live != self.live:  # padding rows: position 0, block id -1, lengths 0, slot 0
            self.block_ids[tokens:].fill_(PAD_BLOCK_ID)
            for t in (self.positions, self.offsets):
                t[tokens:].zero_()
            for t in (self.seq_lens, self.seq_lens_after, self.request_slots, self.query_lens):
                t[live:].zero_()
            self.query_lens[:live].fill_(self.n)
            self.live = live
        return self._view(live, source.slot_rows)

    def _view(self, live: int, slot_rows: torch.Tensor) -> TransactionSlots:
        view = self._views.get(live)
        if view is None:
            view = self._views[live] = TransactionSlots(
                batch=live,
                num_rows=self.num_rows,
                num_tokens=live * self.n,  # the live tokens (a torch writer stores those)
                generation=self.generation,
                positions=self.positions,
                block_ids=self.block_ids,
                offsets=self.offsets,
                seq_lens=self.seq_lens,
                seq_lens_after=self.seq_lens_after,
                slot_rows=slot_rows,
                block_tables=self.block_tables,
                request_slots=self.request_slots,
                token_rows=None,
            )
        view.slot_rows = slot_rows  # the cache's (backups and restores read it, not writers)
        return view
