"""Where FlashDec's Triton kernels run (the GPU, or Triton's interpreter on CPU tensors) and how
they are launched cheaply.

``TRITON_INTERPRET`` is read once, at import: Triton itself only honours it when it is set before
its first import, so a later change would not take effect anyway.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Nominal SM count used where no GPU is queried (the interpreter): the H200's, so that CPU tests
# build the same plans as the GPU machine does.
NOMINAL_SM_COUNT = 132


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Raise TypeError unless ``tensor`` can be handed to a Triton kernel in this process."""
    kind = tensor.device.type
    if kind == "cuda" or (kind == "cpu" and INTERPRET):
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


# --------------------------------------------------------------------------------------------
# Cached launches
#
# ``kernel[grid](...)`` re-derives Triton's compile key from every argument on each call (about
# 20 us of Python for our ~45-argument kernels on the H200 host), and its launcher then asks the
# driver about every pointer. A :class:`Launcher` keeps the compiled kernel per *specialisation
# class* of the arguments — exactly what Triton 3.6 compiles a separate kernel for — and calls
# the compiled launcher's C entry directly with pointers as plain ints. Only for the pinned
# Triton (the entry is not a stable API), off under the interpreter; FLASHDEC_FAST_LAUNCH=0
# turns it off.
# --------------------------------------------------------------------------------------------
FAST_LAUNCH = (
    not INTERPRET
    and triton.__version__.startswith("3.6.")
    and os.environ.get("FLASHDEC_FAST_LAUNCH", "1") != "0"
)
# Bound on each memo; a cleared memo only costs one slower launch per signature.
_MAX_ENTRIES = 4096
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


class PlanMemo:
    """What a launch reads off a plan, computed once per plan object: ``get(plan)`` returns
    ``build(plan)`` memoised on the plan's identity. The entry keeps the plan (``.plan``) so that
    its ``id()`` cannot be reused while the entry lives; past ``limit`` entries the memo starts
    over (a serving run holds a few plans; tests and sweeps make thousands)."""

    def __init__(self, build: Callable[[Any], Any], limit: int = 1024) -> None:
        self._build = build
        self._limit = limit
        self._entries: dict[int, object] = {}

    def get(self, plan: Any) -> Any:
        entry = self._entries.get(id(plan))
        if entry is None or entry.plan is not plan:
            if len(self._entries) >= self._limit:
                self._entries.clear()
            entry = self._entries[id(plan)] = self._build(plan)
        return entry


def int_class(value: int) -> object:
    """Triton 3.6's specialisation of an int argument (``native_specialize_impl``): 1 becomes a
    compile-time constant; otherwise its type (i32, i64 or u64 by range) and whether it is a
    multiple of 16."""
    if value == 1:
        return 1
    if _I32_MIN <= value <= _I32_MAX:
        kind = 0
    elif _I64_MIN <= value <= _I64_MAX:
        kind = 1
    else:
        kind = 2
    return (kind, value % 16 == 0)


def scalar_class(value: object) -> object:
    """Specialisation of a scalar argument: bools and floats by type only, ints by class."""
    if isinstance(value, bool):
        return bool
    if isinstance(value, float):
        return float
    return int_class(value)  # type: ignore[arg-type]


def specialization_key(
    tensors: Sequence[torch.Tensor], scalars: Sequence[object]
) -> tuple[tuple, tuple]:
    """Everything of the runtime arguments that selects a compiled kernel: each tensor's dtype
    and 16-byte alignment, each scalar's class."""
    return (
        tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors]),
        tuple([scalar_class(s) for s in scalars]),
    )


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def current_stream(device: int) -> int:
    # queried per call: CUDA-graph capture and torch.cuda.stream() change the current stream
    return torch._C._cuda_getCurrentRawStream(device)


