"""The shared validators of flashdec._checks: one error type per kind of mistake."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashdec._checks import (
    AppendStats,
    PagedDecodeDims,
    PagedDecodeStats,
    check_append_stats,
    check_choice,
    check_device,
    check_fraction,
    check_inv_freq,
    check_kv_layout,
    check_paged_decode_inputs,
    check_paged_decode_stats,
    check_request_id,
    check_rope_base,
    check_rotary_dim,
    check_token_ids,
    paged_decode_stats,
    same_device,
    type_name,
)


@pytest.mark.parametrize("value", [10000.0, 500000, 1.5, np.float64(1e6), np.int64(10000)])
def test_rope_base_accepts_real_numbers(value):
    assert check_rope_base(value) == float(value)
    assert isinstance(check_rope_base(value), float)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (True, TypeError),
        ("10000", TypeError),
        (None, TypeError),
        (torch.tensor(10000.0), TypeError),
        (1.0, ValueError),
        (0.5, ValueError),
        (-2, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
    ],
)
def test_rope_base_rejects(value, error):
    with pytest.raises(error, match="rope_base"):
        check_rope_base(value, "rope_base")


def test_choice_lists_the_allowed_values():
    assert check_choice("backend", "torch", ("torch", "triton")) == "torch"
    with pytest.raises(ValueError, match=r"'torch', 'triton'.*'cuda'"):
        check_choice("backend", "cuda", ("torch", "triton"))
    with pytest.raises(TypeError, match="backend must be a str"):
        check_choice("backend", 1, ("torch", "triton"))
    with pytest.raises(TypeError, match="kv_layout"):
        check_kv_layout(None)
    with pytest.raises(ValueError, match="kv_layout"):
        check_kv_layout("NHD")


@pytest.mark.parametrize("value", ["r1", "", 0, 7, 2**70])
def test_request_id_accepts_str_and_int(value):
    assert check_request_id("request_id", value) == value


@pytest.mark.parametrize("value", [True, False, 1.0, None, ("r",), b"r1"])
def test_request_id_rejects_other_types(value):
    with pytest.raises(TypeError, match="request_id must be a str or an int"):
        check_request_id("request_id", value)


def test_rotary_dim():
    assert check_rotary_dim(None, 64) == 64
    assert check_rotary_dim(32, 64) == 32
    for bad, error in [(3, ValueError), (0, ValueError), (66, ValueError), (2.0, TypeError)]:
        with pytest.raises(error, match="rotary_dim"):
            check_rotary_dim(bad, 64)
    with pytest.raises(TypeError):
        check_rotary_dim(True, 64)


def test_inv_freq():
    table = torch.ones(4)
    assert check_inv_freq(table, 8, torch.device("cpu"), 10000.0) is table
    with pytest.raises(ValueError, match=r"inv_freq must have shape \(4,\)"):
        check_inv_freq(torch.ones(5), 8, torch.device("cpu"), 10000.0)
    with pytest.raises(TypeError, match="inv_freq"):
        check_inv_freq(table.half(), 8, torch.device("cpu"), 10000.0)
    with pytest.raises(TypeError, match="inv_freq"):
        check_inv_freq(table, 8, torch.device("meta"), 10000.0)
    with pytest.raises(ValueError, match="not both"):
        check_inv_freq(table, 8, torch.device("cpu"), 500000.0)


def test_same_device():
    assert same_device(torch.device("cpu"), "cpu")
    assert same_device("cuda", torch.device("cuda", 1))
    assert not same_device("cuda:0", "cuda:1")
    assert not same_device("cpu", "cuda")


def _decode_inputs(**changes):
    args = {
        "q": torch.zeros(3, 4, 16),
        "k_cache": torch.zeros(10, 2, 8, 16),
        "v_cache": torch.zeros(10, 2, 8, 16),
        "block_tables": torch.zeros(3, 5, dtype=torch.int32),
        "seq_lens": torch.zeros(3, dtype=torch.int64),
    }
    args.update(changes)
    return args


def test_paged_decode_inputs_dims():
    dims = check_paged_decode_inputs(**_decode_inputs())
    assert dims == PagedDecodeDims(3, 4, 16, 10, 2, 8, 5)
    dim_major = _decode_inputs(k_cache=torch.zeros(10, 2, 16, 8), v_cache=torch.zeros(10, 2, 16, 8))
    assert check_paged_decode_inputs(**dim_major, kv_layout="dim_major") == dims


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"q": "q"}, TypeError, "q must be a torch.Tensor"),
        ({"q": torch.zeros(3, 4, 16, dtype=torch.int32)}, TypeError, "q must have dtype"),
        ({"q": torch.zeros(3, 64)}, ValueError, "q must be 3-D"),
        ({"k_cache": torch.zeros(10, 2, 8, 16).half()}, TypeError, "k_cache"),
        ({"v_cache": torch.zeros(10, 2, 8, 8)}, ValueError, "same shape"),
        ({"v_cache": torch.zeros(10, 2, 8, 16, device="meta")}, TypeError, "v_cache must be on"),
        ({"block_tables": torch.zeros(3, 5)}, TypeError, "block_tables"),
        ({"block_tables": torch.zeros(4, 5, dtype=torch.int32)}, ValueError, "batch size 3"),
        ({"seq_lens": torch.zeros(3, 1, dtype=torch.int32)}, ValueError, "seq_lens must be 1-D"),
        ({"q": torch.zeros(3, 3, 16)}, ValueError, "multiple of num_kv_heads"),
        ({"q": torch.zeros(3, 4, 32)}, ValueError, "head_dim"),
        ({"kv_layout": "hnd"}, ValueError, "kv_layout"),
        ({"kv_layout": 0}, TypeError, "kv_layout"),
    ],
)
def test_paged_decode_inputs_errors(changes, error, match):
    kv_layout = changes.pop("kv_layout", "token_major")
    with pytest.raises(error, match=match):
        check_paged_decode_inputs(**_decode_inputs(**changes), kv_layout=kv_layout)


def test_paged_decode_stats_ignore_unused_entries():
    dims = PagedDecodeDims(3, 4, 16, 10, 2, 8, 4)
    tables = torch.tensor([[3, 9, -1, 99], [-5, -5, -5, -5], [0, 1, 2, 8]])
    lens = torch.tensor([9, 0, 32], dtype=torch.int32)  # blocks used: 2, 0, 4
    stats = paged_decode_stats(tables, lens, dims)
    assert stats == PagedDecodeStats(0, 32, 41, 0, 9)
    check_paged_decode_stats(stats, dims)
    assert paged_decode_stats(tables[1:2], lens[1:2], dims._replace(batch=1)).min_id is None


@pytest.mark.parametrize(
    ("stats", "match"),
    [
        (PagedDecodeStats(-1, 5, 4, 0, 1), "seq_lens must be >= 0"),
        (PagedDecodeStats(0, 33, 40, 0, 1), r"seq_lens must be <= .* = 32"),
        (PagedDecodeStats(0, 5, 5, -1, 1), r"outside \[0, 10\)"),
        (PagedDecodeStats(0, 5, 5, 0, 10), r"outside \[0, 10\)"),
    ],
)
def test_paged_decode_stats_errors(stats, match):
    with pytest.raises(ValueError, match=match):
        check_paged_decode_stats(stats, PagedDecodeDims(3, 4, 16, 10, 2, 8, 4))


@pytest.mark.parametrize(
    ("stats", "match"),
    [
        (AppendStats(-1, 3, 0, 7, None, 0), "block_ids"),
        (AppendStats(0, 10, 0, 7, None, 0), "block_ids"),
        (AppendStats(0, 3, -1, 7, None, 0), "offsets"),
        (AppendStats(0, 3, 0, 8, None, 0), "offsets"),
        (AppendStats(0, 3, 0, 7, -1, 0), "positions"),
        (AppendStats(0, 3, 0, 7, 0, 2), "same"),
    ],
)
def test_append_stats_errors(stats, match):
    check_append_stats(AppendStats(0, 9, 0, 7, 0, 0), 10, 8)
    with pytest.raises(ValueError, match=match):
        check_append_stats(stats, 10, 8)


@pytest.mark.parametrize("value", [1, 1.0, 0.5, np.float32(0.25), 1e-9])
def test_fraction_accepts_shares_up_to_one(value):
    assert check_fraction("f", value) == float(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (1.01, ValueError),
        (math.nan, ValueError),
        (-0.5, ValueError),
        (True, TypeError),
        ("0.5", TypeError),
        (None, TypeError),
    ],
)
def test_fraction_rejects(value, error):
    with pytest.raises(error, match=r"f must (be in \(0, 1\]|be a float)"):
        check_fraction("f", value)


def test_type_names_say_where_a_type_comes_from():
    assert [type_name(v) for v in (1, [], np.float64(1), torch.zeros(1))] == [
        "int",
        "list",
        "numpy.float64",
        "torch.Tensor",
    ]


def test_token_ids_accept_integers_of_any_kind():
    for ids in ([1, 2], (1, 2), [np.int32(1), np.int64(2)], np.array([1, 2]), torch.tensor([1, 2])):
        out = check_token_ids("p", ids)
        assert out == [1, 2] and all(type(t) is int for t in out)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([1, 2.0], TypeError, "got float at index 1"),
        ([np.float32(1)], TypeError, "got numpy.float32 at index 0"),
        ([np.bool_(True)], TypeError, "got numpy.bool"),
        ([False], TypeError, "got bool at index 0"),
        (np.array([True]), TypeError, "array of bool"),
        (torch.tensor([1.0]), TypeError, "array of torch.float32"),
        (np.zeros((1, 2), dtype=np.int64), ValueError, "must be 1-D"),
        ("12", TypeError, "got str"),
    ],
)
def test_token_ids_name_what_is_wrong(value, error, match):
    with pytest.raises(error, match=match):
        check_token_ids("p", value)


def test_device_must_exist():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not available"):
        check_device("cuda:99")
    with pytest.raises(ValueError, match="invalid device"):
        check_device("gpu")
    with pytest.raises(TypeError, match="got int"):
        check_device(0)
