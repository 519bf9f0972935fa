"""kv_append and fused_rope_kv_append against apply_rope and a plain indexed write."""

from __future__ import annotations

import pytest
import torch

import flashdec
from flashdec import apply_rope
from flashdec.kernels import (
    fused_rope_kv_append,
    kv_append,
    launch_fused_rope_kv_append,
    launch_kv_append,
)
from flashdec.reference import apply_rope_inv_freq, rope_inv_freq
from tests.helpers import TOLERANCES, device_syncs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _setup(batch, hq, hkv, d, num_blocks, block_size, dtype, device, seed=0, layers=None):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    cache_shape = (num_blocks, hkv, block_size, d)
    if layers is None:
        k_cache, v_cache = rnd(*cache_shape), rnd(*cache_shape)
    else:  # one layer of a 5-D cache: a strided view
        k_cache, v_cache = rnd(layers, *cache_shape)[1], rnd(layers, *cache_shape)[1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:batch]
    block_ids = (slots // block_size).to(device=device, dtype=torch.int32)
    offsets = (slots % block_size).to(device=device, dtype=torch.int64)
    positions = torch.randint(0, 40000, (batch,), generator=gen).to(device)
    return {
        "q": rnd(batch, hq, d),
        "k": rnd(batch, hkv, d),
        "v": rnd(batch, hkv, d),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_ids": block_ids,
        "offsets": offsets,
        "positions": positions,
    }


# _setup's tensors in the order fused_rope_kv_append / its launcher (and kv_append) take them
FUSED_ARGS = ("q", "k", "v", "k_cache", "v_cache", "block_ids", "offsets", "positions")
KV_APPEND_ARGS = ("k_cache", "v_cache", "k", "v", "block_ids", "offsets")


def _fused_call(t, **kwargs):
    return fused_rope_kv_append(*(t[key] for key in FUSED_ARGS), **kwargs)


def _launch_fused(t, q_out, *extra, q=None, base=10000.0):
    """The trusted fused launch on ``t`` (whole-head RoPE); ``q`` replaces ``t["q"]`` (in place
    when it is also ``q_out``), ``extra`` is passed on positionally (``inv_freq``)."""
    q = t["q"] if q is None else q
    rest = (t[key] for key in FUSED_ARGS[1:])
    return launch_fused_rope_kv_append(q, *rest, None, base, q_out, *extra)


def _kv_args(t):
    return tuple(t[key] for key in KV_APPEND_ARGS)


def _written(cache, t):
    return cache[t["block_ids"].long(), :, t["offsets"].long()]  # [B, Hkv, D]


def _assert_rope_close(got, ref):
    atol, rtol = TOLERANCES[got.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


def _untouched_equal(before, after, t):
    mask = torch.ones(after.shape[0], after.shape[2], dtype=torch.bool, device=after.device)
    mask[t["block_ids"].long(), t["offsets"].long()] = False
    assert torch.equal(before.permute(0, 2, 1, 3)[mask], after.permute(0, 2, 1, 3)[mask])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strided", [False, True])
def test_kv_append_is_a_bitwise_scatter(dtype, strided, device):
    t = _setup(5, 4, 2, 24, 7, 8, dtype, device, layers=3 if strided else None)
    k_before, v_before = t["k_cache"].clone(), t["v_cache"].clone()
    kv_append(*_kv_args(t))
    assert torch.equal(_written(t["k_cache"], t), t["k"])
    assert torch.equal(_written(t["v_cache"], t), t["v"])
    _untouched_equal(k_before, t["k_cache"], t)
    _untouched_equal(v_before, t["v_cache"], t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "rotary_dim"),
    [(4, 2, 32, None), (6, 1, 48, 16), (3, 3, 64, 64), (8, 2, 16, 8)],
)
def test_fused_rope_append_matches_reference(dtype, hq, hkv, d, rotary_dim, device):
    t = _setup(4, hq, hkv, d, 6, 16, dtype, device, layers=2)
    k_before = t["k_cache"].clone()
    q_rot = _fused_call(t, rotary_dim=rotary_dim, base=10000.0)
    _assert_rope_close(q_rot, apply_rope(t["q"], t["positions"], rotary_dim))
    _assert_rope_close(_written(t["k_cache"], t), apply_rope(t["k"], t["positions"], rotary_dim))
    assert torch.equal(_written(t["v_cache"], t), t["v"])  # v is stored bitwise
    if rotary_dim is not None and rotary_dim < d:  # dims past rotary_dim are copied unchanged
        assert torch.equal(q_rot[..., rotary_dim:], t["q"][..., rotary_dim:])
        assert torch.equal(_written(t["k_cache"], t)[..., rotary_dim:], t["k"][..., rotary_dim:])
    _untouched_equal(k_before, t["k_cache"], t)


def test_fused_q_out_in_place_and_launchers_agree(device):
    dtype = torch.float16
    t = _setup(3, 4, 2, 32, 5, 8, dtype, device)
    ref_q = apply_rope(t["q"], t["positions"], None, 500.0)
    q_out = torch.full_like(t["q"], float("nan"))
    got = _fused_call(t, base=500.0, q_out=q_out)
    assert got is q_out
    _assert_rope_close(got, ref_q)
    k_written = _written(t["k_cache"], t).clone()
    # in place (q_out=q) through the trusted launcher gives the same bits
    q = t["q"].clone()
    _launch_fused(t, q, q=q, base=500.0)
    assert torch.equal(q, got)
    assert torch.equal(_written(t["k_cache"], t), k_written)
    launch_kv_append(*_kv_args(t))
    assert torch.equal(_written(t["k_cache"], t), t["k"])
    assert flashdec.kv_append is kv_append
    assert flashdec.fused_rope_kv_append is fused_rope_kv_append


def test_empty_batch_is_a_no_op(device):
    t = _setup(0, 2, 1, 16, 3, 8, torch.float32, device)
    before = t["k_cache"].clone()
    kv_append(*_kv_args(t))
    q = _fused_call(t)
    assert q.shape == (0, 2, 16) and torch.equal(before, t["k_cache"])


def _bad_calls(t):
    """(description, kwargs overrides, error) for calls that must be rejected."""
    n = t["k_cache"].shape[0]
    ids, offs, pos = t["block_ids"], t["offsets"], t["positions"]
    bad_ids = ids.clone()
    bad_ids[-1] = n
    neg_ids = ids.clone()
    neg_ids[0] = -1
    bad_offs = offs.clone()
    bad_offs[1] = t["k_cache"].shape[2]
    dup_ids, dup_offs = ids.clone(), offs.clone()
    dup_ids[1], dup_offs[1] = ids[0], offs[0]
    bad_pos = pos.clone()
    bad_pos[2] = -3
    return [
        ("block id == num_blocks", {"block_ids": bad_ids}, ValueError),
        ("negative block id", {"block_ids": neg_ids}, ValueError),
        ("offset == block_size", {"offsets": bad_offs}, ValueError),
        ("duplicate slot", {"block_ids": dup_ids, "offsets": dup_offs}, ValueError),
        ("float ids", {"block_ids": ids.float()}, TypeError),
        ("short offsets", {"offsets": offs[:-1]}, ValueError),
        ("k dtype", {"k": t["k"].double()}, TypeError),
        ("k heads", {"k": t["k"][:, :1]}, ValueError),
        ("v shape", {"v": t["v"][:-1]}, ValueError),
        ("cache rank", {"k_cache": t["k_cache"][0]}, ValueError),
        ("not a tensor", {"k": "k"}, TypeError),
        ("negative position", {"positions": bad_pos}, ValueError),
    ]


@pytest.mark.parametrize("fused", [False, True])
def test_rejected_calls_write_nothing(fused, device):
    t = _setup(4, 4, 2, 16, 5, 8, torch.float16, device)
    k_before, v_before = t["k_cache"].clone(), t["v_cache"].clone()
    q_before = t["q"].clone()
    for what, override, error in _bad_calls(t):
        args = {**t, **override}
        if not fused and what == "negative position":
            continue
        with pytest.raises(error):
            if fused:
                _fused_call(args)
            else:
                kv_append(*_kv_args(args))
        assert torch.equal(t["k_cache"], k_before), what
        assert torch.equal(t["v_cache"], v_before), what
        assert torch.equal(t["q"], q_before), what


def test_fused_rejects_bad_rope_arguments(device):
    t = _setup(2, 4, 2, 16, 3, 8, torch.float32, device)
    k_before = t["k_cache"].clone()
    common = tuple(t[key] for key in FUSED_ARGS[1:])  # all but q
    with pytest.raises(ValueError, match="rotary_dim"):
        fused_rope_kv_append(t["q"], *common, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim"):
        fused_rope_kv_append(t["q"], *common, rotary_dim=32)
    with pytest.raises(ValueError, match="base"):
        fused_rope_kv_append(t["q"], *common, base=1.0)
    with pytest.raises(ValueError, match="q"):
        fused_rope_kv_append(t["q"][:, :, :8], *common)
    with pytest.raises(TypeError, match="q"):
        fused_rope_kv_append(t["q"].half(), *common)
    with pytest.raises(ValueError, match="q_out"):
        fused_rope_kv_append(t["q"], *common, q_out=t["q"][:1])
    assert torch.equal(t["k_cache"], k_before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_llama_shapes_large_batch(dtype):
    t = _setup(256, 32, 8, 128, 2048, 16, dtype, "cuda")
    t["positions"] = torch.randint(0, 131072, (256,), device="cuda")
    q_rot = _fused_call(t, base=500000.0)
    _assert_rope_close(q_rot, apply_rope(t["q"], t["positions"], None, 500000.0))
    k_ref = apply_rope(t["k"], t["positions"], None, 500000.0)
    _assert_rope_close(_written(t["k_cache"], t), k_ref)
    assert torch.equal(_written(t["v_cache"], t), t["v"])


# --------------------------------------------------------------------------------------------
# padding rows (trusted launchers) and the model's own RoPE frequencies
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True])
def test_trusted_launchers_skip_padding_rows(fused, device):
    t = _setup(5, 4, 2, 16, 6, 8, torch.float16, device)
    padding = torch.tensor([False, True, False, False, True], device=device)
    t["block_ids"] = torch.where(padding, -1, t["block_ids"]).to(torch.int32)
    k_before, v_before = t["k_cache"].clone(), t["v_cache"].clone()
    real = {key: t[key][~padding] for key in ("k", "v", "block_ids", "offsets", "positions")}
    if fused:
        q_out = torch.full_like(t["q"], float("nan"))
        _launch_fused(t, q_out)
        # every row's q is rotated, padding rows included
        _assert_rope_close(q_out, apply_rope(t["q"], t["positions"]))
        k_expected = apply_rope(real["k"], real["positions"])
        _assert_rope_close(_written(t["k_cache"], real), k_expected)
    else:
        launch_kv_append(*_kv_args(t))
        assert torch.equal(_written(t["k_cache"], real), real["k"])
    assert torch.equal(_written(t["v_cache"], real), real["v"])
    _untouched_equal(k_before, t["k_cache"], real)  # nothing else written
    _untouched_equal(v_before, t["v_cache"], real)


def _llama3_scaled(inv_freq: torch.Tensor) -> torch.Tensor:
    """A llama3-style table: low frequencies divided by 8, high ones kept, a smooth band between
    (what a transformers rotary module's ``inv_freq`` holds for such a model)."""
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((8192 / wavelen) - 1) / 3
    scaled = torch.where(wavelen > 8192, inv_freq / 8, inv_freq)
    band = (wavelen >= 2048) & (wavelen <= 8192)
    return torch.where(band, (1 - smooth) * inv_freq / 8 + smooth * inv_freq, scaled)


@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_inv_freq_equal_to_the_base_table_is_bit_identical(rotary_dim, device):
    t = _setup(3, 4, 2, 32, 5, 8, torch.bfloat16, device)
    table = rope_inv_freq(rotary_dim or 32, 500000.0, device)
    t2 = {**t, "k_cache": t["k_cache"].clone(), "v_cache": t["v_cache"].clone()}
    by_base = _fused_call(t, rotary_dim=rotary_dim, base=500000.0)
    by_table = _fused_call(t2, rotary_dim=rotary_dim, inv_freq=table)
    assert torch.equal(by_base, by_table)
    assert torch.equal(t["k_cache"], t2["k_cache"])
    ref = apply_rope(t["q"], t["positions"], rotary_dim, 500000.0)
    assert torch.equal(apply_rope_inv_freq(t["q"], t["positions"], table), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_inv_freq_matches_reference(dtype, device):
    t = _setup(4, 6, 2, 32, 6, 8, dtype, device)
    t["positions"] = torch.tensor([0, 7, 9000, 131000], device=device)
    table = _llama3_scaled(rope_inv_freq(32, 500000.0)).to(device)
    q_rot = _fused_call(t, inv_freq=table)
    _assert_rope_close(q_rot, apply_rope_inv_freq(t["q"], t["positions"], table))
    k_ref = apply_rope_inv_freq(t["k"], t["positions"], table)
    _assert_rope_close(_written(t["k_cache"], t), k_ref)
    assert not torch.equal(k_ref, apply_rope(t["k"], t["positions"], base=500000.0))
    # the trusted launcher takes the same table (here a strided view of a wider one)
    wide = torch.stack([table, table], 1).reshape(-1)
    q_out = torch.empty_like(t["q"])
    _launch_fused(t, q_out, wide[::2])
    assert torch.equal(q_out, q_rot)


def test_bad_inv_freq_is_rejected_before_writing(device):
    t = _setup(2, 4, 2, 16, 3, 8, torch.float32, device)
    k_before = t["k_cache"].clone()
    table = rope_inv_freq(16, device=device)
    bad = [
        ({"inv_freq": table[:4]}, ValueError, "inv_freq"),  # not [rotary_dim // 2]
        ({"inv_freq": table, "rotary_dim": 8}, ValueError, "inv_freq"),
        ({"inv_freq": table.double()}, TypeError, "inv_freq"),
        ({"inv_freq": table[None]}, ValueError, "inv_freq"),
        ({"inv_freq": [1.0] * 8}, TypeError, "inv_freq"),
        ({"inv_freq": table, "base": 500000.0}, ValueError, "base"),  # both: ambiguous
        ({"base": True}, TypeError, "base"),
        ({"base": "10000"}, TypeError, "base"),
        ({"base": float("inf")}, ValueError, "base"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            _fused_call(t, **kwargs)
        assert torch.equal(t["k_cache"], k_before), kwargs


@pytest.mark.gpu
def test_gpu_repeated_fast_launches_and_graph_capture():
    """The cached launch on new tensors each call, and inside a CUDA graph (padding rows too)."""
    dtype = torch.bfloat16
    for seed in range(3):
        t = _setup(64, 32, 8, 128, 256, 16, dtype, "cuda", seed=seed)
        q_rot = _fused_call(t, base=500000.0)
        _assert_rope_close(q_rot, apply_rope(t["q"], t["positions"], None, 500000.0))
        _assert_rope_close(
            _written(t["k_cache"], t), apply_rope(t["k"], t["positions"], None, 500000.0)
        )
    t = _setup(8, 32, 8, 128, 64, 16, dtype, "cuda", seed=7)
    t["block_ids"][3] = -1  # a padding row
    q_out = torch.empty_like(t["q"])

    def step():
        _launch_fused(t, q_out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    t["q"].normal_()
    t["positions"].add_(5)
    k_before = t["k_cache"].clone()
    graph.replay()
    torch.cuda.synchronize()
    _assert_rope_close(q_out, apply_rope(t["q"], t["positions"]))
    keep = torch.arange(8, device="cuda") != 3
    real = {key: t[key][keep] for key in ("k", "block_ids", "offsets", "positions")}
    _assert_rope_close(_written(t["k_cache"], real), apply_rope(real["k"], real["positions"]))
    _untouched_equal(k_before, t["k_cache"], real)


@pytest.mark.gpu
def test_gpu_public_append_reads_the_device_once_then_never():
    t = _setup(16, 32, 8, 128, 64, 16, torch.bfloat16, "cuda")
    _fused_call({**t, "block_ids": t["block_ids"].clone()})  # compile outside the count

    assert device_syncs(lambda: _fused_call(t)) == 1
    assert device_syncs(lambda: _fused_call(t)) == 0
    args = _kv_args(t)
    assert device_syncs(lambda: kv_append(*args)) == 1
    assert device_syncs(lambda: kv_append(*args)) == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_bound_append_saves_the_old_slot_bytes_first(kv_dtype, device):
    """With a backup, each stored slot's old K and V bytes land at row ``b * Hkv + h`` (V rows
    ``backup_v`` elements on) before the store; padding rows (block -1) save nothing."""
    from flashdec.kernels import BoundFusedRopeKVAppend

    gen = torch.Generator().manual_seed(0)
    batch, hq, hkv, d, blocks, bs = 3, 4, 2, 8, 5, 4
    q, k, v = (torch.randn(batch, h, d, generator=gen).to(device) for h in (hq, hkv, hkv))
    k_cache, v_cache = (
        torch.randn(blocks, hkv, bs, d, generator=gen).to(kv_dtype).to(device) for _ in range(2)
    )
    block_ids = torch.tensor([3, -1, 0], device=device)
    offsets = torch.tensor([1, 0, 2], device=device)
    positions = torch.tensor([13, 0, 2], device=device)
    old_k, old_v = k_cache.clone(), v_cache.clone()
    backup = torch.full((2, batch * hkv, d), 5.0, device=device).to(kv_dtype)
    scales = {}
    if kv_dtype == torch.float8_e4m3fn:
        ones = torch.ones(hkv, device=device)
        scales = {"k_scale": ones, "v_scale": ones}
    q_out = torch.empty_like(q)
    append = BoundFusedRopeKVAppend(
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_ids,
        offsets,
        positions,
        d,
        10000.0,
        q_out,
        backup=backup[0],
        backup_v=backup.stride(0),
        **scales,
    )
    append(q, k, v, k_cache, v_cache, q_out, backup[0])
    bits = torch.uint8 if kv_dtype == torch.float8_e4m3fn else torch.int32
    for b in range(batch):
        rows = slice(b * hkv, (b + 1) * hkv)
        if block_ids[b] < 0:
            assert torch.equal(backup[0, rows].float(), torch.full((hkv, d), 5.0))
            continue
        blk, off = int(block_ids[b]), int(offsets[b])
        assert torch.equal(backup[0, rows].view(bits), old_k[blk, :, off].view(bits))
        assert torch.equal(backup[1, rows].view(bits), old_v[blk, :, off].view(bits))
        assert not torch.equal(k_cache[blk, :, off].view(bits), old_k[blk, :, off].view(bits))
