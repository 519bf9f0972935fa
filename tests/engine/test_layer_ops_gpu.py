"""Layer operations on a real GPU (``gpu`` marker): the three write backends agree through the
cache's writer hook, and the per-layer write path never synchronises with the host."""

from __future__ import annotations

import time

import pytest
import torch

from flashdec.cache import PagedKVCache
from flashdec.engine.layer_ops import Rope, write_plain_layer, write_rope_layer
from tests.cache.util import kernels_or_skip

ROPE = Rope(rotary_dim=128)


def rope_write(cache, tx, layer, q, k, v, backend):
    return cache.write_token_layer_with(
        tx, layer, lambda kl, vl, slots: write_rope_layer(backend, ROPE, q, k, v, kl, vl, slots)
    )


def plain_write(cache, tx, layer, k, v, backend):
    return cache.write_token_layer_with(
        tx, layer, lambda kl, vl, slots: write_plain_layer(backend, k, v, kl, vl, slots)
    )


pytestmark = pytest.mark.gpu

BACKENDS = ("torch", "triton", "fused")


def _cache(num_layers=4, dtype=torch.float16) -> PagedKVCache:
    cache = PagedKVCache(
        num_layers, 8, 128, 16, 256, dtype=dtype, device="cuda", prefix_cache_capacity_blocks=8
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_layers, 3, 8, 16, 128)
    blocks = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    cache.register_prefix("sys", blocks, blocks)
    for i in range(6):
        cache.add_request(i)
    for i in (0, 3):
        cache.attach_prefix(i, "sys")
    return cache


def _inputs(step, layer, batch, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1000 * step + layer)
    q = torch.randn(batch, 32, 128, generator=gen, device="cuda").to(dtype)
    k = torch.randn(batch, 8, 128, generator=gen, device="cuda").to(dtype)
    v = torch.randn(batch, 8, 128, generator=gen, device="cuda").to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backends_agree_on_cuda(dtype):
    kernels_or_skip()
    caches = {b: _cache(dtype=dtype) for b in BACKENDS}
    for step in range(40):
        batch = [i for i in range(6) if (step + i) % 3]  # a changing subset
        txs = {b: c.begin_token(batch) for b, c in caches.items()}
        for layer in range(4):
            q, k, v = _inputs(step, layer, len(batch), dtype)
            outs = {b: rope_write(c, txs[b], layer, q, k, v, b) for b, c in caches.items()}
            for b in ("triton", "fused"):
                torch.testing.assert_close(outs[b], outs["torch"], atol=1.6e-2, rtol=1.6e-2)
        for b, c in caches.items():
            c.commit_token(txs[b])
    ref = caches["torch"]
    for b, c in caches.items():
        assert torch.equal(c.v_cache, ref.v_cache), f"{b}: V differs"
        torch.testing.assert_close(c.k_cache, ref.k_cache, atol=1.6e-2, rtol=1.6e-2)
        c.validate_invariants()
    assert torch.equal(caches["triton"].k_cache, ref.k_cache)  # same RoPE, different scatter


def test_write_path_never_syncs():
    kernels_or_skip()
    cache = _cache()
    batch = list(range(6))
    for backend in BACKENDS:  # warm-up: compile the kernels outside the checked region
        tx = cache.begin_token(batch)
        for layer in range(4):
            q, k, v = _inputs(0, layer, 6, torch.float16)
            rope_write(cache, tx, layer, q, k, v, backend)
        cache.abort_token(tx)
    torch.cuda.synchronize()
    for backend in BACKENDS:
        tx = cache.begin_token(batch)
        inputs = [_inputs(1, layer, 6, torch.float16) for layer in range(4)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for layer, (q, k, v) in enumerate(inputs):
                if backend == "fused" or layer % 2:
                    rope_write(cache, tx, layer, q, k, v, backend)
                else:
                    plain = "torch" if backend == "torch" else "triton"
                    plain_write(cache, tx, layer, k, v, plain)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cache.commit_token(tx)
    cache.validate_invariants()


def test_host_overhead_of_a_token(capsys):
    """Prints the host time of begin + 32 layer writes + commit for a batch of 64 (a reading)."""
    kernels_or_skip()
    cache = PagedKVCache(32, 8, 128, 16, 2048, dtype=torch.float16, device="cuda")
    batch = list(range(64))
    for rid in batch:
        cache.add_request(rid)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.float16)
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.float16)
    for backend in BACKENDS:
        timings = {"begin": [], "writes": [], "commit": []}
        for rep in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tx = cache.begin_token(batch)
            t1 = time.perf_counter()
            for layer in range(32):
                rope_write(cache, tx, layer, q, k, k, backend)
            t2 = time.perf_counter()
            cache.commit_token(tx)
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            if rep >= 5:
                timings["begin"].append(t1 - t0)
                timings["writes"].append(t2 - t1)
                timings["commit"].append(t3 - t2)
        med = {key: sorted(vals)[len(vals) // 2] * 1e6 for key, vals in timings.items()}
        with capsys.disabled():
            print(
                f"\n[cache host overhead] {backend} B=64 L=32: begin {med['begin']:.0f} us, "
                f"32 writes {med['writes']:.0f} us ({med['writes'] / 32:.1f} us/layer), "
                f"commit {med['commit']:.0f} us"
            )
    cache.validate_invariants()
