"""Fakes of vLLM's cache tensors, shared by the plugin's tests."""

from __future__ import annotations

import torch


def vllm_flash_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str = "NHD", num_layers: int = 1
) -> torch.Tensor:
    """vLLM 0.24.0's FlashAttention layer cache holding FlashDec's token-major K and V.

    Logical shape ``[num_blocks, 2, block_size, num_kv_heads, head_size]``; memory order as vLLM
    allocates it: ``NHD`` as written, ``HND`` with heads before tokens, ``cross_layer`` as one
    layer of a ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` buffer (the last layer).
    """
    nb, hkv, bs, d = k_cache.shape
    kv = torch.stack((k_cache, v_cache), dim=1)  # [nb, 2, Hkv, bs, D]
    if layout == "NHD":
        return kv.transpose(2, 3).contiguous()
    if layout == "HND":  # stored [nb, 2, Hkv, bs, D], seen through vLLM's stride order
        return kv.contiguous().permute(0, 1, 3, 2, 4)
    if layout == "cross_layer":
        buf = torch.zeros(nb, num_layers, 2, bs, hkv, d, dtype=k_cache.dtype, device=k_cache.device)
        buf[:, -1] = kv.transpose(2, 3)
        return buf[:, -1]
    raise ValueError(layout)
