"""The cached kernel launch (kernels/_runtime.launch), against a stand-in for Triton's objects.

On the GPU the real path is covered by test_decode's repeated-call test; here the bookkeeping is
checked on any machine: one compile per argument signature, constexprs passed positionally in
parameter order, and the three grid dimensions the compiled runner reads.
"""

from __future__ import annotations

import pytest
import torch

from flashdec.kernels import _runtime


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3  # Triton's compiled runner indexes grid[0], grid[1], grid[2]

        def runner(*args):
            self.log.append(("cached", grid, args))

        return runner


class _Kernel:
    arg_names = ("x", "n", "BLOCK", "FLAG")

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)

        return run


@pytest.fixture
def fast_launch(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", True)
    monkeypatch.setattr(_runtime, "_COMPILED", {})


def test_second_launch_reuses_the_compiled_kernel(fast_launch):
    kernel, x = _Kernel(), torch.zeros(4)
    # constexprs given out of order still reach the runner in parameter order
    _runtime.launch(kernel, (7,), (x, 3), {"FLAG": True, "BLOCK": 16}, num_warps=4)
    _runtime.launch(kernel, (7,), (x, 3), {"FLAG": True, "BLOCK": 16}, num_warps=4)
    assert [entry[0] for entry in kernel.log] == ["jit", "cached"]
    assert kernel.log[1][1] == (7, 1, 1)
    assert kernel.log[1][2] == (x, 3, 16, True)


def test_a_new_signature_compiles_again(fast_launch):
    kernel, x = _Kernel(), torch.zeros(4)
    _runtime.launch(kernel, (1,), (x, 3), {"BLOCK": 16, "FLAG": True})
    _runtime.launch(kernel, (1,), (x, 4), {"BLOCK": 16, "FLAG": True})  # another int value
    _runtime.launch(kernel, (1,), (x.half(), 3), {"BLOCK": 16, "FLAG": True})  # another dtype
    _runtime.launch(kernel, (1,), (x, 3), {"BLOCK": 32, "FLAG": True})  # another constexpr
    assert [entry[0] for entry in kernel.log] == ["jit"] * 4


def test_disabled_fast_launch_always_goes_through_triton(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", False)
    kernel, x = _Kernel(), torch.zeros(4)
    for _ in range(2):
        _runtime.launch(kernel, (2, 3), (x, 3), {"BLOCK": 16, "FLAG": False}, num_warps=8)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]
    assert kernel.log[0][3] == {"BLOCK": 16, "FLAG": False, "num_warps": 8}
