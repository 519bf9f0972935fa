"""benchmarks/fp8_dot_error.py: its rounding helpers, its attention against SDPA, the variants'
ordering on random data, and a smoke run on a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import fp8_dot_error as study


def test_e4m3_rounds_as_torch_stores_and_saturates():
    x = torch.tensor([0.0, 0.1, -3.3, 1000.0, -1e6])
    got = study.e4m3(x, 0.5)
    want = (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(got, want)
    assert got[3] == 224.0 and got[4] == -224.0  # saturated at 448 x scale


def test_scales_map_each_head_or_row_max_to_448():
    q = torch.randn(3, 5, 8)
    q[1] = 0.0  # a zero head keeps scale 1
    head = study.per_head_scale(q)
    assert head.shape == (3, 1, 1) and head[1].item() == 1.0
    assert torch.allclose((q[0] / head[0]).abs().max(), torch.tensor(448.0))
    row = study.per_row_scale(q)
    assert row.shape == (3, 5, 1)
    assert torch.allclose((q[2] / row[2]).abs().amax(dim=1), torch.full((5,), 448.0))


def test_causal_attention_equals_sdpa():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 7, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    got = study.causal_attention(q, k, v, 0.25, lambda p: p)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(got, want)


def test_the_variants_on_random_data_order_as_their_rounding_does():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 64, 32, generator=gen)
    k, v = torch.randn(2, 2, 64, 32, generator=gen)  # GQA: 2 KV heads for 4 query heads
    scales = torch.tensor([4.0 / 448, 2.0 / 448])
    outputs = study.variant_outputs(q, k, v, scales, scales, 32**-0.5)
    assert set(outputs) == {"reference", *study.VARIANTS}
    errors = study.layer_errors(outputs)
    assert errors["bf16 KV"] < errors["FP8 KV"] < errors["FP8 dots, q per head"]
    assert errors["FP8 dots, q per row"] <= errors["FP8 dots, q per head"] * 1.05
    assert all(errors[f"{name} vs FP8 KV"] > 0 for name in study.FP8_DOTS)


def test_a_smoke_run_writes_its_report(tmp_path):
    payload = study.main(["--model", "tiny-llama", "--tokens", "12", "--out-dir", str(tmp_path)])
    assert len(payload["layers"]) == 2 and payload["tokens"] == 12
    text = (tmp_path / "fp8_dot_error.md").read_text()
    assert "## Error over the layers" in text and "FP8 dots + P vs FP8 KV" in text
    saved = json.loads((tmp_path / "fp8_dot_error.json").read_text())
    assert [g["met"] for g in saved["targets"]] == [g["met"] for g in payload["targets"]]
    with pytest.raises(SystemExit):
        study.parse_args(["--tokens", "1"])
