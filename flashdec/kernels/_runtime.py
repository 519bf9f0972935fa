"""Where FlashDec's Triton kernels run: the GPU, or Triton's interpreter on CPU tensors.

``TRITON_INTERPRET`` is read once, at import: Triton itself only honours it when it is set before
its first import, so a later change would not take effect anyway.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import triton

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


def triton_runs_on(device: torch.device) -> bool:
    """Whether this process can run FlashDec's Triton kernels on tensors of ``device``."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


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


# Launching through ``kernel[grid](...)`` re-derives the compile key from every argument on each
# call (about 20 us of Python for our ~45-argument kernels, measured on the H200 host). With the
# same argument signature the compiled kernel is the same, so it is cached here and launched
# directly. Only for the pinned Triton (the direct call is not a stable API) and off under the
# interpreter; FLASHDEC_FAST_LAUNCH=0 turns it off.
FAST_LAUNCH = (
    not INTERPRET
    and triton.__version__.startswith("3.6.")
    and os.environ.get("FLASHDEC_FAST_LAUNCH", "1") != "0"
)
_COMPILED: dict[tuple, Any] = {}


def _signature(arg: object) -> object:
    # what Triton specialises on: a tensor's dtype and 16-byte alignment, an int's exact value
    # (stricter than Triton's divisibility classes, so a hit is always the right kernel)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return arg


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: Sequence[object],
    constexprs: dict[str, object],
    **options: int,
) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, without the per-call key derivation
    once this argument signature has been compiled (see :data:`FAST_LAUNCH`)."""
    if not FAST_LAUNCH:
        kernel[grid](*args, **constexprs, **options)
        return
    key = (kernel, *map(_signature, args), *constexprs.items(), *options.items())
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **constexprs, **options)
        if len(_COMPILED) > 4096:
            _COMPILED.clear()
        # the compiled launcher takes every parameter positionally, constexprs included
        constants = tuple(constexprs[name] for name in kernel.arg_names[len(args) :])
        _COMPILED[key] = (compiled, constants)
        return
    compiled, constants = compiled
    compiled[(*grid, 1, 1)[:3]](*args, *constants)  # the compiled runner reads 3 grid dims
