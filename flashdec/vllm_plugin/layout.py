"""vLLM's FlashAttention tensors as FlashDec decode arguments: strided views, never a copy.

vLLM 0.24.0's FlashAttention backend gives each layer one cache tensor of logical shape
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (index 0 of dim 1 is K, 1 is V); its
memory order follows vLLM's KV layout (``NHD``: as written; ``HND``: heads before tokens;
cross-layer caches add a layer stride). FlashDec's token-major layer layout is
``[num_blocks, num_kv_heads, block_size, head_dim]``: selecting K or V and swapping the token and
head dims gives exactly that shape over the same memory, whatever the strides, and
``flashdec.decode`` honours strides. vLLM's ``block_table [num_reqs, max_blocks]`` and
``seq_lens [num_reqs]`` (int32, lengths including the new token, whose K/V vLLM wrote before
attention) are FlashDec's ``block_tables`` and ``seq_lens`` as they are. Padded rows of a
CUDA-graph batch have ``seq_len`` 0, which FlashDec answers with a zero row.

Queries arrive as ``[num_tokens, num_heads, head_size]`` (often a strided slice of the fused QKV
projection); in a pure decode batch row ``i`` is request ``i``'s only token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashdec._checks import check_tensor


class DecodeArguments(NamedTuple):
    """The tensors of one ``flashdec.decode`` call, all views of vLLM's."""

    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D], token-major, strided
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    out: torch.Tensor  # [B, Hq, D]


def token_major_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a vLLM FlashAttention layer cache as token-major views (no copy).

    ``kv_cache``: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` with any strides.
    Returns two ``[num_blocks, num_kv_heads, block_size, head_size]`` views of it.
    """
    check_tensor("kv_cache", kv_cache, ndim=5)
    if kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must have vLLM's FlashAttention shape [num_blocks, 2, block_size, "
            f"num_kv_heads, head_size] (K and V on dim 1), got {tuple(kv_cache.shape)}"
        )
    key_cache, value_cache = kv_cache.unbind(1)  # [num_blocks, block_size, Hkv, D] each
    return key_cache.transpose(1, 2), value_cache.transpose(1, 2)


def decode_arguments(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    output: torch.Tensor,
    kv_views: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DecodeArguments:
    """FlashDec's arguments for a pure decode batch of ``seq_lens.shape[0]`` requests.

    ``query``/``output``: ``[num_tokens, num_heads, head_size]`` with ``num_tokens`` at least the
    number of requests (a padded batch may carry extra rows, which are left alone).
    ``kv_views``: :func:`token_major_kv_views` of ``kv_cache``, when the caller keeps them.
    Raises ValueError when the shapes do not describe one query row per request.
    """
    check_tensor("query", query, ndim=3)
    check_tensor("output", output, ndim=3)
    check_tensor("block_table", block_table, ndim=2)
    check_tensor("seq_lens", seq_lens, ndim=1)
    batch = seq_lens.shape[0]
    if block_table.shape[0] != batch:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows for {batch} requests (seq_lens)"
        )
    if query.shape[0] < batch or output.shape[0] < batch:
        raise ValueError(
            f"a decode batch of {batch} requests needs >= {batch} query and output rows, got "
            f"{query.shape[0]} and {output.shape[0]}"
        )
    if output.shape[1:] != query.shape[1:]:
        raise ValueError(
            f"output rows {tuple(output.shape[1:])} must match query rows {tuple(query.shape[1:])}"
        )
    k_cache, v_cache = token_major_kv_views(kv_cache) if kv_views is None else kv_views
    if query.shape[0] != batch:
        query, output = query[:batch], output[:batch]
    return DecodeArguments(query, k_cache, v_cache, block_table, seq_lens, output)
