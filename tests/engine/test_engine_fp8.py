"""DecodeEngine over FP8 (float8_e4m3fn) KV groups: bf16 activations, scales per layer and head.

Every backend quantizes on append and dequantizes in decode: a step's output equals the reference
over the cache's own dequantized storage, the stored token is the rotated K/V within FP8 rounding,
and a failure at any layer leaves the storage bit-identical."""

from __future__ import annotations

import pytest
import torch

from flashdec import PagedKVCache, apply_rope, paged_decode_attention_ref
from flashdec.engine import DecodeEngine, rope_paged_kv_append
from flashdec.reference import dequantize_fp8
from tests.cache.helpers import group_kv

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
# group 0: full attention, 2 KV heads of 16; group 1: a 6-token window, 1 KV head of 8
SPEC = "(2,40,4,2,16):float8_e4m3fn:2;(2,12,4,1,8):float8_e4m3fn:1:window=6"
MIXED = "(2,40,4,2,16):float8_e4m3fn:2;(2,12,4,1,8):bfloat16:1:window=6"
ONE_GROUP = "(2,24,4,2,16):float8_e4m3fn:3"
LAYER_GROUPS = [0, 1, 0]
SCALES = [
    # group 0 (2 layers): per layer and head, deliberately unequal
    (torch.tensor([[0.5, 2.0], [0.125, 1.0]]), torch.tensor([[1.0, 0.25], [3.0, 0.5]])),
    (torch.tensor([0.75]), torch.tensor([1.5])),  # group 1: per head
]
ONE_GROUP_SCALES = (  # 3 layers x 2 heads
    torch.tensor([[0.5, 2.0], [0.125, 1.0], [4.0, 0.5]]),
    torch.tensor([[1.0, 0.25], [3.0, 0.5], [0.5, 0.75]]),
)
HQ = 4
# each append backend once; the decode path does not depend on which one wrote (as in
# test_engine_groups.py)
BACKENDS = [("torch", "torch"), ("triton", "torch"), ("fused", "triton")]


def make_engine(append_backend="torch", decode_backend="torch", spec=SPEC):
    one_group = spec == ONE_GROUP
    scales = [ONE_GROUP_SCALES] if one_group else [SCALES[0], SCALES[1] if "fn:1" in spec else None]
    cache = PagedKVCache(
        kv_spec=spec,
        layer_groups=None if one_group else LAYER_GROUPS,
        kv_scales=scales,
        device="cpu",
    )
    return DecodeEngine(
        cache, append_backend=append_backend, decode_backend=decode_backend, activation_dtype=BF16
    )


def geometry(cache, layer):
    spec = cache.kv_groups[cache.layout.layer_group(layer)]
    return spec.num_kv_heads, spec.head_dim


def admit(engine, rids):
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)


def prefill(engine, rid, length, gen):
    cache = engine.cache
    layers = [
        torch.randn(2, length, *geometry(cache, i), generator=gen).to(BF16)
        for i in range(cache.num_layers)
    ]
    assert (
        engine.prefill_request_layers(rid, [kv[0] for kv in layers], [kv[1] for kv in layers])
        == length
    )
    return layers


def stored_rows(cache, layer, slots):
    """Dequantized K and V of a step's reserved slots (float32 ``[rows, Hkv, D]``)."""
    scales = cache.layout.layer_kv_scales(layer)
    rows = []
    for t, scale in zip(cache.layout.layer_kv(layer), scales or (None, None), strict=True):
        raw = t.view(torch.uint8)[slots.block_ids.long(), :, slots.offsets.long()].view(t.dtype)
        rows.append(raw.float() if scale is None else dequantize_fp8(raw, scale))
    return rows


def checked_step(engine, rids, gen):
    cache = engine.cache
    positions = cache.seq_lens_tensor(rids)
    tx = engine.begin_step(rids)
    for layer in range(cache.num_layers):
        g = cache.layout.layer_group(layer)
        spec = cache.kv_groups[g]
        hkv, d = geometry(cache, layer)
        q = torch.randn(len(rids), HQ, d, generator=gen).to(BF16)
        k, v = torch.randn(2, len(rids), hkv, d, generator=gen).to(BF16)
        out = engine.step_layer(tx, layer, q, k, v)
        assert out.dtype == BF16 and out.shape == q.shape
        slots = cache.steps.transaction_slots(tx, group=g)
        # the new token is stored as rotated k and v, within FP8 rounding (3 mantissa bits)
        k_got, v_got = stored_rows(cache, layer, slots)
        k_rot = apply_rope(k, positions).float()
        tol = {"atol": 2e-2, "rtol": 7e-2} if spec.dtype == FP8 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(k_got, k_rot, **tol)
        torch.testing.assert_close(v_got, v.float(), **tol)
        # decode equals the reference over the cache's own (dequantized) storage
        k_layer, v_layer = cache.layout.layer_kv(layer)
        scales = cache.layout.layer_kv_scales(layer) or (None, None)
        ref = paged_decode_attention_ref(
            apply_rope(q, positions),
            k_layer,
            v_layer,
            slots.block_tables,
            slots.seq_lens_after,
            window=spec.window,
            k_scale=scales[0],
            v_scale=scales[1],
        )
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    engine.commit_step(tx)
    cache.validate_invariants()


