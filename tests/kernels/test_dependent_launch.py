"""Programmatic dependent launch (kernels/dependent_launch.py): when it is on, that the launcher
sets the attribute exactly where a kernel was compiled to wait, and (GPU) that a chain of
dependent launches computes bit for bit what the same chain computes without them, eagerly and
replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from flashdec.kernels import _runtime, dependent_launch
from tests.kernels.test_launch_cache import STREAM, _Kernel, _tensors


def test_off_without_a_cuda_device_and_under_the_interpreter(monkeypatch):
    assert not dependent_launch.dependent_launch(torch.device("cpu"))
    assert not dependent_launch.dependent_launch(torch.device("meta"))
    monkeypatch.setattr(dependent_launch, "INTERPRET", True)
    assert not dependent_launch.dependent_launch(torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("capability", "enabled", "expected"),
    [((9, 0), True, True), ((10, 0), True, True), ((8, 9), True, False), ((9, 0), False, False)],
)
def test_capability_and_the_switch(monkeypatch, capability, enabled, expected):
    monkeypatch.setattr(dependent_launch, "INTERPRET", False)
    monkeypatch.setattr(dependent_launch, "ENABLED", enabled)
    monkeypatch.setattr(dependent_launch, "_capable", lambda index: capability >= (9, 0))
    assert dependent_launch.dependent_launch(torch.device("cuda", 0)) is expected


@pytest.fixture
def fast_launch(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", True)
    monkeypatch.setattr(_runtime, "_current_device", lambda: 0)
    monkeypatch.setattr(_runtime, "current_stream", lambda device: STREAM)


def test_pdl_is_a_compile_option_and_a_class_of_its_own(fast_launch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    launcher(7, (x, y), (3,), (16, True), num_warps=4, pdl=True)
    launcher(7, (x, y), (3,), (16, True), num_warps=4, pdl=True)
    launcher(7, (x, y), (3,), (16, True), num_warps=4)  # same arguments, no PDL: compiled anew
    assert kernel.kinds() == ["jit", "direct", "jit"]
    assert kernel.log[0][3] == {"num_warps": 4, "num_stages": None, "launch_pdl": True}
    assert kernel.log[2][3] == {"num_warps": 4, "num_stages": None}  # never launch_pdl=False


def test_unfast_launch_passes_the_option_only_when_set(monkeypatch):
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", False)
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    launcher(2, (x, y), (3,), (16,), num_warps=4)
    launcher(2, (x, y), (3,), (16,), num_warps=4, pdl=True)
    assert [entry[3] for entry in kernel.log] == [
        {"num_warps": 4, "num_stages": None},
        {"num_warps": 4, "num_stages": None, "launch_pdl": True},
    ]


def test_bound_launch_keeps_pdl(fast_launch):
    kernel = _Kernel()
    launcher = _runtime.Launcher(kernel)
    x, y = _tensors()
    bound = launcher.bind(5, (x, y), (3,), (16,), 4, dynamic=(0,), pdl=True)
    bound(x)
    bound(x)
    assert kernel.kinds() == ["jit", "direct"]
    assert kernel.log[0][3]["launch_pdl"] is True


# --------------------------------------------------------------------------------------------
# GPU: the decode chain's kernels with and without dependent launches
# --------------------------------------------------------------------------------------------


def _chain(x, residual, norm_w, w_up, w_down):
    """norm -> GEMV -> SiLU x up -> GEMV (split K) -> norm: each reads what the one before wrote."""
    from flashdec.kernels.activation import silu_and_mul
    from flashdec.kernels.gemv import GemvConfig, gemv
    from flashdec.kernels.norm import rms_norm

    h = rms_norm(x, norm_w, 1e-5, residual=residual)
    up = gemv(h, w_up)
    act = silu_and_mul(up)
    down = gemv(act, w_down, config=GemvConfig(4, 512, 4, 4))
    return rms_norm(down, norm_w, 1e-5, residual=residual)


@pytest.mark.gpu
def test_dependent_chain_equals_the_serial_one_in_a_graph(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90+ GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 4096, 8192

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, norm_w = rand(1, hidden), rand(hidden)
    w_up, w_down = rand(2 * inter, hidden) * 0.02, rand(hidden, inter) * 0.02
    residual0 = rand(1, hidden)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(dependent_launch, "ENABLED", on)
        assert dependent_launch.dependent_launch(x.device) is on
        residual = residual0.clone()
        eager = _chain(x, residual, norm_w, w_up, w_down)
        residual_graph = residual0.clone()
        _chain(x, residual_graph.clone(), norm_w, w_up, w_down)  # compile first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = _chain(x, residual_graph, norm_w, w_up, w_down)
        outs = []
        for _ in range(3):  # the residual is updated in place: every replay differs
            residual_graph.copy_(residual0)
            graph.replay()
            outs.append(replayed.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(o, eager) for o in outs)
        results[on] = (eager, residual)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
