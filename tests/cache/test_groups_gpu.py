"""The grouped cache on the GPU (pageable staging buffers, per-group fixed-address slots): a
Gemma-like full + window layout at real head shapes over a long generation."""

from __future__ import annotations

import pytest
import torch

from flashdec._blocks import blocks_for_tokens, window_block_bound
from flashdec.cache import PagedKVCache
from flashdec.reference import dense_decode_attention_ref, paged_decode_attention_ref
from tests.cache.helpers import decode_inputs, group_kv
from tests.cache.snapshot import snapshot
from tests.cache.test_groups import History

pytestmark = pytest.mark.gpu

SPEC = "(2,512,16,8,128):bfloat16:2;(2,64,16,4,64):bfloat16:2:window=64"


def test_long_generation_keeps_window_blocks_bounded_and_decodes_like_dense():
    cache = PagedKVCache(kv_spec=SPEC, layer_groups=[1, 0, 1, 0], device="cuda")
    history = History(cache, seed=0)
    rids = ["a", "b", "c", "d"]
    for rid in rids:
        cache.add_request(rid)
    history.prefill(rids, [300, 5, 64, 1])  # "a" imports far more than its window
    bound = window_block_bound(16, 64)
    gen = torch.Generator().manual_seed(1)
    for step in range(160):
        tx = cache.begin_token(rids)
        history.write(tx, rids, [1] * len(rids))
        if step % 40 == 39:  # decode every layer against the dense reference
            for layer in range(cache.num_layers):
                g = cache.layout.layer_group(layer)
                spec = cache.kv_groups[g]
                tables, lens = decode_inputs(cache, tx, group=g)
                q = torch.randn(4, 2 * spec.num_kv_heads, spec.head_dim, generator=gen)
                q = q.to(device="cuda", dtype=spec.dtype)
                k_layer, v_layer = cache.layout.layer_kv(layer)
                tables, lens = tables.to(torch.int32), lens.to(torch.int32)
                out = paged_decode_attention_ref(
                    q, k_layer, v_layer, tables, lens, window=spec.window
                )
                width = int(lens.max())
                dense_k = torch.zeros(
                    4, width, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device="cuda"
                )
                dense_v = torch.zeros_like(dense_k)
                for b, rid in enumerate(rids):
                    n = int(lens[b])
                    dense_k[b, :n] = torch.stack(history.k[(rid, layer)])
                    dense_v[b, :n] = torch.stack(history.v[(rid, layer)])
                ref = dense_decode_attention_ref(q, dense_k, dense_v, lens, window=spec.window)
                torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        cache.commit_token(tx)
        for rid in rids:
            held = len(cache.request_block_ids(rid, group=1))
            assert held == blocks_for_tokens(cache.seq_len(rid), 16, 64) <= bound
    cache.validate_invariants()
    assert cache.metrics()["groups"][1]["max_blocks_per_request"] <= bound
    for rid in rids:
        history.check_readable(rid)


def test_abort_after_a_partial_write_restores_every_group_on_gpu():
    cache = PagedKVCache(kv_spec=SPEC, device="cuda")
    history = History(cache, seed=2)
    cache.add_request("a")
    history.prefill(["a"], [79])  # the next token takes a block and releases one at commit
    before = snapshot(cache)
    tx = cache.begin_token(["a"])
    for layer in range(3):
        cache.write_token_layer(tx, layer, history.rows(layer, 1), history.rows(layer, 1))
    cache.abort_token(tx)
    after = snapshot(cache)
    assert after["requests"] == before["requests"]
    assert all(torch.equal(x, y) for x, y in zip(before["kv"], after["kv"], strict=True))
    cache.validate_invariants()


def test_fp8_group_on_gpu_quantizes_with_its_scales():
    spec = "(2,64,16,8,128):float8_e4m3fn:2;(2,64,16,8,128):bfloat16:1:window=32"
    scales = [(torch.full((8,), 0.5), torch.full((8,), 0.25)), None]
    cache = PagedKVCache(kv_spec=spec, device="cuda", kv_scales=scales)
    history = History(cache, seed=3)
    cache.add_request("a")
    history.prefill(["a"], [40])
    k_fp8, _ = group_kv(cache, 0)
    block = cache.request_block_ids("a")[0]
    want = (history.k[("a", 0)][3].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(k_fp8[0, block, :, 3].view(torch.uint8), want.view(torch.uint8))
    cache.validate_invariants()
