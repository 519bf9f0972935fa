"""FP8 KV scales as the kernels read them: contiguous float32 ``[num_kv_heads]`` device tensors.

A caller's tensor is used as is (a CUDA graph then sees its fixed address); a float becomes a
constant tensor cached per (value, heads, device), so an eager call does not allocate one each
time.
"""

from __future__ import annotations

import torch

_MAX_CACHED = 256
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def scale_tensor(
    scale: float | torch.Tensor, num_kv_heads: int, device: torch.device
) -> torch.Tensor:
    """A checked K/V scale (see :func:`flashdec._checks.check_kv_scales`) as a device tensor."""
    if isinstance(scale, torch.Tensor):
        return scale.contiguous()
    key = (scale, num_kv_heads, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        if len(_CONSTANTS) >= _MAX_CACHED:
            _CONSTANTS.clear()
        tensor = _CONSTANTS[key] = torch.full((num_kv_heads,), scale, device=device)
    return tensor
