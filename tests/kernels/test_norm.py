"""rms_norm (and its fused residual add) against transformers' RMSNorm math in torch."""

from __future__ import annotations

import pytest
import torch

from flashdec.kernels.norm import MAX_HIDDEN, rms_norm
from tests.helpers import TOLERANCES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, written out."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = (1 + torch.randn(shape[-1], generator=gen) / 4).to(device=device, dtype=dtype)
    residual = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x, weight, residual


def _assert_close(got, ref):
    atol, rtol = TOLERANCES[got.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


def _assert_rounded_equal(got, ref):
    """Bitwise, except bf16 on the interpreter: it truncates float32 -> bf16 where the GPU (and
    torch) round to nearest, so there the sum may sit one bf16 ulp lower."""
    if got.dtype == torch.bfloat16 and got.device.type == "cpu":
        torch.testing.assert_close(got.float(), ref.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 33), (7, 100), (2, 3, 24), (5, 257)], ids=str)
def test_matches_transformers_math(dtype, shape, device):
    x, weight, _ = _inputs(shape, dtype, device)
    before = x.clone()
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    _assert_close(out, _rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(x, before)  # x is only read


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (3, 33), (4, 129)], ids=str)
def test_fused_residual_add(dtype, shape, device):
    x, weight, residual = _inputs(shape, dtype, device, seed=1)
    expected_sum = residual + x  # torch rounds the sum to the dtype once, as the kernel does
    out = rms_norm(x, weight, 1e-5, residual=residual)
    _assert_rounded_equal(residual, expected_sum)
    _assert_close(out, _rms_norm_ref(expected_sum, weight, 1e-5))


def test_strided_input_and_large_eps(device):
    base, weight, _ = _inputs((6, 48), torch.float32, device, seed=2)
    x = base[::2, :40]  # rows strided, columns a prefix
    out = rms_norm(x, weight[:40].contiguous(), 0.5)
    _assert_close(out, _rms_norm_ref(x, weight[:40], 0.5))


def test_zero_rows(device):
    x = torch.empty(0, 16, device=device)
    assert rms_norm(x, torch.ones(16, device=device), 1e-6).shape == (0, 16)


class TestErrors:
    def _args(self, device):
        x, weight, residual = _inputs((3, 16), torch.float32, device)
        return x, weight, residual

    @pytest.mark.parametrize(
        ("change", "kind", "match"),
        [
            (lambda a: {**a, "x": a["x"].tolist()}, TypeError, "x must be a torch"),
            (lambda a: {**a, "x": a["x"].long()}, TypeError, "x must have dtype"),
            (lambda a: {**a, "x": a["x"][0, 0]}, ValueError, "0-d"),
            (lambda a: {**a, "weight": a["weight"].half()}, TypeError, "weight must have dtype"),
            (lambda a: {**a, "weight": a["weight"][:15]}, ValueError, "weight must have shape"),
            (lambda a: {**a, "eps": 0.0}, ValueError, "eps must be a positive"),
            (lambda a: {**a, "eps": float("nan")}, ValueError, "eps must be a positive"),
            (lambda a: {**a, "eps": True}, TypeError, "eps must be a float"),
            (
                lambda a: {**a, "residual": a["residual"].half()},
                TypeError,
                "residual must have dtype",
            ),
            (
                lambda a: {**a, "residual": a["residual"][:2]},
                ValueError,
                "residual must have shape",
            ),
            (
                lambda a: {**a, "residual": a["residual"].t().contiguous().t()},
                ValueError,
                "residual must be contiguous",
            ),
        ],
    )
    def test_rejected_call_mutates_nothing(self, change, kind, match, device):
        x, weight, residual = self._args(device)
        args = change({"x": x, "weight": weight, "eps": 1e-6, "residual": residual})
        snapshot = [t.clone() for t in (x, weight, residual)]
        with pytest.raises(kind, match=match):
            rms_norm(args["x"], args["weight"], args["eps"], residual=args["residual"])
        for before, now in zip(snapshot, (x, weight, residual), strict=True):
            assert torch.equal(before, now)

    def test_hidden_too_large(self, device):
        x = torch.zeros(1, MAX_HIDDEN + 1, device=device)
        with pytest.raises(ValueError, match="hidden size"):
            rms_norm(x, torch.ones(MAX_HIDDEN + 1, device=device), 1e-6)

    def test_cpu_tensors_without_interpreter(self, monkeypatch):
        from flashdec.kernels import _runtime

        monkeypatch.setattr(_runtime, "INTERPRET", False)
        with pytest.raises(TypeError, match="need CUDA tensors"):
            rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (64, 4096), (37, 5120), (64, 8192), (512, 128)])
def test_gpu_model_sizes(dtype, shape):
    x, weight, residual = _inputs(shape, dtype, "cuda", seed=3)
    expected_sum = residual + x
    out = rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(residual, expected_sum)
    _assert_close(out, _rms_norm_ref(expected_sum, weight, 1e-5))
    _assert_close(rms_norm(x, weight, 1e-5), _rms_norm_ref(x, weight, 1e-5))
