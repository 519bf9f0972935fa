"""The layout adapter: vLLM's FlashAttention cache and metadata as FlashDec decode arguments."""

from __future__ import annotations

import pytest
import torch

import flashdec
from flashdec.vllm_plugin.layout import decode_arguments, token_major_kv_views
from flashdec.vllm_plugin.workspace import DecodeWorkspacePool
from tests.helpers import TOLERANCES, make_paged_kv
from tests.vllm_plugin.fakes import vllm_flash_cache

LAYOUTS = ("NHD", "HND", "cross_layer")


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_are_the_caches_memory_in_token_major_order(layout):
    k, v, *_ = make_paged_kv(
        [5, 19], num_kv_heads=3, head_dim=8, block_size=16, dtype=torch.float32
    )
    cache = vllm_flash_cache(k, v, layout, num_layers=3)
    k_view, v_view = token_major_kv_views(cache)
    assert k_view.shape == v_view.shape == k.shape  # [num_blocks, Hkv, block_size, D]
    torch.testing.assert_close(k_view, k, rtol=0, atol=0)
    torch.testing.assert_close(v_view, v, rtol=0, atol=0)
    assert storage_ptr(k_view) == storage_ptr(v_view) == storage_ptr(cache)  # no copy
    cache[0, 1, 3, 2, 5] = 42.0  # a write through vLLM's view shows in FlashDec's
    assert v_view[0, 2, 3, 5] == 42.0


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, 16, 2, 8), torch.zeros(2, 16, 2, 8)])
def test_views_reject_other_shapes(bad):
    with pytest.raises(ValueError, match="kv_cache"):
        token_major_kv_views(bad)


def test_views_reject_non_tensors():
    with pytest.raises(TypeError, match="kv_cache"):
        token_major_kv_views([[0.0]])


def qkv_rows(num_tokens, hq, hkv, d, dtype, gen):
    """``query`` as vLLM hands it over: a strided slice of the fused QKV projection."""
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    return qkv[:, : hq * d].view(num_tokens, hq, d)


CASES = [
    # seq_lens, Hq, Hkv, D, block_size, dtype, layout
    ([1, 17, 45], 4, 2, 64, 16, torch.float32, "NHD"),
    ([33, 0, 70], 3, 1, 32, 16, torch.bfloat16, "HND"),  # MQA, a padded (empty) row
    ([50, 9], 2, 2, 48, 32, torch.float16, "cross_layer"),  # MHA, odd head_dim
]


@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "bs", "dtype", "layout"), CASES)
@pytest.mark.parametrize("use_workspace", [False, True])
def test_decode_on_vllm_tensors_matches_the_reference(
    lens, hq, hkv, d, bs, dtype, layout, use_workspace, device
):
    gen = torch.Generator().manual_seed(len(lens) * 7 + hq)
    k, v, tables, seq_lens, *_ = make_paged_kv(lens, hkv, d, bs, dtype, device, generator=gen)
    cache = vllm_flash_cache(k, v, layout)
    padded = len(lens) + 2  # CUDA-graph padding: extra query/output rows
    query = qkv_rows(padded, hq, hkv, d, dtype, gen).to(device)
    output = torch.full((padded, hq, d), 7.0, dtype=dtype, device=device)

    args = decode_arguments(query, cache, tables, seq_lens, output)
    workspace = None
    if use_workspace:
        pool = DecodeWorkspacePool(
            max_batch=4,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            block_size=bs,
            dtype=dtype,
            device=device,
            max_seq_len=96,
            nominal_seq_len=32,
        )
        workspace = pool.workspace(len(lens))
    flashdec.decode(*args[:5], sm_scale=0.3, out=args.out, workspace=workspace)

    expected = flashdec.paged_decode_attention_ref(
        query[: len(lens)], k, v, tables, seq_lens, sm_scale=0.3
    )
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(output[: len(lens)], expected, atol=atol, rtol=rtol)
    assert (output[len(lens) :] == 7.0).all()  # padding rows untouched
    assert storage_ptr(args.q) == storage_ptr(query) and storage_ptr(args.out) == storage_ptr(
        output
    )


def test_decode_arguments_pass_tables_and_lengths_through():
    k, v, tables, seq_lens, *_ = make_paged_kv([3, 20], 2, 8, 16, torch.float32)
    cache = vllm_flash_cache(k, v)
    query = torch.zeros(2, 4, 8)
    args = decode_arguments(query, cache, tables, seq_lens, torch.empty_like(query))
    assert args.block_tables is tables and args.seq_lens is seq_lens and args.q is query
    views = token_major_kv_views(cache)
    kept = decode_arguments(query, cache, tables, seq_lens, query, kv_views=views)
    assert kept.k_cache is views[0] and kept.v_cache is views[1]


def test_decode_arguments_reject_inconsistent_rows():
    k, v, tables, seq_lens, *_ = make_paged_kv([3, 20, 4], 2, 8, 16, torch.float32)
    cache = vllm_flash_cache(k, v)
    q = torch.zeros(3, 4, 8)
    with pytest.raises(ValueError, match="block_table"):
        decode_arguments(q, cache, tables[:2], seq_lens, q)
    with pytest.raises(ValueError, match="query and output rows"):
        decode_arguments(q[:2], cache, tables, seq_lens, q)
    with pytest.raises(ValueError, match="output rows"):
        decode_arguments(q, cache, tables, seq_lens, torch.zeros(3, 2, 8))
    with pytest.raises(TypeError, match="seq_lens"):
        decode_arguments(q, cache, tables, [3, 20, 4], q)


def test_split_plans_of_the_pool_match_the_reference_on_long_requests(device):
    lens, hq, hkv, d, bs, dtype = [290, 3, 140], 4, 2, 16, 16, torch.float32
    k, v, tables, seq_lens, *_ = make_paged_kv(lens, hkv, d, bs, dtype, device)
    cache = vllm_flash_cache(k, v, "HND")
    query = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(3)).to(device)
    output = torch.empty_like(query)
    pool = DecodeWorkspacePool(
        max_batch=3,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=dtype,
        device=device,
        max_seq_len=300,
        nominal_seq_len=256,
    )
    workspace = pool.workspace(3)
    assert (
        workspace.plan.uses_split
        and workspace.plan.num_splits * workspace.plan.tokens_per_split >= 300
    )
    args = decode_arguments(query, cache, tables, seq_lens, output)
    flashdec.decode(*args[:5], out=args.out, workspace=workspace)
    expected = flashdec.paged_decode_attention_ref(query, k, v, tables, seq_lens)
    torch.testing.assert_close(output, expected, atol=2e-3, rtol=2e-3)
