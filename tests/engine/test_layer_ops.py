"""The engine's layer operations: rope_paged_kv_append and the RoPE/plain write paths through
the cache's writer hook — what is stored, and that the torch, Triton and fused backends store the
same bytes (rotated q within dtype rounding)."""

from __future__ import annotations

import pytest
import torch

from flashdec.engine.layer_ops import (
    Rope,
    RopeAppendResult,
    rope_paged_kv_append,
    write_plain_layer,
    write_rope_layer,
)
from flashdec.reference import apply_rope
from tests.cache.snapshot import assert_rejected, snapshot
from tests.cache.util import kernels_or_skip, make_cache, prefix_blocks, stored, tokens
from tests.helpers import TOLERANCES


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_torch_backend_rotates_q_and_k_and_stores_v_as_given():
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=8, block_size=2, max_blocks=8)
    for rid in ("a", "b"):
        cache.add_request(rid)
    for step in range(3):  # a and b at different positions: b starts one token later
        batch = ["a", "b"] if step else ["a"]
        n = len(batch)
        q, k, v = tokens(cache, n, 10 * step, heads=4), tokens(cache, n, 1), tokens(cache, n, 2)
        result = rope_paged_kv_append(cache, 0, batch, q, k, v, rotary_dim=None)
        assert isinstance(result, RopeAppendResult)
        positions = torch.tensor([step, step - 1][:n], dtype=torch.int32)
        assert torch.equal(result.positions, positions)
        assert torch.equal(result.q, apply_rope(q, positions))
        assert torch.equal(result.seq_lens, positions + 1)
        assert torch.equal(result.block_tables, cache.block_tables(batch))
        k_rot = apply_rope(k, positions)
        for row, rid in enumerate(batch):
            k_st, v_st = stored(cache, rid, int(positions[row]))
            assert torch.equal(bits(k_st[0]), bits(k_rot[row]))
            assert torch.equal(bits(v_st[0]), bits(v[row]))
    cache.validate_invariants()


def test_partial_rotary_dim_leaves_the_tail_alone():
    cache = make_cache(num_layers=1, head_dim=8)
    cache.add_request("a")
    cache.append(["a"], tokens(cache, 1, 0), tokens(cache, 1, 0))
    q, k = tokens(cache, 1, 1, heads=2), tokens(cache, 1, 2)
    result = rope_paged_kv_append(cache, 0, ["a"], q, k, k, rotary_dim=4)
    assert torch.equal(result.q[..., 4:], q[..., 4:])
    assert not torch.equal(result.q[..., :4], q[..., :4])  # position 1 rotates
    assert torch.equal(stored(cache, "a", 1)[0][0, :, 4:], k[0, :, 4:])


def test_rope_append_is_single_layer_only(cache):
    cache.add_request("a")
    k = tokens(cache, 1, 0)
    q = tokens(cache, 1, 0, heads=2)
    assert_rejected(
        cache,
        RuntimeError,
        "single-layer",
        lambda: rope_paged_kv_append(cache, 0, ["a"], q, k, k, None),
    )
    with pytest.raises(TypeError, match="PagedKVCache"):
        rope_paged_kv_append(object(), 0, ["a"], q, k, k, None)


@pytest.fixture
def cache():
    return make_cache()


ROPE_FULL = Rope(rotary_dim=4)  # make_cache's head_dim


def rope_writer(backend, rope, q, k, v):
    return lambda kl, vl, slots: write_rope_layer(backend, rope, q, k, v, kl, vl, slots)


def plain_writer(backend, k, v):
    return lambda kl, vl, slots: write_plain_layer(backend, k, v, kl, vl, slots)


def test_transaction_rope_write_matches_reference(cache):
    for rid in ("a", "b"):
        cache.add_request(rid)
    blocks = prefix_blocks(cache, 1, 0)
    cache.register_prefix("p", blocks, blocks)
    cache.add_request("c")
    cache.attach_prefix("c", "p")  # c's new token sits at position 2
    tx = cache.begin_token(["a", "c"])
    positions = torch.tensor([0, 2], dtype=torch.int32)
    written = []
    for layer in range(cache.num_layers):
        q, k, v = tokens(cache, 2, layer, heads=4), tokens(cache, 2, 5 + layer), tokens(cache, 2, 9)
        q_rot = cache.write_token_layer_with(
            tx,
            layer,
            rope_writer("torch", ROPE_FULL, q, k, v),
        )
        assert torch.equal(q_rot, apply_rope(q, positions))
        written.append((apply_rope(k, positions), v))
    cache.commit_token(tx)
    for row, rid in enumerate(["a", "c"]):
        k_st, v_st = stored(cache, rid, int(positions[row]))
        for layer, (k_rot, v) in enumerate(written):
            assert torch.equal(k_st[layer], k_rot[row]) and torch.equal(v_st[layer], v[row])


