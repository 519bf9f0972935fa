"""The cached kernel launch (kernels/_runtime.Launcher), against stand-ins for Triton's objects.

On the GPU the real path is covered by test_decode's and test_append's repeated-call tests; here
the bookkeeping is checked on any machine: one compile per specialisation class (the classes
checked against Triton's own ``native_specialize_impl``), the direct call of the compiled
launcher's C entry with pointers as ints, and the fallbacks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from flashdec.kernels import _runtime

STREAM = 0x5EED


class _Launcher:
    """Stand-in for the CudaLauncher: records calls of its C entry."""

    def __init__(self, log, scratch):
        self.log = log
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True

    def launch(self, *args):
        self.log.append(("direct", args))


class _Compiled:
    def __init__(self, log, scratch):
        self.log = log
        self.run = _Launcher(log, scratch)
        self.function = object()
        self.packed_metadata = (4, 1, 0)

    def __getitem__(self, grid):
        def runner(*args):
            self.log.append(("runner", grid, args))

        return runner


class _Kernel:
    def __init__(self, scratch=0):
        self.log = []
        self.scratch = scratch

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log, self.scratch)

        return run

    def kinds(self):
        return [entry[0] for entry in self.log]


@pytest.fixture
def fast_launch(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", True)
    monkeypatch.setattr(_runtime, "_current_device", lambda: 0)
    monkeypatch.setattr(_runtime, "current_stream", lambda device: STREAM)


def _tensors():
    base = torch.zeros(64)  # 16-byte aligned storage
    return base[:8], base[16:24].to(torch.int32)


def test_second_launch_calls_the_c_entry_with_int_pointers(fast_launch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    launcher(7, (x, y), (3, 0.5), (16, True), num_warps=4)
    launcher(7, (x, y), (3, 0.5), (16, True), num_warps=4)
    assert kernel.kinds() == ["jit", "direct"]
    _, grid, args, kwargs = kernel.log[0]
    assert grid == (7,) and args == (x, y, 3, 0.5, 16, True)
    assert kwargs == {"num_warps": 4, "num_stages": None}
    direct = kernel.log[1][1]
    assert direct[:4] == (7, 1, 1, STREAM)
    assert direct[5:7] == (False, True)  # cooperative grid, PDL: the compiled kernel's own
    assert direct[7:13] == (None, None, (4, 1, 0), None, None, None)
    assert direct[13:] == (x.data_ptr(), y.data_ptr(), 3, 0.5, 16, True)


def test_new_class_compiles_same_class_reuses(fast_launch, monkeypatch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    classified = []
    real_key = _runtime.specialization_key

    def counting_key(tensors, scalars):
        classified.append(scalars)
        return real_key(tensors, scalars)

    monkeypatch.setattr(_runtime, "specialization_key", counting_key)

    def call(tensors=(x, y), scalars=(3, 0.5), constexprs=(16,), num_warps=4):
        launcher(2, tensors, scalars, constexprs, num_warps=num_warps)
        return kernel.log[-1][0]

    assert call() == "jit"
    assert call() == "direct" and len(classified) == 1  # exact values: no classification
    assert call(scalars=(5, 0.25)) == "direct" and len(classified) == 2  # same class
    new_classes = [
        {"scalars": (16, 0.5)},  # a multiple of 16
        {"scalars": (1, 0.5)},  # 1 is a compile-time constant
        {"scalars": (2**31, 0.5)},  # 64-bit
        {"tensors": (x.double(), y)},  # dtype
        {"tensors": (x[1:], y)},  # 4-byte aligned pointer
        {"constexprs": (32,)},
        {"num_warps": 8},
    ]
    for change in new_classes:
        assert call(**change) == "jit", change
        assert call(**change) == "direct", change
    assert call() == "direct"


@pytest.mark.parametrize("reason", ["scratch", "hook"])
def test_fallback_through_the_compiled_runner(fast_launch, monkeypatch, reason):
    kernel = _Kernel(scratch=128 if reason == "scratch" else 0)
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    if reason == "hook":
        monkeypatch.setattr(_runtime, "hooks_active", lambda: True)
    launcher(3, (x, y), (3, 0.5), (16,), num_warps=4)
    launcher(3, (x, y), (3, 0.5), (16,), num_warps=4)
    assert kernel.kinds() == ["jit", "runner"]
    assert kernel.log[1][1:] == ((3, 1, 1), (x, y, 3, 0.5, 16))  # tensors, not pointers


def test_hooks_are_seen_in_triton_knobs():
    import triton

    hooks = triton.knobs.runtime.launch_enter_hook
    assert not _runtime.hooks_active()

    def hook(metadata):
        return None

    hooks.add(hook)
    try:
        assert _runtime.hooks_active()
    finally:
        hooks.remove(hook)
    assert not _runtime.hooks_active()


def test_disabled_fast_launch_always_goes_through_triton(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", False)
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    for _ in range(2):
        launcher(5, (x, y), (3,), (16, False), num_warps=8, num_stages=2)
    assert kernel.kinds() == ["jit", "jit"]
    assert kernel.log[0][1:] == ((5,), (x, y, 3, 16, False), {"num_warps": 8, "num_stages": 2})


# --------------------------------------------------------------------------------------------
# the key changes exactly when Triton's own specialisation does
# --------------------------------------------------------------------------------------------
def _triton_spec(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


SCALARS = [
    *(0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, -(2**31)),
    *(-(2**31) - 1, -(2**31) - 16, 2**32, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1),
    *(True, False, 0.0, 1.0, 0.5, -3.25, 1e30),
]


def test_scalar_classes_match_native_specialization():
    for a, b in itertools.product(SCALARS, repeat=2):
        same_triton = _triton_spec(a) == _triton_spec(b)
        same_ours = _runtime.scalar_class(a) == _runtime.scalar_class(b)
        assert same_ours == same_triton, (a, b)


def test_tensor_classes_match_native_specialization():
    base = torch.zeros(64)
    tensors = [
        base,
        base[1:],
        base[4:],
        base[2:],
        base.half()[8:],
        base.half()[1:],
        base.to(torch.bfloat16),
        base.to(torch.int32)[4:],
        base.to(torch.int64),
        base.to(torch.int64)[1:],
        base.to(torch.int64)[2:],
    ]
    for a, b in itertools.product(tensors, repeat=2):
        same_triton = _triton_spec(a) == _triton_spec(b)
        same_ours = _runtime.specialization_key((a,), ()) == _runtime.specialization_key((b,), ())
        assert same_ours == same_triton, (a.dtype, a.data_ptr() % 16, b.dtype, b.data_ptr() % 16)


def test_bound_launch_swaps_only_the_dynamic_pointers(fast_launch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    bound = launcher.bind(5, (x, y), (3, 0.5), (16,), 4, dynamic=(0,))
    base = torch.zeros(64)
    x2 = base[32:40]  # another 16-byte aligned tensor of x's dtype and strides
    bound(x)  # first call: compiled and launched through Triton, then bound
    bound(x2)
    assert kernel.kinds() == ["jit", "direct"]
    direct = kernel.log[1][1]
    assert direct[:4] == (5, 1, 1, STREAM)
    assert direct[13:] == (x2.data_ptr(), y.data_ptr(), 3, 0.5, 16)
    bound(x)  # every dynamic position is rewritten per call (the list is patched in place)
    assert kernel.log[2][1][13:] == (x.data_ptr(), y.data_ptr(), 3, 0.5, 16)


def test_bound_launch_rejects_a_wrong_number_of_dynamic_tensors(fast_launch):
    kernel = _Kernel()
    x, y = _tensors()
    bound = _runtime.Launcher(kernel).bind(5, (x, y), (3, 0.5), (16,), 4, dynamic=(0, 1))
    bound(x, y)
    for wrong in ((x,), (x, y, x)):
        with pytest.raises(TypeError, match="2 dynamic tensors"):
            bound(*wrong)
    assert kernel.kinds() == ["jit"]  # nothing launched with a stale pointer
    bound(x, y)
    assert kernel.log[-1][1][13:] == (x.data_ptr(), y.data_ptr(), 3, 0.5, 16)


def test_bound_launch_after_an_alignment_fallback_uses_fresh_pointers(fast_launch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    base = torch.zeros(64)
    x, y = base[:8], base[16:24]
    bound = launcher.bind(5, (x, y), (3, 0.5), (16,), 4, dynamic=(0, 1))
    bound(x, y)
    bound(base[32:40], y[1:])  # first pointer patched, second misaligned: fallback
    bound(x, y)
    assert kernel.log[-1][0] == "direct"
    assert kernel.log[-1][1][13:] == (x.data_ptr(), y.data_ptr(), 3, 0.5, 16)


def test_bound_launch_falls_back_when_alignment_changes(fast_launch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    bound = launcher.bind(5, (x, y), (3, 0.5), (16,), 4, dynamic=(0,))
    bound(x)
    bound(x[1:])  # 4-byte aligned: another specialisation, through the Launcher
    assert kernel.kinds() == ["jit", "jit"]


def test_bound_launch_without_fast_launch_substitutes_through_triton(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", False)
    kernel = _Kernel()
    x, y = _tensors()
    x2 = torch.zeros(8)
    bound = _runtime.Launcher(kernel).bind(5, (x, y), (3,), (16,), 4, dynamic=(0,))
    bound(x2)
    assert kernel.log[0][2] == (x2, y, 3, 16)


def test_direct_launch_is_a_copy_of_the_bound_arguments(fast_launch, monkeypatch):
    kernel = _Kernel()
    x, y = _tensors()
    bound = _runtime.Launcher(kernel).bind(5, (x, y), (3,), (16,), 4, dynamic=(1,))
    assert bound.direct() is None  # not resolved before a first call
    bound(y)
    direct = bound.direct()
    assert direct.args == [x.data_ptr(), y.data_ptr(), 3, 16]
    other = torch.zeros(64)[32:40]
    direct.args[1] = other.data_ptr()  # the owner's patch does not touch the bound launch
    direct.issue(STREAM)
    bound(y)
    launched = [entry[1] for entry in kernel.log if entry[0] == "direct"]
    assert launched[0][:4] == (5, 1, 1, STREAM)
    assert launched[0][13:] == (x.data_ptr(), other.data_ptr(), 3, 16)
    assert launched[1][13:] == (x.data_ptr(), y.data_ptr(), 3, 16)
    monkeypatch.setattr(_runtime, "hooks_active", lambda: True)
    assert bound.direct() is None  # a profiler hook needs Triton's own path
