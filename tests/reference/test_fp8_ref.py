"""FP8 (e4m3) KV quantisation and the paged reference over FP8 caches."""

from __future__ import annotations

import pytest
import torch

from flashdec import paged_decode_attention_ref
from flashdec.reference import dequantize_fp8, quantize_fp8
from tests.helpers import TOLERANCES, make_paged_kv

FP8 = torch.float8_e4m3fn


def test_round_trip_error_bound():
    """Normal range: relative error <= 2**-4 (3 mantissa bits, round to nearest); subnormal
    range: absolute error <= 2**-10 * scale (spacing 2**-9)."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-4, 2.6, 4000).reshape(-1, 1, 1)  # |x / scale| up to ~400
    signs = torch.where(torch.rand(4000, 1, 1, generator=gen) < 0.5, -1.0, 1.0)
    unit = signs * magnitudes * torch.rand(4000, 3, 8, generator=gen)  # [N, Hkv=3, D]
    for scale in (torch.tensor([0.5, 0.01, 3.0]), 0.25):
        per_head = scale[:, None] if isinstance(scale, torch.Tensor) else torch.tensor(scale)
        x = unit * per_head
        back = dequantize_fp8(quantize_fp8(x, scale), scale)
        bound = torch.maximum(x.abs() * 2**-4, 2**-10 * per_head)
        assert ((back - x).abs() <= bound).all()
        assert ((back == 0) | (back.sign() == x.sign())).all()


def test_saturation_and_exact_values():
    x = torch.tensor([[[1e6, -1e6, 448.0, -449.0, 0.0, 1.0, 2.0**-9, 300.0]]])
    q = quantize_fp8(x, 1.0)
    assert q.dtype == FP8
    assert q.float().tolist() == [[[448.0, -448.0, 448.0, -448.0, 0.0, 1.0, 2.0**-9, 288.0]]]
    assert not torch.isnan(q.float()).any()
    # scaled: 1e6 / 2 still saturates; the stored value times the scale is the dequantised one
    assert dequantize_fp8(quantize_fp8(x, 2.0), 2.0)[0, 0, 0].item() == 896.0
    # input dtypes: fp16 / bf16 go through float32 math
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(
            quantize_fp8(x.to(dtype), 1.0).float(), quantize_fp8(x.to(dtype).float(), 1.0).float()
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
def test_paged_reference_dequantises_per_head(dtype, kv_layout):
    seq_lens = [37, 0, 70]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 2, 24, 8, torch.float32)
    k_scale, v_scale = torch.tensor([0.02, 0.5]), 0.01
    k8 = quantize_fp8(k.transpose(1, 2), k_scale).transpose(1, 2)  # heads at dim -2
    v8 = quantize_fp8(v.transpose(1, 2), v_scale).transpose(1, 2)
    k_deq = dequantize_fp8(k8.transpose(1, 2), k_scale).transpose(1, 2)
    v_deq = dequantize_fp8(v8.transpose(1, 2), v_scale).transpose(1, 2)
    if kv_layout == "dim_major":
        k8, v8, k_deq, v_deq = (t.transpose(2, 3).contiguous() for t in (k8, v8, k_deq, v_deq))
    q = torch.randn(3, 4, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = paged_decode_attention_ref(
        q, k8, v8, tables, lens, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale
    )
    assert got.dtype == dtype
    want = paged_decode_attention_ref(q.float(), k_deq, v_deq, tables, lens, kv_layout=kv_layout)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    windowed = paged_decode_attention_ref(
        q, k8, v8, tables, lens, kv_layout=kv_layout, window=5, k_scale=0.5, v_scale=v_scale
    )
    assert windowed.shape == q.shape


class TestScaleErrors:
    def _inputs(self, cache_dtype=FP8, q_dtype=torch.float16):
        k, v, tables, lens, _, _ = make_paged_kv([10, 3], 2, 16, 8, torch.float32)
        q = torch.randn(2, 2, 16).to(q_dtype)
        return q, k.to(cache_dtype), v.to(cache_dtype), tables, lens

    @pytest.mark.parametrize(
        ("scales", "error", "match"),
        [
            ({}, ValueError, "needs k_scale and v_scale.*k_scale and v_scale missing"),
            ({"k_scale": 1.0}, ValueError, "v_scale missing"),
            ({"v_scale": 1.0}, ValueError, "k_scale missing"),
            ({"k_scale": 0.0, "v_scale": 1.0}, ValueError, "k_scale must be a positive finite"),
            ({"k_scale": 1.0, "v_scale": float("inf")}, ValueError, "v_scale must be a positive"),
            ({"k_scale": True, "v_scale": 1.0}, TypeError, "k_scale must be a float or a float32"),
            ({"k_scale": "1", "v_scale": 1.0}, TypeError, "k_scale must be a float"),
            ({"k_scale": torch.ones(3), "v_scale": 1.0}, ValueError, r"k_scale must have shape"),
            ({"k_scale": torch.ones(2, 1), "v_scale": 1.0}, ValueError, "k_scale must be 1-D"),
            ({"k_scale": 1.0, "v_scale": torch.ones(2).half()}, TypeError, "v_scale must have"),
        ],
    )
    def test_fp8_cache_scale_rules(self, scales, error, match):
        q, k, v, tables, lens = self._inputs()
        with pytest.raises(error, match=match):
            paged_decode_attention_ref(q, k, v, tables, lens, **scales)

    def test_float_cache_with_scales(self):
        q, k, v, tables, lens = self._inputs(torch.float16)
        for scales in ({"k_scale": 1.0}, {"v_scale": torch.ones(2)}):
            with pytest.raises(ValueError, match="apply only to float8_e4m3fn caches"):
                paged_decode_attention_ref(q, k, v, tables, lens, **scales)

    def test_fp8_cache_needs_fp16_or_bf16_queries(self):
        q, k, v, tables, lens = self._inputs(q_dtype=torch.float32)
        with pytest.raises(TypeError, match="k_cache must have dtype in"):
            paged_decode_attention_ref(q, k, v, tables, lens, k_scale=1.0, v_scale=1.0)
        q, k, v, tables, lens = self._inputs()
        with pytest.raises(TypeError, match="v_cache must have dtype"):
            paged_decode_attention_ref(q, k, v.half(), tables, lens, k_scale=1.0, v_scale=1.0)
