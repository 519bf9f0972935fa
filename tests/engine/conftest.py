import pytest
import torch

from flashdec import PagedKVCache
from flashdec.engine import DecodeEngine

NUM_LAYERS, HKV, HQ, D, BS = 3, 2, 4, 16, 4


def make_engine(
    append_backend="torch",
    decode_backend="torch",
    num_layers=NUM_LAYERS,
    max_blocks=24,
    prefix_blocks=0,
    dtype=torch.float32,
    rotary_dim=None,
):
    cache = PagedKVCache(
        num_layers=num_layers,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BS,
        max_blocks=max_blocks,
        dtype=dtype,
        device="cpu",
        prefix_cache_capacity_blocks=prefix_blocks,
    )
    return DecodeEngine(
        cache, append_backend=append_backend, decode_backend=decode_backend, rotary_dim=rotary_dim
    )


def layer_inputs(batch, gen, dtype=torch.float32):
    q = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    k = torch.randn(batch, HKV, D, generator=gen).to(dtype)
    v = torch.randn(batch, HKV, D, generator=gen).to(dtype)
    return q, k, v


def run_step(engine, rids, gen, dtype=torch.float32):
    """One committed token for ``rids``; returns per-layer (q, k, v, out)."""
    tx = engine.begin_step(rids)
    layers = []
    for layer in range(engine.cache.num_layers):
        q, k, v = layer_inputs(len(rids), gen, dtype)
        layers.append((q, k, v, engine.step_layer(tx, layer, q, k, v)))
    engine.commit_step(tx)
    return layers


def graphed_step(engine, rids, static, inputs, step, captured):
    """One committed step of ``engine`` for ``rids`` on ``inputs`` (a ``(q, k, v)`` per layer)
    copied into the ``static`` tensors: eager at ``step`` 0 (every kernel compiles before the
    capture), captured in a CUDA graph at the next step, replayed from ``captured`` after.
    Returns the layers' outputs and the captured step."""
    for dst, src in zip(static, inputs, strict=True):
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
    layers = range(len(static))
    tx = engine.begin_step(rids)
    if step == 0:
        got = [engine.step_layer(tx, i, *static[i]) for i in layers]
    elif captured is None:
        captured = engine.capture_step(
            tx, lambda tx=tx: [engine.step_layer(tx, i, *static[i]) for i in layers]
        )
        got = captured.output
    else:
        got = engine.replay_step(tx, captured)
    engine.commit_step(tx)
    return got, captured


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)