@pytest.mark.parametrize(("append_backend", "decode_backend"), BACKENDS)
@pytest.mark.parametrize("spec", [SPEC, MIXED, ONE_GROUP])
def test_fp8_steps_match_the_reference_across_blocks_and_the_window(
    append_backend, decode_backend, spec
):
    engine = make_engine(append_backend, decode_backend, spec)
    assert engine.activation_dtype == BF16
    gen = torch.Generator().manual_seed(0)
    rids = ["a", "b", "c"]
    admit(engine, rids)
    prefill(engine, "a", 9, gen)  # longer than the window
    prefill(engine, "b", 3, gen)  # its next token fills a block, the one after starts one
    steps = 3 if "triton" in (append_backend, decode_backend) else 7
    for step in range(steps):
        checked_step(engine, rids if step % 2 == 0 else rids[:2], gen)
    assert engine.cache.seq_len("a") > 6 + 2


@pytest.mark.parametrize("append_backend", ["torch", "triton"])
def test_prefill_quantizes_with_each_layers_scales(append_backend):
    engine = make_engine(append_backend, "torch", ONE_GROUP)
    gen = torch.Generator().manual_seed(2)
    admit(engine, ["a"])
    layers = prefill(engine, "a", 6, gen)
    cache = engine.cache
    blocks = torch.tensor(cache.request_block_ids("a")).long()
    for layer, (k, v) in enumerate(layers):
        k_scale, v_scale = cache.layout.layer_kv_scales(layer)
        assert torch.equal(k_scale, ONE_GROUP_SCALES[0][layer])
        assert torch.equal(v_scale, ONE_GROUP_SCALES[1][layer])
        for t, x, scale in zip(
            cache.layout.layer_kv(layer), (k, v), (k_scale, v_scale), strict=True
        ):
            raw = t.view(torch.uint8)[blocks].view(FP8)  # [nb, Hkv, bs, D]
            got = raw.transpose(1, 2).reshape(-1, *x.shape[1:])[: x.shape[0]]
            want = (x.float() / scale.view(1, -1, 1)).clamp(-448, 448).to(FP8)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _state(cache):
    lens = {rid: cache.seq_len(rid) for rid in cache.request_ids()}
    free = [cache.layout.group_free_blocks(g) for g in range(cache.layout.num_groups)]
    storage = [
        torch.cat([t.flatten() for t in group_kv(cache, g)]).view(torch.uint8).clone()
        for g in range(cache.layout.num_groups)
    ]
    return lens, free, storage


def _assert_same(cache, before):
    lens, free, storage = _state(cache)
    assert (lens, free) == before[:2]
    for old, new in zip(before[2], storage, strict=True):
        assert torch.equal(old, new)
    cache.validate_invariants()


@pytest.mark.parametrize("append_backend", ["torch", "fused"])
@pytest.mark.parametrize("failing_layer", [0, 1, 2])
@pytest.mark.parametrize("how", ["bad dtype", "writer fault", "abort"])
def test_a_failure_at_any_layer_leaves_fp8_storage_bit_identical(
    append_backend, failing_layer, how, monkeypatch
):
    engine = make_engine(append_backend, "torch" if append_backend == "torch" else "triton")
    gen = torch.Generator().manual_seed(1)
    rids = ["a", "b"]
    admit(engine, rids)
    prefill(engine, "a", 7, gen)
    prefill(engine, "b", 4, gen)  # at a block boundary: its next token takes a block
    cache = engine.cache
    before = _state(cache)
    tx = engine.begin_step(rids)
    for layer in range(3):
        hkv, d = geometry(cache, layer)
        q = torch.randn(2, HQ, d, generator=gen).to(BF16)
        k, v = torch.randn(2, 2, hkv, d, generator=gen).to(BF16)
        if layer < failing_layer:
            engine.step_layer(tx, layer, q, k, v)
            continue
        if how == "abort":
            engine.abort_step(tx)
        elif how == "bad dtype":  # the storage dtype is not an activation dtype
            with pytest.raises(TypeError, match="dtype"):
                engine.step_layer(tx, layer, q, k.to(FP8), v)
        else:  # the writer stores the layer, then fails: abort must restore the bytes
            write = cache.write_token_layer_with

            def faulty(tx, layer_idx, writer, write=write):
                def store_then_fail(k_layer, v_layer, slots):
                    writer(k_layer, v_layer, slots)
                    raise RuntimeError("injected fault after the write")

                return write(tx, layer_idx, store_then_fail)

            monkeypatch.setattr(cache, "write_token_layer_with", faulty)
            with pytest.raises(RuntimeError, match="injected"):
                engine.step_layer(tx, layer, q, k, v)
        break
    assert not engine.has_open_step
    _assert_same(cache, before)


