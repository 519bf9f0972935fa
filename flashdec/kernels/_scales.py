"""FP8 KV scales as the kernels read them: contiguous float32 ``[num_kv_heads]`` device tensors.

A caller's tensor is used as is (a CUDA graph then sees its fixed address); a float becomes a
constant tensor cached per (value, heads, device), so an eager call does not allocate one each
time. Bound launches take each layer's scales per call (:func:`call_scales`).
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


def call_scales(
    bound: tuple[torch.Tensor, torch.Tensor] | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """The scale tensors a bound FP8 launch takes per call: the call's (one layer's), or the
    ``bound`` ones where it passes None; nothing for a float launch (``bound`` None)."""
    if bound is None:
        return ()
    return (bound[0] if k_scale is None else k_scale, bound[1] if v_scale is None else v_scale)
