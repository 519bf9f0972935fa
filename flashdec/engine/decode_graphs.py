"""CUDA graphs of the decode forward, all captured before serving starts (the warm start).

A decode step pads its rows to a batch-size bucket and replays the graph captured for that
bucket and its decode launches. The launches depend on the longest request only through the
plan's split choice (:func:`~flashdec.engine.decode_state.launch_key`), so the graphs are keyed
by (bucket, launch key): lengths that cross a plan bucket with the same launches share a graph,
and a batch whose lengths move back and forth between plan buckets finds each graph kept, never
re-captured.

:meth:`DecodeGraphs.capture_all` captures every (bucket, launch key) that a request of up to the
cache's table length can reach, on placeholder requests, before the first real request arrives
(vLLM captures its decode graphs at start-up the same way). A step that no graph fits afterwards
runs eagerly: nothing is captured while requests wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from flashdec.engine.decode_state import (
    group_decode_plan,
    launch_key,
    max_table_tokens,
    plan_bucket,
)
from flashdec.engine.engine import DecodeEngine
from flashdec.engine.step import CapturedStep

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_PLACEHOLDER = "flashdec-warm-start-{}"  # str ids: LLM's own request ids are ints


@dataclass(frozen=True)
class WarmStart:
    """What a warm start's capture did (:meth:`DecodeGraphs.capture_all`,
    :meth:`~flashdec.engine.piecewise_graphs.PiecewiseGraphs.capture_all`): graphs captured, for
    which buckets, the wall time, and the device memory the capture kept (graph pools and
    fixed buffers: :func:`held_device_memory` after minus before; 0 off CUDA)."""

    graphs: int
    buckets: tuple[int, ...]
    seconds: float
    memory_bytes: int = 0


def held_device_memory() -> int:
    """Bytes PyTorch holds on the current CUDA device once its unused cache is released (a
    capture releases it too): the difference across a warm start is what its graphs keep."""
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


class DecodeGraphs:
    """The decode graphs of one runner: buckets, launch keys, captures and replays.

    ``forward(tx, slots)`` runs the model over the open decode step ``tx`` (every layer through
    the engine; ``slots``: the step's cache slots) and returns its outputs; a graph captures
    exactly that.
    """

    kind = "decode"  # the steps' kind, in log lines

    def __init__(
        self,
        engine: DecodeEngine,
        forward: Callable,
        *,
        max_batch_size: int,
        num_q_heads: int,
    ) -> None:
        self.engine = engine
        self.forward = forward
        self.num_q_heads = num_q_heads
        self.buckets = tuple(
            sorted({b for b in BATCH_BUCKETS if b < max_batch_size} | {max_batch_size})
        )
        self.graphs: dict[tuple[int, tuple], CapturedStep] = {}
        self._keys: dict[tuple[int, int], tuple] = {}  # (bucket, plan bucket) -> launch key
        self.pool = None  # one memory pool for every graph (they never run at once)
        self.replays = 0
        self.eager_steps = 0  # decode steps that no graph fitted (ran eagerly)
        self.warm_start: WarmStart | None = None

    def bucket(self, rows: int) -> int:
        """The captured batch size a step of ``rows`` requests pads to."""
        return next(b for b in self.buckets if b >= rows)

    def key(self, bucket: int, max_len: int) -> tuple:
        """The launch key of a ``bucket``-row decode step whose longest request has ``max_len``
        tokens after the step (memoised per plan bucket: a dictionary hit per step)."""
        cache = self.engine.cache
        planned = plan_bucket(cache, max_len)
        key = self._keys.get((bucket, planned))
        if key is None:
            key = self._keys[bucket, planned] = tuple(
                launch_key(
                    group_decode_plan(
                        cache,
                        g,
                        bucket,
                        self.num_q_heads,
                        planned,
                        self.engine.activation_dtype,
                    )
                )
                for g in range(len(cache.kv_groups))
            )
        return key

    def run(self, tx, slots, bucket: int, max_len: int):
        """The outputs of the open decode step ``tx``: its graph replayed, or eager."""
        captured = self.graphs.get((bucket, self.key(bucket, max_len)))
        if captured is not None and captured.fits(tx):
            self.replays += 1
            return self.engine.replay_step(tx, captured)
        self.eager_steps += 1
        if self.eager_steps == 1:
            log.warning(
                "a %s step of %d rows (longest request %d tokens) has no CUDA graph: it "
                "runs eagerly",
                self.kind,
                bucket,
                max_len,
            )
        return self.forward(tx, slots)

    def drop(self) -> None:
        """Forget every graph (the buffers they read were replaced)."""
        self.graphs = {}
        self.pool = None

    def plan_lengths(self, bucket: int) -> list[int]:
        """One plan length per distinct launch key of ``bucket`` over every plan bucket a
        request can reach (1, 2, 4, ... up to the table length), the longest of each."""
        limit = max_table_tokens(self.engine.cache)
        lengths, length = [], 1
        while True:
            lengths.append(min(length, limit))
            if length >= limit:
                break
            length *= 2
        by_key = {self.key(bucket, n): n for n in lengths}  # later (longer) lengths win
        return sorted(by_key.values())

    def capturable_rows(self, placeholders: int) -> int:
        """How many rows a captured step of ``placeholders`` empty requests can have."""
        return placeholders

    def capture_all(self, placeholders: list, pool=None) -> WarmStart:
        """Capture the graph of every bucket and launch key on ``placeholders`` (empty requests,
        see :func:`placeholder_requests`; buckets above :meth:`capturable_rows` are left out),
        largest bucket first so the cache's slot buffers are sized once, each shape's kernels
        compiled by one eager step before its capture, in ``pool`` (None: a new one). Every
        step is aborted: nothing is committed."""
        start = time.perf_counter()
        held = held_device_memory()
        self.drop()
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        rows = self.capturable_rows(len(placeholders))
        buckets = [b for b in self.buckets if b <= rows]
        log.info(  # it takes seconds (tens with cold Triton compiles): say what is happening
            "warm start: capturing the %s graphs of batch buckets %s before serving",
            self.kind,
            buckets,
        )
        for bucket in reversed(buckets):
            for plan_len in self.plan_lengths(bucket):
                self._step(placeholders[:bucket], plan_len, capture=False)  # compiles
                key = self.key(bucket, plan_len)
                self.graphs[bucket, key] = self._step(placeholders[:bucket], plan_len, capture=True)
        torch.cuda.synchronize()
        self.warm_start = WarmStart(
            len(self.graphs),
            tuple(buckets),
            time.perf_counter() - start,
            held_device_memory() - held,
        )
        log.info(
            "warm start: %d %s graphs for batch buckets %s in %.1f s, holding %.2f GiB",
            len(self.graphs),
            self.kind,
            buckets,
            self.warm_start.seconds,
            self.warm_start.memory_bytes / 2**30,
        )
        return self.warm_start

    def _begin(self, rids: list, plan_len: int):
        """Open a step of this kind for ``rids``, planned for ``plan_len`` tokens."""
        return self.engine.begin_step(rids, plan_len=plan_len)

    def _body(self, tx, slots):
        """What a graph captures: the forward."""
        return self.forward(tx, slots)

    def _step(self, rids: list, plan_len: int, *, capture: bool) -> CapturedStep | None:
        """One step of ``rids`` planned for ``plan_len`` tokens: run eagerly, or captured (and
        replayed once); aborted either way."""
        engine = self.engine
        tx = self._begin(rids, plan_len)
        try:
            slots = engine.step_slots(tx)
            if not capture:
                self._body(tx, slots)
                return None
            return engine.capture_step(tx, lambda: self._body(tx, slots), pool=self.pool)
        finally:
            if engine.has_open_step:  # a failed layer or capture aborted it already
                engine.abort_step(tx)


def free_rows(engine: DecodeEngine) -> int:
    """How many one-block placeholder requests the cache can hold (one block in every group)."""
    cache = engine.cache
    return min(cache.layout.group_free_blocks(g) for g in range(len(cache.kv_groups)))


@contextmanager
def placeholder_requests(engine: DecodeEngine, count: int) -> Iterator[list[str]]:
    """``count`` empty requests, in the cache only, for steps that are opened and aborted
    (never committed); discarded on exit, ids and all."""
    cache = engine.cache
    rids: list[str] = []
    try:
        for i in range(count):
            rid = _PLACEHOLDER.format(i)
            cache.add_request(rid)
            rids.append(rid)
        yield rids
    finally:
        for rid in rids:
            cache.discard_request(rid)
