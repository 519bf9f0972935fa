"""The engine on the GPU: fused append + Triton decode match the references at real head shapes,
and a step issues no host sync inside its layers."""

import pytest
import torch

from flashdec import DecodeEngine, PagedKVCache, apply_rope, paged_decode_attention_ref
from tests.cache.helpers import decode_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "dim"), [(32, 8, 128), (32, 1, 128), (16, 16, 64)])
def test_engine_step_matches_reference_on_gpu(dtype, hq, hkv, dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = PagedKVCache(
        num_layers=3,
        num_kv_heads=hkv,
        head_dim=dim,
        block_size=16,
        max_blocks=400,
        dtype=dtype,
        device="cuda",
    )
    engine = DecodeEngine(cache)  # fused + triton
    rids = ["a", "b", "c"]
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    lengths = {"a": 1500, "b": 37, "c": 0}
    for rid, n in lengths.items():
        for _ in range(n):
            kv = torch.randn(3, hkv, dim, generator=gen, device="cuda").to(dtype)
            engine.prefill_request_layers(rid, kv, kv * 0.5)
    positions = cache.seq_lens_tensor(rids)
    tx = engine.begin_step(rids)
    for layer in range(3):
        q = torch.randn(3, hq, dim, generator=gen, device="cuda").to(dtype)
        k = torch.randn(3, hkv, dim, generator=gen, device="cuda").to(dtype)
        v = torch.randn(3, hkv, dim, generator=gen, device="cuda").to(dtype)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = engine.step_layer(tx, layer, q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        tables, lens = decode_inputs(cache, tx)
        k_layer, v_layer = cache.layout.layer_kv(layer)
        ref = paged_decode_attention_ref(apply_rope(q, positions), k_layer, v_layer, tables, lens)
        tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    engine.commit_step(tx)
    assert cache.seq_lens_tensor(rids).tolist() == [1501, 38, 1]
    cache.validate_invariants()
