"""FP8 KV groups on the GPU: fused quantizing append + Triton FP8 decode, eager and replayed from
a CUDA graph, against the reference over the cache's own storage (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from flashdec import DecodeEngine, PagedKVCache, apply_rope, paged_decode_attention_ref
from tests.cache.helpers import group_kv
from tests.engine.conftest import graphed_step

pytestmark = pytest.mark.gpu

# an FP8 full group of 8 KV heads x 128 and an FP8 40-token window group of 2 KV heads x 64
SPEC = "(2,96,16,8,128):float8_e4m3fn:2;(2,48,16,2,64):float8_e4m3fn:2:window=40"
LAYER_GROUPS = [1, 0, 1, 0]
GEOMETRY = {0: (8, 128), 1: (2, 64)}
LAYERS = range(len(LAYER_GROUPS))
HQ = 16
PROMPTS = [70, 15, 33]


def _engine(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scales = [  # per layer and head, every layer different (each binds its own scales)
        (
            torch.stack([torch.linspace(0.5, 2.0, 8), torch.linspace(3.0, 0.25, 8)]),
            torch.stack([torch.linspace(2.0, 0.25, 8), torch.linspace(0.125, 1.0, 8)]),
        ),
        (torch.tensor([[0.75, 1.25], [0.25, 4.0]]), torch.tensor([[1.5, 0.5], [2.0, 0.3]])),
    ]
    cache = PagedKVCache(
        kv_spec=SPEC, layer_groups=LAYER_GROUPS, device="cuda", max_seq_len=512, kv_scales=scales
    )
    engine = DecodeEngine(cache, activation_dtype=torch.bfloat16)  # fused append, Triton decode
    rids = ["a", "b", "c"]
    for rid, n in zip(rids, PROMPTS, strict=True):
        engine.add_request(rid)
        engine.admit(rid)
        kv = [
            torch.randn(2, n, *GEOMETRY[g], generator=gen, device="cuda").bfloat16()
            for g in LAYER_GROUPS
        ]
        engine.prefill_request_layers(rid, [x[0] for x in kv], [x[1] for x in kv])
    return engine, rids


def test_fp8_steps_eager_and_replayed_equal_the_reference():
    eager, rids = _engine(0)
    graphed, _ = _engine(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(HQ, *GEOMETRY[g]) for g in LAYER_GROUPS]
    static = [
        tuple(torch.empty(3, h, d, dtype=torch.bfloat16, device="cuda") for h in (hq, hkv, hkv))
        for hq, hkv, d in shapes
    ]
    captured = None
    cache = eager.cache
    for step in range(24):  # 'b' passes the window; every request crosses block boundaries
        inputs = [
            tuple(
                torch.randn(3, h, d, generator=gen, device="cuda").bfloat16()
                for h in (hq, hkv, hkv)
            )
            for hq, hkv, d in shapes
        ]
        positions = cache.seq_lens_tensor(rids)
        tx = eager.begin_step(rids)
        want = [eager.step_layer(tx, i, *inputs[i]) for i in LAYERS]
        for i, g in enumerate(LAYER_GROUPS):
            slots = cache.steps.transaction_slots(tx, group=g)
            k_scale, v_scale = cache.layout.layer_kv_scales(i)
            k_layer, v_layer = cache.layout.layer_kv(i)
            ref = paged_decode_attention_ref(
                apply_rope(inputs[i][0], positions),
                k_layer,
                v_layer,
                slots.block_tables,
                slots.seq_lens_after,
                window=cache.kv_groups[g].window,
                k_scale=k_scale,
                v_scale=v_scale,
            )
            torch.testing.assert_close(want[i].float(), ref.float(), atol=2e-2, rtol=2e-2)
        eager.commit_step(tx)

        got, captured = graphed_step(graphed, rids, static, inputs, step, captured)
        for i in LAYERS:
            torch.testing.assert_close(got[i], want[i], atol=0, rtol=0)
    for g in range(2):
        for a, b in zip(group_kv(cache, g), group_kv(graphed.cache, g), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    graphed.cache.validate_invariants()