def hooks_active() -> bool:
    """Whether a Triton launch hook (e.g. the proton profiler) is registered."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class _Compiled:
    """One compiled kernel and the constant part of its direct launch."""

    __slots__ = ("direct", "function", "kernel", "launch", "metadata", "mode")

    def __init__(self, kernel: Any) -> None:
        run = kernel.run  # loads the binary on the current device
        self.kernel = kernel
        self.launch = run.launch
        self.function = kernel.function
        self.metadata = kernel.packed_metadata
        self.mode = (run.launch_cooperative_grid, run.launch_pdl)
        # scratch buffers would have to be allocated per launch: leave those to Triton
        self.direct = not (run.global_scratch_size or run.profile_scratch_size)


class Launcher:
    """Launches one ``@triton.jit`` kernel whose parameters are, in order: ``tensors`` (pointers),
    ``scalars`` (ints, floats, bools), then ``constexprs``. The grid is 1-D. ``pdl=True`` launches
    it with programmatic dependent launch (:mod:`flashdec.kernels.dependent_launch`): only for a
    kernel whose constexprs make it wait for its inputs.

    Two memos: the compiled kernel per specialisation class (:func:`specialization_key`), and in
    front of it the same kernel per exact scalar values, so that the steady state (same shapes
    call after call) hashes one tuple instead of classifying every argument. Each scalar position
    must keep its Python type from call to call (``1``, ``1.0`` and ``True`` hash alike).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._by_class: dict[tuple, _Compiled] = {}
        self._by_value: dict[tuple, _Compiled] = {}

    def __call__(
        self,
        grid: int,
        tensors: tuple[torch.Tensor, ...],
        scalars: tuple[object, ...],
        constexprs: tuple[object, ...],
        num_warps: int,
        num_stages: int | None = None,
        *,
        pdl: bool = False,
        max_registers: int | None = None,
    ) -> None:
        options = _launch_options(num_warps, num_stages, pdl, max_registers)
        if not FAST_LAUNCH:
            self.kernel[(grid,)](*tensors, *scalars, *constexprs, **options)
            return
        device = _current_device()
        ptrs = [t.data_ptr() for t in tensors]
        key = self._value_key(device, tensors, ptrs, scalars, constexprs, num_warps, num_stages)
        if pdl or max_registers is not None:
            key += (pdl, max_registers)
        compiled = self._by_value.get(key)
        if compiled is None:
            compiled, launched = self._lookup(grid, tensors, scalars, constexprs, options)
            if len(self._by_value) >= _MAX_ENTRIES:
                self._by_value.clear()
            self._by_value[key] = compiled
            if launched:
                return  # compiled and launched by Triton itself
        if compiled.direct and not hooks_active():
            cooperative, pdl = compiled.mode
            compiled.launch(
                grid,
                1,
                1,
                current_stream(device),
                compiled.function,
                cooperative,
                pdl,
                None,
                None,
                compiled.metadata,
                None,
                None,
                None,
                *ptrs,
                *scalars,
                *constexprs,
            )
        else:
            compiled.kernel[(grid, 1, 1)](*tensors, *scalars, *constexprs)

    @staticmethod
    def _value_key(device, tensors, ptrs, scalars, constexprs, num_warps, num_stages) -> tuple:
        low_bits = 0  # all pointers 16-byte aligned (the common case) iff the OR is
        for ptr in ptrs:
            low_bits |= ptr
        return (
            device,
            constexprs,
            num_warps,
            num_stages,
            tuple([t.dtype for t in tensors]),
            low_bits % 16 == 0 or tuple([p % 16 == 0 for p in ptrs]),
            scalars,
        )

    def bind(
        self,
        grid: int,
        tensors: tuple[torch.Tensor, ...],
        scalars: tuple[object, ...],
        constexprs: tuple[object, ...],
        num_warps: int,
        num_stages: int | None = None,
        *,
        dynamic: tuple[int, ...],
        pdl: bool = False,
    ) -> BoundLaunch:
        """A launch with every argument fixed but the tensors at positions ``dynamic``, which
        the caller passes per call — with the dtypes and strides of the ones given here."""
        return BoundLaunch(
            self, grid, tensors, scalars, constexprs, num_warps, num_stages, dynamic, pdl
        )

    def _lookup(self, grid, tensors, scalars, constexprs, options) -> tuple[_Compiled, bool]:
        """The compiled kernel of this specialisation class, and whether this call already
        launched it (a new class is compiled and launched through Triton)."""
        key = (_current_device(), constexprs, *sorted(options.items()))
        key += specialization_key(tensors, scalars)
        compiled = self._by_class.get(key)
        if compiled is not None:
            return compiled, False
        kernel = self.kernel[(grid,)](*tensors, *scalars, *constexprs, **options)
        if len(self._by_class) >= _MAX_ENTRIES:
            self._by_class.clear()
        compiled = self._by_class[key] = _Compiled(kernel)
        return compiled, True


