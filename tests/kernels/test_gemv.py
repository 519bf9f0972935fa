"""gemv (``x Wᵀ + b`` for a few rows) against ``F.linear`` in float32, and its dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashdec.kernels import gemv as gemv_module
from flashdec.kernels.gemv import GemvConfig, default_config, gemv, gemv_wins, small_batch_linear

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rand(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _ref(x, weight, bias=None):
    """The float32 product of the (rounded) inputs, rounded once to the inputs' dtype."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def _assert_close(got, x, weight, bias=None):
    ref = _ref(x, weight, bias).float()
    # float32 sums in another order; then one rounding to the dtype (half an ulp each side)
    scale = ref.abs().amax().clamp_min(1.0)
    ulp = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[got.dtype]
    torch.testing.assert_close(got.float(), ref, atol=ulp * scale, rtol=ulp)


CONFIGS = [
    None,
    GemvConfig(block_n=4, block_k=16, split_k=1, num_warps=2),
    GemvConfig(block_n=8, block_k=32, split_k=4, num_warps=4),
    GemvConfig(block_n=16, block_k=64, split_k=2, num_warps=4),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(1, 37, 300), (3, 16, 64), (8, 9, 129)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_linear_on_odd_sizes(device, config, rows, out_features, in_features, with_bias):
    x = _rand((rows, in_features), torch.float32, device)
    weight = _rand((out_features, in_features), torch.float32, device, seed=1)
    bias = _rand((out_features,), torch.float32, device, seed=2) if with_bias else None
    before = (x.clone(), weight.clone())
    out = gemv(x, weight, bias, config=config)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    _assert_close(out, x, weight, bias)
    assert torch.equal(x, before[0]) and torch.equal(weight, before[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_rounds_once(device, dtype):
    if device.type == "cpu":
        pytest.skip("half-precision Triton math is checked on the GPU (tests below)")
    x = _rand((2, 96), dtype, device)
    weight = _rand((40, 96), dtype, device, seed=1)
    _assert_close(gemv(x, weight), x, weight)


def test_leading_dims_strided_x_and_weight_views(device):
    base = _rand((4, 2, 70), torch.float32, device)
    x = base[:, :, 3:67]  # rows not contiguous, unit column stride
    big = _rand((50, 80), torch.float32, device, seed=1)
    weight = big[5:45, 8:72]  # a row-strided view of a larger matrix
    out = gemv(x[:2], weight, config=GemvConfig(8, 16, 2, 2))
    assert out.shape == (2, 2, 40)
    _assert_close(out, x[:2], weight)
    transposed = _rand((64, 3), torch.float32, device, seed=2).t()  # column stride != 1
    _assert_close(gemv(transposed, weight), transposed, weight)


def test_empty_inputs(device):
    weight = _rand((5, 0), torch.float32, device)
    bias = _rand((5,), torch.float32, device, seed=1)
    assert torch.equal(gemv(torch.ones(2, 0, device=device), weight, bias), bias.expand(2, 5))
    assert torch.equal(
        gemv(torch.ones(2, 0, device=device), weight), torch.zeros(2, 5, device=device)
    )
    assert gemv(torch.ones(0, 4, device=device), _rand((5, 4), torch.float32, device)).shape == (
        0,
        5,
    )


def test_bad_input_is_refused(device):
    x = _rand((2, 8), torch.float32, device)
    weight = _rand((4, 8), torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(_rand((9, 8), torch.float32, device), weight)
    with pytest.raises(ValueError, match=r"weight must be \[out_features, 8\]"):
        gemv(x, _rand((4, 7), torch.float32, device))
    with pytest.raises(ValueError, match="unit column stride"):
        gemv(x, _rand((8, 4), torch.float32, device).t())
    with pytest.raises(TypeError):
        gemv(x, weight.half())
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        gemv(x, weight, _rand((3,), torch.float32, device))
    with pytest.raises(TypeError, match="GemvConfig"):
        gemv(x, weight, config=(8, 16, 1, 4))
    with pytest.raises(ValueError, match="at least one dim"):
        gemv(torch.tensor(1.0, device=device), weight)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=6, block_k=16, split_k=1, num_warps=4)
    with pytest.raises(ValueError, match="num_warps"):
        GemvConfig(block_n=8, block_k=16, split_k=1, num_warps=3)
    for cap in (8, 256):
        with pytest.raises(ValueError, match="max_registers"):
            GemvConfig(block_n=8, block_k=16, split_k=1, num_warps=4, max_registers=cap)


def test_a_register_cap_is_a_launch_option_only(device):
    """The interpreter has no registers: a capped config computes what the uncapped one does."""
    x = _rand((2, 64), torch.float32, device)
    weight = _rand((24, 64), torch.float32, device, seed=1)
    capped = gemv(x, weight, config=GemvConfig(4, 16, 2, 2, max_registers=64))
    torch.testing.assert_close(capped, gemv(x, weight, config=GemvConfig(4, 16, 2, 2)))


def test_default_config_fills_the_machine_with_whole_k_steps():
    # one row: the largest tile whose programs fit on the SMs at once (one wave)
    assert default_config(1, 3584, 3584, 132) == GemvConfig(4, 1024, 1, 4)  # 896 <= 7 x 132
    # Llama-3-8B's o and down: 1,024 column blocks, 8 an SM under a register cap
    assert default_config(1, 4096, 4096, 132) == GemvConfig(4, 1024, 1, 4, max_registers=64)
    assert default_config(1, 4096, 14336, 132) == GemvConfig(4, 1024, 1, 4, max_registers=64)
    assert default_config(1, 4608, 3584, 132) == GemvConfig(4, 512, 1, 4)  # Qwen2-7B's qkv
    assert default_config(1, 6144, 4096, 132) == GemvConfig(4, 1024, 1, 4)  # two waves anyway
    assert default_config(1, 4096, 4096, 78).max_registers is None  # fewer SMs: none fits
    assert default_config(4, 4096, 4096, 132).block_k == 256  # 4 rows: products stay at 4,096
    cfg = default_config(1, 256, 8192, 132)  # 64 column blocks: K slices up to ~4 per SM
    assert cfg.split_k == 2 and 8192 // cfg.split_k >= 4 * cfg.block_k
    assert triton_cdiv(256, cfg.block_n) * cfg.split_k <= 8 * 132
    assert default_config(1, 64, 16, 132) == GemvConfig(4, 16, 1, 4)  # too short to split


def triton_cdiv(a, b):
    return -(-a // b)


def test_small_batch_linear_takes_the_kernel_only_where_it_wins(monkeypatch):
    weight = torch.zeros(16, 8)
    assert not gemv_wins(1, weight)  # a CPU weight: cuBLAS's (or the CPU's) F.linear
    x = _rand((2, 8), torch.float32, "cpu")
    torch.testing.assert_close(
        small_batch_linear(x, _rand((16, 8), torch.float32, "cpu")),
        F.linear(x, _rand((16, 8), torch.float32, "cpu")),
    )
    monkeypatch.setattr(gemv_module, "ENABLED", False)
    assert not gemv_wins(1, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(6144, 4096), (4096, 4096), (4096, 14336), (1029, 2047)]
)
def test_gpu_model_sizes(dtype, rows, out_features, in_features):
    x = _rand((rows, in_features), dtype, "cuda")
    weight = _rand((out_features, in_features), dtype, "cuda", seed=1) / in_features**0.5
    bias = _rand((out_features,), dtype, "cuda", seed=2)
    for config in (
        None,
        GemvConfig(16, 256, 1, 8),
        GemvConfig(4, 1024, 8, 4),
        GemvConfig(4, 1024, 1, 4, max_registers=56),
    ):
        _assert_close(gemv(x, weight, config=config), x, weight)
        _assert_close(gemv(x, weight, bias, config=config), x, weight, bias)


@pytest.mark.gpu
def test_gpu_dispatch_and_cuda_graph_capture():
    from flashdec.runtime import capture_cuda_graph

    x = _rand((1, 4096), torch.bfloat16, "cuda")
    weight = _rand((4096, 4096), torch.bfloat16, "cuda", seed=1) / 64
    assert gemv_wins(1, weight) == gemv_module.ENABLED and not gemv_wins(2, weight)
    assert not gemv_wins(1, torch.zeros(128256, 4096, dtype=torch.bfloat16, device="cuda"))
    expected = small_batch_linear(x, weight)
    graph = torch.cuda.CUDAGraph()
    with capture_cuda_graph(graph):
        out = small_batch_linear(x, weight)
    x.copy_(_rand((1, 4096), torch.bfloat16, "cuda", seed=3))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, x, weight)
    assert not torch.equal(out, expected)
