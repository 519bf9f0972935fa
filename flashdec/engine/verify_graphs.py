"""CUDA graphs of the verification step (speculative decoding), captured at the warm start.

A verification step whose live rows all bring their last token and ``K`` drafts (``n = K + 1``
tokens each, no prompt chunk) is a fixed-shape extend step (``begin_step(..., num_tokens=[n] *
rows, pad_to=bucket)``): its rows pad to a batch bucket like a decode step's, and its extend
launches depend on the longest request only through the plan's split choice
(:func:`~flashdec.engine.verify_state.extend_launch_key`). So the graphs are keyed by (bucket,
launch key) exactly as :class:`~flashdec.engine.decode_graphs.DecodeGraphs` keys decode's, for
the one ``n`` of the runner's speculative config, captured for every bucket before serving
(nothing is captured while requests wait: a step no graph fits runs eagerly, padded alike).

Every graph writes its logits into one shared buffer (``[largest bucket * n, V]``; the graphs
never run at once and the runner reads a step's logits before the next step), so the captures
do not each keep their own logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashdec.engine.decode_graphs import DecodeGraphs
from flashdec.engine.decode_state import plan_bucket
from flashdec.engine.engine import DecodeEngine
from flashdec.engine.verify_state import extend_launch_key, verify_plan


class VerifyGraphs(DecodeGraphs):
    """The verification-step graphs of one runner: ``n`` tokens per row, per (bucket, launch
    key). ``forward(tx, slots)`` runs the model over the open fixed-shape step ``tx``
    (``slots``: the fixed metadata, whose ``request_slots`` the input ids are gathered with)
    and returns the logits of every row, ``[bucket * n, V]``."""

    kind = "verification"

    def __init__(
        self,
        engine: DecodeEngine,
        forward: Callable,
        *,
        max_batch_size: int,
        num_q_heads: int,
        n: int,
    ) -> None:
        if n < 2:
            raise ValueError(f"a verification step brings n >= 2 tokens per row, got {n}")
        super().__init__(engine, forward, max_batch_size=max_batch_size, num_q_heads=num_q_heads)
        self.n = n
        self.logits: torch.Tensor | None = None  # every graph's output (see the module doc)

    def key(self, bucket: int, max_len: int) -> tuple:
        """The launch key of a ``bucket``-row verification step whose longest request has
        ``max_len`` tokens after the step (memoised per plan bucket)."""
        cache = self.engine.cache
        planned = plan_bucket(cache, max_len)
        key = self._keys.get((bucket, planned))
        if key is None:
            dtype = self.engine.activation_dtype
            key = self._keys[bucket, planned] = tuple(
                extend_launch_key(
                    verify_plan(cache, g, bucket, self.n, self.num_q_heads, planned, dtype)
                )
                for g in range(len(cache.kv_groups))
            )
        return key

    def capturable_rows(self, placeholders: int) -> int:
        """Rows of ``n`` tokens the cache has blocks for (every group), at most
        ``placeholders``; none when a sliding window takes fewer than ``n`` tokens a step."""
        engine = self.engine
        limit = engine.max_tokens_per_request_step
        if limit is not None and self.n > limit:
            return 0
        cache = engine.cache
        fit = min(
            cache.layout.group_free_blocks(g) // math.ceil(self.n / spec.block_size)
            for g, spec in enumerate(cache.kv_groups)
        )
        return min(placeholders, fit)

    def _begin(self, rids: list, plan_len: int):
        return self.engine.begin_step(
            rids, num_tokens=[self.n] * len(rids), pad_to=len(rids), plan_len=plan_len
        )

    def _body(self, tx, slots):
        """The forward, its logits copied into the shared buffer (made by the first step)."""
        logits = self.forward(tx, slots)
        if self.logits is None:
            rows = self.buckets[-1] * self.n
            self.logits = logits.new_empty((rows, logits.shape[1]))
        out = self.logits[: logits.shape[0]]
        out.copy_(logits)
        return out