# ---- backend agreement (needs flashdec.kernels.append; interpreted on CPU) -----------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _three_caches(dtype, **kw):
    caches = {}
    for backend in ("torch", "triton", "fused"):
        cache = make_cache(
            dtype=dtype, num_kv_heads=2, head_dim=8, block_size=2, max_blocks=6, **kw
        )
        for rid in ("a", "b", "c"):
            cache.add_request(rid)
        caches[backend] = cache
    return caches


def _assert_same_storage(caches, dtype):
    """V bytes identical on all backends; K bytes identical for torch vs triton (same reference
    RoPE, different scatter); the fused kernel's rotated K within dtype rounding (SPEC §3)."""
    ref = caches["torch"]
    atol, rtol = TOLERANCES[dtype]
    for backend, cache in caches.items():
        assert torch.equal(bits(cache.v_cache), bits(ref.v_cache)), f"{backend} V differs"
        if backend == "fused":
            torch.testing.assert_close(cache.k_cache, ref.k_cache, atol=atol, rtol=rtol)
        else:
            assert torch.equal(bits(cache.k_cache), bits(ref.k_cache)), f"{backend} K differs"
        assert snapshot(cache)["requests"] == snapshot(ref)["requests"]
        cache.validate_invariants()


@pytest.mark.parametrize("dtype", DTYPES)
def test_legacy_append_backends_store_identical_bytes(dtype):
    kernels_or_skip()
    caches = _three_caches(dtype, num_layers=1)
    for step in range(3):
        batch = ["c", "a", "b"][: step + 1]
        n = len(batch)
        q = tokens(caches["torch"], n, step, heads=4)
        k, v = tokens(caches["torch"], n, 10 + step), tokens(caches["torch"], n, 20 + step)
        results = {}
        for backend, cache in caches.items():
            if step == 0:  # plain append with the two scatter backends
                plain = "torch" if backend == "fused" else backend
                cache.steps.append_with(batch, plain_writer(plain, k, v))
                continue
            results[backend] = rope_paged_kv_append(
                cache, 0, batch, q, k, v, rotary_dim=4, append_backend=backend
            )
        if results:
            atol, rtol = TOLERANCES[dtype]
            for backend in ("triton", "fused"):
                torch.testing.assert_close(
                    results[backend].q, results["torch"].q, atol=atol, rtol=rtol
                )
                assert torch.equal(results[backend].positions, results["torch"].positions)
                assert torch.equal(results[backend].seq_lens, results["torch"].seq_lens)
        _assert_same_storage(caches, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transaction_backends_store_identical_bytes(dtype):
    kernels_or_skip()
    caches = _three_caches(dtype, num_layers=2)
    for step in range(3):
        batch = ["b", "c", "a"][: 3 - step]
        n = len(batch)
        ref = caches["torch"]
        txs = {name: cache.begin_token(batch) for name, cache in caches.items()}
        for layer in range(2):
            q = tokens(ref, n, 100 * step + layer, heads=4)
            k, v = tokens(ref, n, 7 + layer), tokens(ref, n, 8 + layer)
            q_rot = {}
            for name, cache in caches.items():
                if layer == 0:  # layer 0: plain scatter, torch vs triton
                    plain = "torch" if name == "fused" else name
                    cache.write_token_layer_with(txs[name], 0, plain_writer(plain, k, v))
                else:
                    q_rot[name] = cache.write_token_layer_with(
                        txs[name], layer, rope_writer(name, Rope(rotary_dim=8), q, k, v)
                    )
            if q_rot:
                atol, rtol = TOLERANCES[dtype]
                for name in ("triton", "fused"):
                    torch.testing.assert_close(q_rot[name], q_rot["torch"], atol=atol, rtol=rtol)
        for name, cache in caches.items():
            cache.commit_token(txs[name])
        _assert_same_storage(caches, dtype)
