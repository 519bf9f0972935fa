"""silu_and_mul against transformers' ``act_fn(gate) * up`` in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashdec.kernels.activation import silu_and_mul
from tests.helpers import TOLERANCES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rand(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 4).to(device=device, dtype=dtype)


def _assert_close(got, ref):
    atol, rtol = TOLERANCES[got.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (5, 1031), (2, 3, 40)], ids=str)
def test_separate_gate_and_up(dtype, shape, device):
    gate, up = _rand(shape, dtype, device), _rand(shape, dtype, device, seed=1)
    before = (gate.clone(), up.clone())
    out = silu_and_mul(gate, up)
    assert out.shape == shape and out.dtype == dtype
    _assert_close(out, _ref(gate, up))
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (4, 66), (3, 2050)], ids=str)
def test_concatenated_gate_up(dtype, shape, device):
    gate_up = _rand(shape, dtype, device, seed=2)
    width = shape[-1] // 2
    out = silu_and_mul(gate_up)
    assert out.shape == (*shape[:-1], width)
    _assert_close(out, _ref(gate_up[..., :width], gate_up[..., width:]))


def test_strided_inputs(device):
    base = _rand((6, 80), torch.float32, device, seed=3)
    gate, up = base[::2, :33], base[1::2, 40:73]  # row-strided views
    _assert_close(silu_and_mul(gate, up), _ref(gate, up))
    transposed = _rand((33, 4), torch.float32, device, seed=4).t()  # column stride != 1
    _assert_close(silu_and_mul(transposed, transposed), _ref(transposed, transposed))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) = inf
def test_extreme_gate_values(device):
    gate = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0]], device=device)
    up = torch.ones_like(gate)
    _assert_close(silu_and_mul(gate, up), _ref(gate, up))


def test_zero_rows(device):
    assert silu_and_mul(torch.empty(0, 8, device=device)).shape == (0, 4)


class TestErrors:
    def test_not_a_tensor(self):
        with pytest.raises(TypeError, match="x must be a torch"):
            silu_and_mul([1.0, 2.0])

    def test_integer_dtype(self, device):
        with pytest.raises(TypeError, match="x must have dtype"):
            silu_and_mul(torch.ones(2, 4, dtype=torch.int32, device=device))

    def test_odd_concatenated_width(self, device):
        with pytest.raises(ValueError, match="must be even"):
            silu_and_mul(torch.ones(2, 5, device=device))

    def test_up_mismatch(self, device):
        gate = torch.ones(2, 4, device=device)
        with pytest.raises(ValueError, match="up must have shape"):
            silu_and_mul(gate, torch.ones(2, 5, device=device))
        with pytest.raises(TypeError, match="up must have dtype"):
            silu_and_mul(gate, torch.ones(2, 4, dtype=torch.float16, device=device))

    def test_zero_dim(self, device):
        with pytest.raises(ValueError, match="0-d"):
            silu_and_mul(torch.tensor(1.0, device=device))

    def test_cpu_tensors_without_interpreter(self, monkeypatch):
        from flashdec.kernels import _runtime

        monkeypatch.setattr(_runtime, "INTERPRET", False)
        with pytest.raises(TypeError, match="need CUDA tensors"):
            silu_and_mul(torch.ones(2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 14336), (64, 14336), (37, 4865)])
def test_gpu_model_sizes(dtype, shape):
    gate, up = _rand(shape, dtype, "cuda"), _rand(shape, dtype, "cuda", seed=1)
    _assert_close(silu_and_mul(gate, up), _ref(gate, up))
    _assert_close(silu_and_mul(torch.cat([gate, up], -1)), _ref(gate, up))
