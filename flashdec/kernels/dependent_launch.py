"""Programmatic dependent launch (PDL, sm_90 and later): a kernel may start before the kernel
ahead of it in the stream has finished.

A decode step at small batch is a chain of short kernels (norm, projection, RoPE + append,
attention, projection, ...), each waiting for the one before: every boundary costs the next
kernel's launch and ramp-up while the GPU drains. A kernel launched with PDL is scheduled as soon
as the kernel before it has released it, runs the part of its work that does not depend on it —
a projection issues the loads of its first weight tile, which no step writes — and waits
(``griddepcontrol.wait``) before it reads or writes anything else. The wait returns once the
kernel before it has completed and its writes are visible, so the chain computes exactly what
it computes without PDL; only the boundaries overlap.

Each FlashDec kernel of the decode chain takes a ``PDL`` constexpr: with it, the kernel calls
:func:`_await_inputs` before its first dependent access (which also releases the next kernel:
at most one kernel runs ahead, so a waiting kernel never takes an SM from one still to be
scheduled). The launch attribute is set only where the kernel was compiled with ``PDL``
(:func:`dependent_launch`); without the attribute the instructions are no-ops. Neither exists in
Triton's interpreter. ``FLASHDEC_PDL=0`` turns it off (an A/B switch for benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashdec.kernels._runtime import INTERPRET

ENABLED = os.environ.get("FLASHDEC_PDL", "1") != "0"
MIN_CAPABILITY = (9, 0)  # griddepcontrol: Hopper and later


@functools.lru_cache(maxsize=16)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` are compiled with ``PDL`` and launched with the attribute:
    a CUDA device of compute capability 9.0 or later, outside the interpreter, unless
    ``FLASHDEC_PDL=0``."""
    if not ENABLED or INTERPRET or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(index)


@triton.jit
def _await_inputs(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one has completed (its writes visible),
    then let the next kernel launch. Call before the first access to anything a kernel before
    this one may write."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
