"""``rope_paged_kv_append``: the legacy single-layer RoPE + append helper over a cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashdec.cache.backends import ROPE_BACKENDS, check_backend
from flashdec.cache.paged_kv_cache import PagedKVCache
from flashdec.cache.state import RequestId


@dataclass(frozen=True, eq=False)
class RopeAppendResult:
    """What one RoPE append did (tensors on the cache's device)."""

    q: torch.Tensor  # [B, Hq, D] rotated query
    positions: torch.Tensor  # [B] int32, positions of the appended tokens (pre-append seq_lens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, including the new tokens
    seq_lens: torch.Tensor  # [B] int32, committed lengths after the append


def rope_paged_kv_append(
    cache: PagedKVCache,
    layer_idx: int,
    request_ids: Sequence[RequestId],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary_dim: int | None,
    append_backend: str = "torch",
    base: float = 10000.0,
) -> RopeAppendResult:
    """Rotate ``q`` and ``k`` at each request's seq_len and append rotated k and v (one layer).

    Only for single-layer caches (``layer_idx`` must be 0); ``append_backend`` is "torch"
    (reference RoPE + index_put), "triton" (reference RoPE + Triton scatter) or "fused" (one
    kernel). All three store the same bytes; rotated q agrees within dtype rounding.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    backend = check_backend("append_backend", append_backend, ROPE_BACKENDS)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
        raise TypeError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
    if layer_idx != 0:
        raise ValueError(
            f"rope_paged_kv_append is the single-layer helper: layer_idx must be 0, got "
            f"{layer_idx}; use begin_token / write_token_layer_rope for multi-layer caches"
        )
    q_rot, meta = cache._legacy_append(request_ids, q, k, v, rotary_dim, base, backend)
    return RopeAppendResult(
        q=q_rot,
        positions=meta.positions,
        block_tables=meta.block_tables,
        seq_lens=meta.seq_lens_after,
    )
