"""tests/interpreter.py: a kernel launch patches triton.language once, helpers do not repatch,
and the launch still restores it."""

import os

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter only"
)


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def _double_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(ptr + offs, mask=mask)
    # two helpers per program: one of the kernel's module, one of Triton's (sees tl.core)
    tl.store(ptr + offs, _double(x) + 0 * tl.cdiv(n, BLOCK), mask=mask)


def _launch_counting_scans(monkeypatch, n):
    scans = []
    scan = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: scans.append(1) or scan(*a))
    x = torch.arange(n, dtype=torch.float32)
    _double_kernel[(triton.cdiv(n, 4),)](x, n, BLOCK=4)
    monkeypatch.undo()
    assert torch.equal(x, 2 * torch.arange(n, dtype=torch.float32))
    return len(scans)


def test_helpers_do_not_repatch_and_the_launch_restores(monkeypatch):
    _launch_counting_scans(monkeypatch, 3)  # the first launch rewrites the helpers' modules
    one_program = _launch_counting_scans(monkeypatch, 3)
    assert _launch_counting_scans(monkeypatch, 33) == one_program  # 9 programs, 18 helper calls
    assert tl.core.is_builtin(tl.program_id) and tl.core.is_builtin(tl.load)
