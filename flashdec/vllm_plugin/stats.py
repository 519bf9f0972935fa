"""What the backend did in this process: FlashDec decode calls, fallbacks by reason, logged once.

Python-level counts see eager calls and CUDA-graph captures, not graph replays (a replay runs no
Python). For proof that replays go through FlashDec too, ``FLASHDEC_VLLM_COUNT=1`` makes the
backend add one to a device counter after every decode launch; the increment is captured into
the graph with the decode, so the counter counts every executed launch. It costs one tiny kernel
per layer, so it is off by default (and off in speed runs).
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from flashdec.vllm_plugin.logs import logger

DEVICE_COUNTER_ENV = "FLASHDEC_VLLM_COUNT"


class PluginStats:
    """Counters of one process. Each fallback reason is logged once, at its first occurrence."""

    def __init__(self, *, device_counting: bool | None = None) -> None:
        if device_counting is None:
            device_counting = os.environ.get(DEVICE_COUNTER_ENV, "0") not in ("", "0")
        self.device_counting = device_counting
        self.decode_calls = 0  # Python-level FlashDec decode calls (eager runs and captures)
        self.fallbacks: Counter[str] = Counter()  # reason -> Python-level parent calls
        self.first_decode: dict | None = None  # shape of the first FlashDec call, for the log
        self._counters: dict[torch.device, torch.Tensor] = {}

    def record_decode(self, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.decode_calls += 1
        if self.first_decode is None:
            self.first_decode = dict(
                batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
            )
            logger.info(
                "FlashDec paged decode active (first call: batch %d, %d query / %d KV heads, "
                "head_dim %d)",
                batch,
                num_q_heads,
                num_kv_heads,
                head_dim,
            )

    def record_fallback(self, reason: str) -> None:
        """Count one parent-backend call; the first of each reason is logged."""
        first = reason not in self.fallbacks
        self.fallbacks[reason] += 1
        if first:
            logger.info("FlashDec falls back to vLLM's FlashAttention for %s", reason)

    def device_counter(self, device: torch.device) -> torch.Tensor | None:
        """The int64 launch counter of ``device`` (created on first use), or None when off."""
        if not self.device_counting:
            return None
        counter = self._counters.get(device)
        if counter is None:
            counter = self._counters[device] = torch.zeros((), dtype=torch.int64, device=device)
        return counter

    def snapshot(self) -> dict:
        """Plain-data copy of the counters (reads the device counters: a host sync)."""
        return {
            "pid": os.getpid(),
            "decode_calls": self.decode_calls,
            "fallbacks": dict(self.fallbacks),
            "first_decode": self.first_decode,
            "device_decode_launches": (
                sum(int(c.item()) for c in self._counters.values())
                if self.device_counting
                else None
            ),
        }

    def reset(self) -> None:
        """Zero every count (the next fallback of each reason is logged again)."""
        self.decode_calls = 0
        self.fallbacks.clear()
        self.first_decode = None
        # vLLM's workers create the counters while capturing under inference mode (inference
        # tensors), and call this through an RPC outside it
        with torch.inference_mode():
            for counter in self._counters.values():
                counter.zero_()


STATS = PluginStats()
