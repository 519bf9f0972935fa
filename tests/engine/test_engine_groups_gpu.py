"""A grouped cache on the GPU: fused append + Triton window decode per group, eager and replayed
from a CUDA graph, against the dense reference (run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from flashdec import DecodeEngine, PagedKVCache, apply_rope, dense_decode_attention_ref
from tests.cache.helpers import group_kv
from tests.engine.conftest import graphed_step

pytestmark = pytest.mark.gpu

# a full group of 8 KV heads x 128 and a 40-token window group of 2 KV heads x 64, interleaved
SPEC = "(2,96,16,8,128):bfloat16:2;(2,48,16,2,64):bfloat16:2:window=40"
LAYER_GROUPS = [1, 0, 1, 0]
GEOMETRY = {0: (8, 128, None), 1: (2, 64, 40)}
LAYERS = range(len(LAYER_GROUPS))
HQ = 16
PROMPTS = [70, 15, 33]  # one longer than the window, one crossing a block on its second step


def _engine(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = PagedKVCache(kv_spec=SPEC, layer_groups=LAYER_GROUPS, device="cuda", max_seq_len=512)
    engine = DecodeEngine(cache)  # fused append, Triton decode
    rids = ["a", "b", "c"]
    history = {}
    for rid, n in zip(rids, PROMPTS, strict=True):
        engine.add_request(rid)
        engine.admit(rid)
        ks, vs = [], []
        for layer, g in enumerate(LAYER_GROUPS):
            hkv, d, _ = GEOMETRY[g]
            k, v = torch.randn(2, n, hkv, d, generator=gen, device="cuda").bfloat16()
            ks.append(k)
            vs.append(v)
            history[layer, rid] = ([*k], [*v])
        engine.prefill_request_layers(rid, ks, vs)
    return engine, rids, history


def _reference(history, layer, rids, q_rot):
    hkv, d, window = GEOMETRY[LAYER_GROUPS[layer]]
    lens = [len(history[layer, rid][0]) for rid in rids]
    k = torch.zeros(len(rids), max(lens), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for b, rid in enumerate(rids):
        k[b, : lens[b]] = torch.stack(history[layer, rid][0])
        v[b, : lens[b]] = torch.stack(history[layer, rid][1])
    lens_t = torch.tensor(lens, device="cuda")
    return dense_decode_attention_ref(q_rot, k, v, lens_t, window=window)


def test_grouped_steps_eager_and_replayed_equal_the_reference():
    eager, rids, history = _engine(0)
    graphed, _, _ = _engine(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(HQ, GEOMETRY[g][0], GEOMETRY[g][1]) for g in LAYER_GROUPS]
    static = [
        tuple(torch.empty(3, h, d, dtype=torch.bfloat16, device="cuda") for h in (hq, hkv, hkv))
        for hq, hkv, d in shapes
    ]
    captured = None
    for step in range(24):  # 'b' passes the window; every request crosses block boundaries
        inputs = [
            tuple(
                torch.randn(3, h, d, generator=gen, device="cuda").bfloat16()
                for h in (hq, hkv, hkv)
            )
            for hq, hkv, d in shapes
        ]
        positions = eager.cache.seq_lens_tensor(rids)
        tx = eager.begin_step(rids)
        want = [eager.step_layer(tx, i, *inputs[i]) for i in range(len(LAYER_GROUPS))]
        eager.commit_step(tx)
        for i, (_, k, v) in enumerate(inputs):
            k_rot = apply_rope(k, positions)
            for b, rid in enumerate(rids):
                history[i, rid][0].append(k_rot[b])
                history[i, rid][1].append(v[b])
            ref = _reference(history, i, rids, apply_rope(inputs[i][0], positions))
            torch.testing.assert_close(want[i].float(), ref.float(), atol=2e-2, rtol=2e-2)

        got, captured = graphed_step(graphed, rids, static, inputs, step, captured)
        for i in LAYERS:
            torch.testing.assert_close(got[i], want[i], atol=0, rtol=0)
    for g in range(2):
        for a, b in zip(group_kv(eager.cache, g), group_kv(graphed.cache, g), strict=True):
            assert torch.equal(a, b)
    metrics = graphed.cache.metrics()["groups"][1]
    assert metrics["max_blocks_per_request"] <= metrics["block_bound_per_request"]
    graphed.cache.validate_invariants()
