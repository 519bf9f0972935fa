"""apply_rope: split-half rotation checked against hand-computed values."""

import math

import pytest
import torch

from flashdec import apply_rope
from flashdec.reference import apply_rope_inv_freq, rope_inv_freq


def test_position_zero_is_identity():
    x = torch.randn(3, 2, 8)
    out = apply_rope(x, torch.zeros(3, dtype=torch.int64))
    torch.testing.assert_close(out, x)


def test_hand_computed_rotation():
    # head_dim 4: pairs (x0, x2) at freq 1 and (x1, x3) at freq base**-0.5 = 0.01
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    pos = torch.tensor([2])
    out = apply_rope(x, pos)
    a0, a1 = 2.0, 2.0 * 0.01
    expected = torch.tensor(
        [
            1 * math.cos(a0) - 3 * math.sin(a0),
            2 * math.cos(a1) - 4 * math.sin(a1),
            3 * math.cos(a0) + 1 * math.sin(a0),
            4 * math.cos(a1) + 2 * math.sin(a1),
        ]
    )
    torch.testing.assert_close(out[0, 0], expected)


def test_partial_rotary_dim_leaves_tail_bitwise():
    x = torch.randn(2, 3, 10).to(torch.bfloat16)
    out = apply_rope(x, torch.tensor([5, 77]), rotary_dim=4)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.equal(out[..., :4], x[..., :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_preserves_norm_per_pair(dtype):
    x = torch.randn(4, 2, 16)
    out = apply_rope(x.to(dtype), torch.tensor([0, 1, 100, 4095]))
    assert out.dtype == dtype
    n_in = x.to(dtype).float().view(4, 2, 2, 8).pow(2).sum(2)
    n_out = out.float().view(4, 2, 2, 8).pow(2).sum(2)
    torch.testing.assert_close(n_out, n_in, rtol=2e-2, atol=2e-2)


def test_relative_position_property():
    # <rope(q, m), rope(k, n)> depends only on m - n
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def dot(m, n):
        return (apply_rope(q, torch.tensor([m])) * apply_rope(k, torch.tensor([n]))).sum()

    torch.testing.assert_close(dot(10, 3), dot(107, 100), rtol=1e-4, atol=1e-4)


def test_does_not_mutate_input():
    x = torch.randn(2, 2, 8)
    before = x.clone()
    apply_rope(x, torch.tensor([3, 4]))
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"rotary_dim": 3}, ValueError),
        ({"rotary_dim": 10}, ValueError),
        ({"rotary_dim": 2.0}, TypeError),
        ({"positions": torch.tensor([1.0, 2.0])}, TypeError),
        ({"positions": torch.tensor([1, 2, 3])}, ValueError),
        ({"x": torch.randn(2, 8)}, ValueError),
        ({"x": torch.randn(2, 2, 8).to(torch.int32)}, TypeError),
        ({"base": 0.5}, ValueError),
    ],
)
def test_errors(kwargs, error):
    args = {"x": torch.randn(2, 2, 8), "positions": torch.tensor([1, 2])}
    args.update(kwargs)
    with pytest.raises(error):
        apply_rope(**args)


@pytest.mark.parametrize(
    ("table", "error"),
    [
        (torch.ones(5), ValueError),  # rotates 10 dims of 8
        (torch.ones(2, 2), ValueError),  # not 1-D
        (torch.ones(4, dtype=torch.float64), TypeError),
        ([1.0, 2.0], TypeError),
    ],
)
def test_inv_freq_table_errors(table, error):
    with pytest.raises(error):
        apply_rope_inv_freq(torch.randn(2, 2, 8), torch.tensor([0, 1]), table)


def test_inv_freq_replaces_the_base_table():
    x, pos = torch.randn(3, 2, 8), torch.tensor([0, 6, 70000])
    table = rope_inv_freq(8, 500000.0)
    assert torch.equal(apply_rope(x, pos, base=500000.0), apply_rope_inv_freq(x, pos, table))
    # angle = position * inv_freq: halving the table is halving the (even) positions, exactly
    assert torch.equal(
        apply_rope_inv_freq(x, pos, table / 2), apply_rope_inv_freq(x, pos // 2, table)
    )


def test_hand_computed_rotation_with_a_given_table():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    out = apply_rope_inv_freq(x, torch.tensor([3]), torch.tensor([1.0, 0.25]))
    a0, a1 = 3.0, 0.75
    expected = torch.tensor(
        [
            1 * math.cos(a0) - 3 * math.sin(a0),
            2 * math.cos(a1) - 4 * math.sin(a1),
            3 * math.cos(a0) + 1 * math.sin(a0),
            4 * math.cos(a1) + 2 * math.sin(a1),
        ]
    )
    torch.testing.assert_close(out[0, 0], expected)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"base": "10000"}, TypeError),
        ({"base": True}, TypeError),
        ({"base": float("nan")}, ValueError),
    ],
)
def test_rope_table_errors(kwargs, error):
    x, pos = torch.randn(2, 2, 8), torch.tensor([1, 2])
    with pytest.raises(error):
        apply_rope(x, pos, **kwargs)