def test_activation_dtype_rules():
    fp8_cache = PagedKVCache(kv_spec=ONE_GROUP, device="cpu")
    with pytest.raises(ValueError, match="activation_dtype"):
        DecodeEngine(fp8_cache)  # required with FP8 groups
    with pytest.raises(ValueError, match="activation_dtype"):
        DecodeEngine(fp8_cache, activation_dtype=torch.float32)  # FP8 decode takes fp16/bf16
    with pytest.raises(ValueError, match="activation_dtype"):
        DecodeEngine(fp8_cache, activation_dtype=FP8)
    with pytest.raises(TypeError, match="activation_dtype"):
        DecodeEngine(fp8_cache, activation_dtype="bfloat16")
    assert DecodeEngine(fp8_cache, activation_dtype=torch.float16).activation_dtype == torch.float16
    mixed = PagedKVCache(kv_spec=MIXED, layer_groups=LAYER_GROUPS, device="cpu")
    with pytest.raises(ValueError, match=r"KV group 1 stores torch\.bfloat16"):
        DecodeEngine(mixed, activation_dtype=torch.float16)
    float_cache = PagedKVCache(2, 2, 16, 4, 8, dtype=torch.float32, device="cpu")
    assert DecodeEngine(float_cache).activation_dtype == torch.float32
    assert DecodeEngine(float_cache, activation_dtype=torch.float32).activation_dtype == (
        torch.float32
    )
    with pytest.raises(ValueError, match=r"KV group 0 stores torch\.float32"):
        DecodeEngine(float_cache, activation_dtype=BF16)


def test_bad_inputs_on_fp8_mutate_nothing():
    engine = make_engine(spec=ONE_GROUP)
    gen = torch.Generator().manual_seed(4)
    admit(engine, ["a"])
    prefill(engine, "a", 3, gen)
    cache = engine.cache
    before = _state(cache)
    k = torch.randn(2, 2, 16, generator=gen)
    for bad in (k.to(FP8), k):  # raw FP8 bytes and float32 are not the activation dtype
        with pytest.raises(TypeError, match="dtype"):
            engine.prefill_request_layers("a", [bad[:1]] * 3, [bad[:1]] * 3)
        with pytest.raises(TypeError, match="dtype"):
            engine.prefill_request_layers("a", bad[:1].expand(3, 2, 16), bad[:1].expand(3, 2, 16))
    assert not engine.has_open_step
    tx = engine.begin_step(["a"])
    with pytest.raises(TypeError, match="dtype"):
        engine.step_layer(tx, 0, k[:1].repeat(1, 2, 1).float(), k[:1], k[:1])
    assert not engine.has_open_step
    _assert_same(cache, before)
    with pytest.raises(ValueError, match="FP8"):
        empty = k[:0].to(BF16)
        fp8_cache = PagedKVCache(kv_spec="(2,8,4,2,16):float8_e4m3fn:1", device="cpu")
        rope_paged_kv_append(fp8_cache, 0, [], empty, empty, empty, None)


@pytest.mark.parametrize("spec", [SPEC, MIXED])
def test_an_fp8_extend_step_matches_the_torch_backends(spec):
    """An n-token step over FP8 groups (one with a window) through the Triton extend kernel,
    planned per group from the host's lengths, attends as the torch backends do over the same
    quantized storage."""
    gen = torch.Generator().manual_seed(3)
    engines = [make_engine("torch", "torch", spec), make_engine("fused", "triton", spec)]
    rids = ["a", "b"]
    for engine in engines:
        admit(engine, rids)
    for engine, seed in zip(engines, (11, 11), strict=True):
        prefill(engine, "a", 9, torch.Generator().manual_seed(seed))  # past the window
    counts = [4, 3]
    cache = engines[0].cache
    layers = []
    for layer in range(3):
        hkv, d = geometry(cache, layer)
        layers.append(
            tuple(torch.randn(sum(counts), h, d, generator=gen).to(BF16) for h in (HQ, hkv, hkv))
        )
    outs = []
    for engine in engines:
        tx = engine.begin_step(rids, num_tokens=counts)
        outs.append([engine.step_layer(tx, i, *layer) for i, layer in enumerate(layers)])
        assert engine.commit_step(tx).seq_lens == (13, 3)
        engine.cache.validate_invariants()
    # bf16 activations: the kernel and the float32 torch path round differently; a few outputs
    # differ by ~5 bf16 ulps (measured the same without a workspace, i.e. not the plan)
    for want, got in zip(*outs, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
