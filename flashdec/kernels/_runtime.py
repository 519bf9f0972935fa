"""Where FlashDec's Triton kernels run: the GPU, or Triton's interpreter on CPU tensors.

``TRITON_INTERPRET`` is read once, at import: Triton itself only honours it when it is set before
its first import, so a later change would not take effect anyway.
"""

from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Nominal SM count used where no GPU is queried (the interpreter): the H200's, so that CPU tests
# build the same plans as the GPU machine does.
NOMINAL_SM_COUNT = 132


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Raise TypeError unless ``tensor`` can be handed to a Triton kernel in this process."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and INTERPRET:
        return
    raise TypeError(
        f"{name} is on {tensor.device}; FlashDec's Triton kernels need CUDA tensors "
        "(CPU tensors run only through Triton's interpreter: set TRITON_INTERPRET=1 before "
        "triton is first imported)"
    )


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """Multiprocessor count of ``device`` (cached per device; nominal for CPU tensors)."""
    device = torch.device(device)
    if device.type != "cuda":
        return NOMINAL_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


def next_power_of_2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()