def _launch_options(
    num_warps: int, num_stages: int | None, pdl: bool, max_registers: int | None = None
) -> dict:
    """The launch's options for Triton. ``launch_pdl`` only when set (the interpreter knows no
    such option, and never gets one); ``maxnreg`` (registers per thread, ptxas's cap) only when
    given."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if pdl:
        options["launch_pdl"] = True
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return options


class BoundLaunch:
    """One kernel launched over and over with the same arguments except a few tensors (the
    engine: one layer after another, one step after another, of a batch). Per call it reads those
    tensors' pointers and calls the compiled launcher directly — no key, no argument tuple
    rebuilt. The caller guarantees each dynamic tensor has the dtype and strides of the one
    bound (only the 16-byte alignment is checked); anything else takes :class:`Launcher`'s path.
    """

    __slots__ = (
        "_args",
        "_compiled",
        "_device",
        "_grid",
        "_launcher",
        "_patch",
        "_pdl",
        "_spec",
        "aligned",
        "dynamic",
    )

    def __init__(
        self, launcher, grid, tensors, scalars, constexprs, num_warps, num_stages, dynamic, pdl
    ) -> None:
        self._launcher = launcher
        self._pdl = pdl
        self._spec = (
            grid,
            tuple(tensors),
            tuple(scalars),
            tuple(constexprs),
            num_warps,
            num_stages,
        )
        self.dynamic = tuple(dynamic)
        self._grid = grid
        self._set_aligned(tuple(tensors[i].data_ptr() % 16 == 0 for i in self.dynamic))
        self._compiled: _Compiled | None = None
        self._args: list | None = None  # pointers, scalars and constexprs, in order
        self._device = 0

    def __call__(self, *tensors: torch.Tensor) -> None:
        args = self._args
        if args is not None and len(tensors) == len(self._patch) and not hooks_active():
            # patched in place: the launcher reads the list before returning, and every dynamic
            # position is rewritten on each call, so no copy is needed (lengths checked above)
            for (index, aligned), tensor in zip(self._patch, tensors, strict=False):
                ptr = tensor.data_ptr()
                if (ptr % 16 == 0) is not aligned:
                    return self._slow(tensors)
                args[index] = ptr
            c = self._compiled
            c.launch(
                self._grid,
                1,
                1,
                current_stream(self._device),
                c.function,
                c.mode[0],
                c.mode[1],
                None,
                None,
                c.metadata,
                None,
                None,
                None,
                *args,
            )
            return None
        return self._slow(tensors)

    def direct(self) -> DirectLaunch | None:
        """This launch as a :class:`DirectLaunch` with its own copy of the argument list (the
        dynamic pointers as of the last call); None until a call has taken the direct path or
        while a launch hook is registered."""
        if self._args is None or hooks_active():
            return None
        return DirectLaunch(self._compiled, self._grid, self._device, list(self._args))

    def _set_aligned(self, aligned: tuple[bool, ...]) -> None:
        self.aligned = aligned
        self._patch = tuple(zip(self.dynamic, aligned, strict=True))  # one pair per dynamic

    def _slow(self, dynamic: tuple[torch.Tensor, ...]) -> None:
        if len(dynamic) != len(self.dynamic):
            raise TypeError(f"expected {len(self.dynamic)} dynamic tensors, got {len(dynamic)}")
        grid, tensors, scalars, constexprs, num_warps, num_stages = self._spec
        tensors = list(tensors)
        for index, tensor in zip(self.dynamic, dynamic, strict=True):
            tensors[index] = tensor
        self._launcher(
            grid, tuple(tensors), scalars, constexprs, num_warps, num_stages, pdl=self._pdl
        )
        if FAST_LAUNCH and self._args is None:
            device = _current_device()
            ptrs = [t.data_ptr() for t in tensors]
            key = self._launcher._value_key(
                device, tensors, ptrs, scalars, constexprs, num_warps, num_stages
            )
            if self._pdl:
                key += (True, None)
            compiled = self._launcher._by_value.get(key)
            if compiled is not None and compiled.direct:
                self._compiled, self._device = compiled, device
                self._set_aligned(tuple(ptrs[i] % 16 == 0 for i in self.dynamic))
                self._args = [*ptrs, *scalars, *constexprs]


class DirectLaunch:
    """A compiled kernel's launch with every argument held in ``args`` (pointers as ints, then
    scalars and constexprs), issued by one C call. The owner rewrites pointer entries in place
    — only with tensors of the dtype, strides and 16-byte alignment the launch was bound with —
    and checks :func:`hooks_active` before issuing (a profiler hook needs Triton's own path)."""

    __slots__ = (
        "_cooperative",
        "_function",
        "_grid",
        "_launch",
        "_metadata",
        "_pdl",
        "args",
        "device",
    )

    def __init__(self, compiled: _Compiled, grid: int, device: int, args: list) -> None:
        self.args = args
        self.device = device
        self._grid = grid
        self._launch = compiled.launch
        self._function = compiled.function
        self._metadata = compiled.metadata
        self._cooperative, self._pdl = compiled.mode

    def issue(self, stream: int) -> None:
        self._launch(
            self._grid,
            1,
            1,
            stream,
            self._function,
            self._cooperative,
            self._pdl,
            None,
            None,
            self._metadata,
            None,
            None,
            None,
            *self.args,
        )
