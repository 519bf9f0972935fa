"""FP8 (e4m3) KV: decode over FP8 caches and the quantising writers, against the references."""

from __future__ import annotations

import pytest
import torch

from flashdec import paged_decode_attention_ref
from flashdec.kernels import (
    BoundDecode,
    BoundFusedRopeKVAppend,
    decode,
    fused_rope_kv_append,
    kv_append,
    launch_decode,
    launch_kv_append,
    plan_decode,
)
from flashdec.kernels import paged_decode as pd
from flashdec.kernels.decode_plan import (
    DEFAULT_FP8_COMPUTE,
    DEFAULT_FP8_STAGING,
    FP8_COMPUTE_CHOICES,
    FP8_STAGING_CHOICES,
    default_kernel_config,
)
from flashdec.reference import apply_rope, dequantize_fp8, quantize_fp8
from tests.helpers import TOLERANCES, make_paged_kv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float16, torch.bfloat16]
HEADS = [(4, 2), (8, 1), (2, 2), (6, 2)]


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[out.dtype]
    assert not torch.isnan(out).any(), "an output row was not written (NaN poison left)"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _scales(kind: str, num_kv_heads: int, device):
    """Per-head tensors (distinct per head) or plain floats; chosen so the random N(0, 1) data
    spans the e4m3 range without saturating."""
    if kind == "float":
        return 0.02, 0.015
    k = torch.linspace(0.01, 0.03, num_kv_heads, device=device)
    v = torch.linspace(0.02, 0.012, num_kv_heads, device=device)
    return k, v


def fp8_paged_kv(
    seq_lens, num_kv_heads, head_dim, block_size, device, k_scale, v_scale, kv_layout="token_major"
):
    """A random paged cache (permuted block ids) quantised to FP8 with the reference."""
    k, v, tables, lens, _, _ = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, torch.float32, device
    )

    def quant(x, scale):  # [N, Hkv, bs, D] -> heads second to last for the reference
        x = quantize_fp8(x.transpose(1, 2), scale).transpose(1, 2)
        return x.transpose(2, 3).contiguous() if kv_layout == "dim_major" else x

    return quant(k, k_scale), quant(v, v_scale), tables, lens


CASES = [
    (dtype, scales, mode)
    for dtype in DTYPES
    for scales in ("tensor", "float")
    for mode in ("eager", "single", "split", "window")
]


@pytest.mark.parametrize(("dtype", "scales", "mode"), CASES, ids=str)
def test_fp8_decode_matches_reference(dtype, scales, mode, device):
    case = CASES.index((dtype, scales, mode))
    num_q_heads, num_kv_heads = HEADS[case % len(HEADS)]
    block_size, head_dim = (8, 48) if case % 2 else (16, 32)  # head_dim 48: a padded tile
    seq_lens = [37, 0, 1, 130]
    k_scale, v_scale = _scales(scales, num_kv_heads, device)
    k, v, tables, lens = fp8_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, device, k_scale, v_scale
    )
    q = torch.randn(4, num_q_heads, head_dim, generator=torch.Generator().manual_seed(case))
    q = q.to(device=device, dtype=dtype)
    window = 45 if mode == "window" else None
    ref = paged_decode_attention_ref(
        q, k, v, tables, lens, window=window, k_scale=k_scale, v_scale=v_scale
    )
    out = torch.full_like(q, float("nan"))
    if mode in ("eager", "window"):
        decode(q, k, v, tables, lens, out=out, window=window, k_scale=k_scale, v_scale=v_scale)
    else:
        split = {"num_splits": 1} if mode == "single" else {"tokens_per_split": 16, "block_n": 16}
        plan = plan_decode(
            4,
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
            130,
            dtype,
            device,
            kv_dtype=FP8,
            **split,
        )
        assert plan.uses_split == (mode == "split")
        ws = plan.allocate_workspace()
        decode(q, k, v, tables, lens, out=out, workspace=ws, k_scale=k_scale, v_scale=v_scale)
    _assert_close(out, ref)


@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
def test_fp8_dim_major_and_dequantised_float_cache_agree(kv_layout, device):
    """The FP8 kernel equals the float kernel run on the dequantised cache (the same numbers)."""
    dtype = torch.float16
    k_scale, v_scale = _scales("tensor", 2, device)
    k, v, tables, lens = fp8_paged_kv(
        [77, 5, 0], 2, 32, 8, device, k_scale, v_scale, kv_layout=kv_layout
    )

    def deq(x, scale):  # back to token-major, dequantise, then the call's layout again
        x = x.transpose(2, 3) if kv_layout == "dim_major" else x
        x = dequantize_fp8(x.transpose(1, 2), scale).transpose(1, 2).to(dtype)
        return x.transpose(2, 3).contiguous() if kv_layout == "dim_major" else x

    k_deq, v_deq = deq(k, k_scale), deq(v, v_scale)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    got = decode(q, k, v, tables, lens, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)
    want = decode(q, k_deq, v_deq, tables, lens, kv_layout=kv_layout)
    _assert_close(got, want)


def test_fp8_trusted_and_bound_launches(device):
    """The engine's paths take the scales as device tensors (bound: fixed addresses)."""
    dtype = torch.bfloat16
    k_scale, v_scale = _scales("tensor", 2, device)
    k, v, tables, lens = fp8_paged_kv([90, 3, 50], 2, 32, 8, device, k_scale, v_scale)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    for split in ({"num_splits": 1}, {"tokens_per_split": 16, "block_n": 16}):
        plan = plan_decode(3, 4, 2, 32, 8, 90, dtype, device, kv_dtype=FP8, **split)
        assert plan.kv_dtype == FP8 and plan.cache_dtype == FP8
        ws = plan.allocate_workspace()
        assert ws.out.dtype == dtype
        out = torch.full_like(q, float("nan"))
        launch_decode(
            q,
            k,
            v,
            tables,
            lens,
            32**-0.5,
            plan,
            out,
            ws.partial_out,
            ws.partial_lse,
            3,
            k_scale,
            v_scale,
        )
        _assert_close(out, ref)
        bound = BoundDecode(
            q,
            k,
            v,
            tables,
            lens,
            32**-0.5,
            plan,
            ws.out,
            ws.partial_out,
            ws.partial_lse,
            3,
            k_scale,
            v_scale,
        )
        out.fill_(float("nan"))
        _assert_close(bound(q, k, v, out), ref)
        k_scale.mul_(2.0)  # new values in place: the bound launch reads them
        v_scale.mul_(0.5)
        out.fill_(float("nan"))
        bound(q, k, v, out)
        _assert_close(
            out, paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
        )
        k_scale.div_(2.0)
        v_scale.div_(0.5)


# --------------------------------------------------------------------------------------------
# kernel variants (DecodePlan.fp8_compute / fp8_staging, plan_decode(fp8_tile=))
# --------------------------------------------------------------------------------------------
VARIANTS = [
    {"fp8_compute": "f16"},
    {"fp8_compute": "q", "fp8_staging": "none"},
    {"fp8_compute": "f16", "fp8_staging": "kv", "fp8_tile": "bytes"},
]
VARIANT_CASES = [
    (dtype, scales, v)
    for dtype in DTYPES
    for scales in ("tensor", "float")
    for v in range(len(VARIANTS))
]


@pytest.mark.parametrize(("dtype", "scales", "variant"), VARIANT_CASES, ids=str)
def test_fp8_variants_match_reference(dtype, scales, variant, device):
    """Every variant, single pass and split, on a group of 3, a padded head_dim (40), ragged
    lengths and permuted blocks. (Staging is a GPU code-layout choice: the interpreter runs the
    same values without it; the GPU tests below cover it.)"""
    options = VARIANTS[variant]
    hq, hkv, d, bs = 6, 2, 40, 8
    k_scale, v_scale = _scales(scales, hkv, device)
    k, v, tables, lens = fp8_paged_kv([53, 1, 0, 130], hkv, d, bs, device, k_scale, v_scale)
    gen = torch.Generator().manual_seed(10 + variant)
    q = torch.randn(4, hq, d, generator=gen).to(device=device, dtype=dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    for split in ({"num_splits": 1}, {"num_splits": 3}):
        plan = plan_decode(4, hq, hkv, d, bs, 130, dtype, device, kv_dtype=FP8, **split, **options)
        assert plan.fp8_compute == options["fp8_compute"]
        assert plan.fp8_staging == options.get("fp8_staging", DEFAULT_FP8_STAGING)
        assert plan.uses_split == (split["num_splits"] > 1)
        out = torch.full_like(q, float("nan"))
        decode(
            q,
            k,
            v,
            tables,
            lens,
            out=out,
            workspace=plan.allocate_workspace(),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        _assert_close(out, ref)


def test_fp8_plan_options_and_their_defaults(device):
    plan = plan_decode(2, 8, 2, 128, 16, 4096, torch.bfloat16, device, kv_dtype=FP8)
    assert (plan.fp8_compute, plan.fp8_staging) == (DEFAULT_FP8_COMPUTE, DEFAULT_FP8_STAGING)
    float_plan = plan_decode(2, 8, 2, 128, 16, 4096, torch.bfloat16, device)
    assert float_plan.fp8_compute is None and float_plan.fp8_staging is None
    # fp8_tile="bytes": the tile of a bf16 cache in bytes, twice its tokens (up to 256)
    tokens = default_kernel_config(128, torch.bfloat16, kv_dtype=FP8, fp8_tile="tokens")
    as_bytes = default_kernel_config(128, torch.bfloat16, kv_dtype=FP8, fp8_tile="bytes")
    assert tokens == default_kernel_config(128, torch.bfloat16)
    assert as_bytes.block_n == 2 * tokens.block_n == 128
    assert default_kernel_config(64, torch.float16, kv_dtype=FP8, fp8_tile="bytes").block_n == 256
    assert default_kernel_config(128, torch.bfloat16, fp8_tile="bytes") == tokens  # float KV
    narrow, wide = (
        plan_decode(2, 8, 2, 128, 16, 4096, torch.bfloat16, device, kv_dtype=FP8, fp8_tile=t)
        for t in ("tokens", "bytes")
    )
    assert wide.block_n == 2 * narrow.block_n
    for compute in FP8_COMPUTE_CHOICES:
        for staging in FP8_STAGING_CHOICES:
            p = plan_decode(
                2,
                8,
                2,
                64,
                16,
                100,
                torch.float16,
                device,
                kv_dtype=FP8,
                fp8_compute=compute,
                fp8_staging=staging,
            )
            bits = pd._PlanConstants(p).decode[-4]  # before FUSED_MERGE, MERGE_G, MERGE_S
            assert bits & pd.FP8_ON and bool(bits & pd.FP8_F16) == (compute == "f16")
            if not pd.INTERPRET:
                assert bits & (pd.FP8_STAGE_K | pd.FP8_STAGE_V) == pd._STAGING_BITS[staging]
    assert set(pd._STAGING_BITS) == set(FP8_STAGING_CHOICES)
    assert pd._PlanConstants(float_plan).decode[-4] == 0


def test_fp8_plan_option_errors(device):
    args = (2, 8, 2, 64, 16, 100, torch.float16, device)
    for name in ("fp8_compute", "fp8_staging", "fp8_tile"):
        with pytest.raises(ValueError, match=f"{name} applies only to"):
            plan_decode(*args, **{name: "f16"})
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            plan_decode(*args, kv_dtype=FP8, **{name: "bf16"})
        with pytest.raises(TypeError, match=f"{name} must be a str"):
            plan_decode(*args, kv_dtype=FP8, **{name: 1})


def test_fp8_f16_folds_the_scale_before_rounding_q(device):
    """bf16 q far beyond fp16's range (1e5 > 65504) is fine with fp8_compute="f16": the logit
    factor (sm_scale * log2(e) * k_scale) is applied in float32 before q is rounded to fp16,
    so only the scaled q must fit (here about 25)."""
    dtype, hq, hkv, d, bs = torch.bfloat16, 4, 2, 32, 8
    k_scale, v_scale = 1e-3, 0.015
    k, v, tables, lens = fp8_paged_kv([37, 90], hkv, d, bs, device, 0.02, v_scale)
    q = (torch.randn(2, hq, d, generator=torch.Generator().manual_seed(4)) * 1e5).to(dtype)
    q = q.to(device)
    assert q.abs().max() > 65504
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    for compute in FP8_COMPUTE_CHOICES:
        plan = plan_decode(2, hq, hkv, d, bs, 90, dtype, device, kv_dtype=FP8, fp8_compute=compute)
        out = decode(
            q,
            k,
            v,
            tables,
            lens,
            workspace=plan.allocate_workspace(),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert torch.isfinite(out).all()
        _assert_close(out, ref)


# --------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------
def _slots(batch, num_blocks, block_size, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:batch]
    block_ids = (slots // block_size).to(device=device, dtype=torch.int32)
    offsets = (slots % block_size).to(device=device, dtype=torch.int64)
    return block_ids, offsets


def _written(cache, block_ids, offsets):
    """The slots' contents ``[B, Hkv, D]`` (gathered as bytes: FP8 indexing need not exist)."""
    return cache.view(torch.uint8)[block_ids.long(), :, offsets.long()].view(cache.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scales", ["tensor", "float"])
def test_kv_append_quantises_like_the_reference(dtype, scales, device):
    batch, hkv, d, blocks, bs = 5, 2, 24, 6, 4
    k_scale, v_scale = _scales(scales, hkv, device)
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(batch, hkv, d, generator=gen) * 3).to(device, dtype)
    v = (torch.randn(batch, hkv, d, generator=gen) * 3).to(device, dtype)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 9.0, -9.0], dtype=dtype)  # saturate at +-448
    k_cache = torch.zeros(blocks, hkv, bs, d, device=device).to(FP8)
    v_cache = torch.zeros(blocks, hkv, bs, d, device=device).to(FP8)
    block_ids, offsets = _slots(batch, blocks, bs, device)
    kv_append(k_cache, v_cache, k, v, block_ids, offsets, k_scale=k_scale, v_scale=v_scale)
    got_k = _written(k_cache, block_ids, offsets)
    assert torch.equal(got_k.view(torch.uint8), quantize_fp8(k, k_scale).view(torch.uint8))
    got_v = _written(v_cache, block_ids, offsets)
    assert torch.equal(got_v.view(torch.uint8), quantize_fp8(v, v_scale).view(torch.uint8))
    assert got_k[0, 0, 0].float() == 448.0 and got_k[0, 0, 1].float() == -448.0
    assert not torch.isnan(k_cache.float()).any()
    # the rest of the cache is untouched (zeros)
    assert int((k_cache.float() != 0).sum()) <= batch * hkv * d


def test_launch_kv_append_skips_padding_rows_in_fp8(device):
    k_scale, v_scale = _scales("tensor", 2, device)
    k = torch.randn(3, 2, 16).to(device, torch.float16)
    k_cache = torch.zeros(4, 2, 4, 16, device=device).to(FP8)
    v_cache = torch.zeros(4, 2, 4, 16, device=device).to(FP8)
    block_ids = torch.tensor([1, -1, 3], dtype=torch.int32, device=device)
    offsets = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    launch_kv_append(k_cache, v_cache, k, k, block_ids, offsets, k_scale, v_scale)
    assert torch.equal(k_cache[1, :, 0].float(), quantize_fp8(k[0], k_scale).float())
    assert torch.equal(v_cache[3, :, 3].float(), quantize_fp8(k[2], v_scale).float())
    assert int((k_cache.float() != 0).any(-1).sum()) == 4  # two rows x two heads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scales", ["tensor", "float"])
def test_fused_rope_append_quantises_rotated_k(dtype, scales, device):
    batch, hq, hkv, d, blocks, bs = 4, 6, 2, 32, 5, 8
    k_scale, v_scale = _scales(scales, hkv, device)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(batch, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    positions = torch.tensor([0, 7, 300, 4097], device=device)
    block_ids, offsets = _slots(batch, blocks, bs, device, seed=3)
    k_cache = torch.zeros(blocks, hkv, bs, d, device=device).to(FP8)
    v_cache = torch.zeros(blocks, hkv, bs, d, device=device).to(FP8)
    q_rot = fused_rope_kv_append(
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_ids,
        offsets,
        positions,
        24,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert q_rot.dtype == dtype
    # q: the same rotation as a float cache's fused call
    float_cache = torch.zeros(blocks, hkv, bs, d, device=device, dtype=dtype)
    q_float = fused_rope_kv_append(
        q, k, v, float_cache, float_cache.clone(), block_ids, offsets, positions, 24
    )
    assert torch.equal(q_rot, q_float)
    # v: bitwise the reference quantisation; k: of the float32 rotation (sin/cos may differ in
    # the last bit, so compare dequantised within one e4m3 step)
    got_v = _written(v_cache, block_ids, offsets)
    assert torch.equal(got_v.view(torch.uint8), quantize_fp8(v, v_scale).view(torch.uint8))
    want_k = apply_rope(k.float(), positions, 24)
    got_k = dequantize_fp8(_written(k_cache, block_ids, offsets), k_scale)
    per_head = k_scale[:, None] if isinstance(k_scale, torch.Tensor) else k_scale
    assert ((got_k - want_k).abs() <= want_k.abs() * 2**-3 + 2**-9 * per_head).all()
    exact = _written(k_cache, block_ids, offsets).view(torch.uint8)
    assert (exact == quantize_fp8(want_k, k_scale).view(torch.uint8)).float().mean() > 0.97


def test_bound_fused_append_with_fp8_scales(device):
    dtype = torch.float16
    k_scale, v_scale = _scales("tensor", 2, device)
    q = torch.randn(3, 4, 16).to(device, dtype)
    k = torch.randn(3, 2, 16).to(device, dtype)
    v = torch.randn(3, 2, 16).to(device, dtype)
    block_ids = torch.tensor([2, 0, -1], dtype=torch.int32, device=device)
    offsets = torch.tensor([1, 3, 0], dtype=torch.int32, device=device)
    positions = torch.tensor([5, 9, 1], device=device)
    k_cache = torch.zeros(3, 2, 4, 16, device=device).to(FP8)
    v_cache = torch.zeros(3, 2, 4, 16, device=device).to(FP8)
    q_out = torch.empty_like(q)
    bound = BoundFusedRopeKVAppend(
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_ids,
        offsets,
        positions,
        16,
        10000.0,
        q_out,
        None,
        k_scale,
        v_scale,
    )
    assert bound(q, k, v, k_cache, v_cache, q_out) is q_out
    assert torch.equal(v_cache[2, :, 1].float(), quantize_fp8(v[0], v_scale).float())
    assert torch.equal(v_cache[0, :, 3].float(), quantize_fp8(v[1], v_scale).float())
    assert int((v_cache.float() != 0).any(-1).sum()) == 4  # the padding row wrote nothing


def test_fp8_append_then_decode_end_to_end(device):
    """Write a whole context with the fused writer, decode it: equals the reference."""
    dtype, hq, hkv, d, bs = torch.bfloat16, 4, 2, 32, 8
    k_scale, v_scale = _scales("tensor", hkv, device)
    lens = [19, 6]
    blocks = 6
    k_cache = torch.zeros(blocks, hkv, bs, d, device=device).to(FP8)
    v_cache = torch.zeros(blocks, hkv, bs, d, device=device).to(FP8)
    tables = torch.tensor([[4, 1, 5], [0, 3, 2]], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(9)
    for pos in range(max(lens)):
        rows = [b for b, n in enumerate(lens) if pos < n]
        ids = torch.tensor([int(tables[b, pos // bs]) for b in rows], device=device)
        offs = torch.full((len(rows),), pos % bs, device=device)
        k = torch.randn(len(rows), hkv, d, generator=gen).to(device, dtype)
        v = torch.randn(len(rows), hkv, d, generator=gen).to(device, dtype)
        q = torch.randn(len(rows), hq, d, generator=gen).to(device, dtype)
        positions = torch.full((len(rows),), pos, device=device)
        fused_rope_kv_append(
            q, k, v, k_cache, v_cache, ids, offs, positions, k_scale=k_scale, v_scale=v_scale
        )
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(2, hq, d, generator=gen).to(device, dtype)
    got = decode(q, k_cache, v_cache, tables, seq_lens, k_scale=k_scale, v_scale=v_scale)
    _assert_close(
        got,
        paged_decode_attention_ref(
            q, k_cache, v_cache, tables, seq_lens, k_scale=k_scale, v_scale=v_scale
        ),
    )


# --------------------------------------------------------------------------------------------
# errors: nothing is written
# --------------------------------------------------------------------------------------------
class TestErrors:
    def _decode_inputs(self, device):
        k_scale, v_scale = _scales("tensor", 2, device)
        k, v, tables, lens = fp8_paged_kv([10, 20], 2, 16, 8, device, k_scale, v_scale)
        q = torch.randn(2, 4, 16).to(device, torch.float16)
        return q, k, v, tables, lens, k_scale, v_scale

    def test_decode_scale_rules_mutate_nothing(self, device):
        q, k, v, tables, lens, k_scale, v_scale = self._decode_inputs(device)
        out = torch.full_like(q, float("nan"))
        cases = [
            ({}, ValueError, "needs k_scale and v_scale"),
            ({"k_scale": k_scale}, ValueError, "v_scale missing"),
            ({"k_scale": -1.0, "v_scale": v_scale}, ValueError, "positive finite"),
            ({"k_scale": k_scale[:1], "v_scale": v_scale}, ValueError, "k_scale must have shape"),
            ({"k_scale": k_scale.double(), "v_scale": v_scale}, TypeError, "k_scale must have"),
            ({"k_scale": k_scale, "v_scale": None, "window": 0}, ValueError, "window"),
        ]
        for kwargs, error, match in cases:
            with pytest.raises(error, match=match):
                decode(q, k, v, tables, lens, out=out, **kwargs)
        with pytest.raises(TypeError, match="k_cache must have dtype"):
            decode(q.float(), k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
        float_k, float_v = k.to(torch.float16), v.to(torch.float16)
        with pytest.raises(ValueError, match="apply only to float8_e4m3fn caches"):
            decode(q, float_k, float_v, tables, lens, out=out, k_scale=1.0, v_scale=1.0)
        assert torch.isnan(out).all()

    def test_workspace_planned_for_another_cache_dtype(self, device):
        q, k, v, tables, lens, k_scale, v_scale = self._decode_inputs(device)
        ws = plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device).allocate_workspace()
        ws.out.fill_(float("nan"))
        with pytest.raises(TypeError, match=r"planned for a torch\.float16 cache"):
            decode(q, k, v, tables, lens, workspace=ws, k_scale=k_scale, v_scale=v_scale)
        fp8 = plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device, kv_dtype=FP8)
        with pytest.raises(TypeError, match=r"planned for a torch\.float8_e4m3fn cache"):
            decode(q, k.half(), v.half(), tables, lens, workspace=fp8.allocate_workspace())
        assert torch.isnan(ws.out).all()
        with pytest.raises(TypeError, match="kv_dtype must be"):
            plan_decode(2, 4, 2, 16, 8, 20, torch.float32, device, kv_dtype=FP8)
        with pytest.raises(TypeError, match="kv_dtype must be"):
            plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device, kv_dtype=torch.bfloat16)

    def test_writer_scale_rules_write_nothing(self, device):
        k_scale, v_scale = _scales("tensor", 2, device)
        k = torch.randn(2, 2, 16).to(device, torch.float16)
        q = torch.randn(2, 4, 16).to(device, torch.float16)
        k_cache = torch.zeros(3, 2, 4, 16, device=device).to(FP8)
        v_cache = torch.zeros(3, 2, 4, 16, device=device).to(FP8)
        ids = torch.tensor([0, 2], dtype=torch.int32, device=device)
        offs = torch.tensor([1, 1], dtype=torch.int32, device=device)
        pos = torch.tensor([3, 4], device=device)
        cases = [
            ({}, ValueError, "needs k_scale and v_scale"),
            ({"v_scale": v_scale}, ValueError, "k_scale missing"),
            ({"k_scale": k_scale, "v_scale": float("nan")}, ValueError, "positive finite"),
            ({"k_scale": k_scale, "v_scale": torch.ones(3, device=device)}, ValueError, "shape"),
        ]
        for kwargs, error, match in cases:
            with pytest.raises(error, match=match):
                kv_append(k_cache, v_cache, k, k, ids, offs, **kwargs)
            with pytest.raises(error, match=match):
                fused_rope_kv_append(q, k, k, k_cache, v_cache, ids, offs, pos, **kwargs)
        with pytest.raises(TypeError, match="k must have dtype"):
            kv_append(k_cache, v_cache, k.float(), k.float(), ids, offs, k_scale=1.0, v_scale=1.0)
        with pytest.raises(TypeError, match="q must have dtype"):
            fused_rope_kv_append(
                q.bfloat16(), k, k, k_cache, v_cache, ids, offs, pos, k_scale=1.0, v_scale=1.0
            )
        bad_ids = torch.tensor([0, 3], dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match="block_ids"):
            kv_append(k_cache, v_cache, k, k, bad_ids, offs, k_scale=1.0, v_scale=1.0)
        assert not k_cache.float().any() and not v_cache.float().any()
        float_cache = torch.zeros(3, 2, 4, 16, device=device, dtype=torch.float16)
        with pytest.raises(ValueError, match="apply only to float8_e4m3fn caches"):
            kv_append(float_cache, float_cache.clone(), k, k, ids, offs, k_scale=1.0)
        with pytest.raises(ValueError, match="apply only to float8_e4m3fn caches"):
            fused_rope_kv_append(
                q, k, k, float_cache, float_cache.clone(), ids, offs, pos, v_scale=v_scale
            )
        assert not float_cache.any()


# --------------------------------------------------------------------------------------------
# GPU only: native FP8 loads on Hopper, large shapes, graph capture, bitwise writers
# --------------------------------------------------------------------------------------------
GPU_SHAPES = [
    (32, 8, 128, 16, torch.bfloat16),
    (32, 1, 128, 16, torch.float16),
    (16, 8, 256, 32, torch.bfloat16),
    (28, 4, 64, 64, torch.float16),
    (32, 32, 128, 16, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "dtype"), GPU_SHAPES, ids=str)
def test_gpu_fp8_large_shapes(hq, hkv, d, page, dtype):
    seq_lens = [4000, 33000, 1, 9017]
    k_scale, v_scale = _scales("tensor", hkv, "cuda")
    k, v, tables, lens = fp8_paged_kv(seq_lens, hkv, d, page, "cuda", k_scale, v_scale)
    q = torch.randn(4, hq, d, generator=torch.Generator().manual_seed(0)).to("cuda", dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    _assert_close(decode(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale), ref)
    for kwargs in ({"num_splits": 1}, {"num_splits": 40}, {}):
        plan = plan_decode(4, hq, hkv, d, page, 33000, dtype, "cuda", kv_dtype=FP8, **kwargs)
        out = torch.full_like(q, float("nan"))
        decode(
            q,
            k,
            v,
            tables,
            lens,
            out=out,
            workspace=plan.allocate_workspace(),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        _assert_close(out, ref)
    windowed = decode(q, k, v, tables, lens, window=1000, k_scale=0.02, v_scale=0.015)
    _assert_close(
        windowed,
        paged_decode_attention_ref(q, k, v, tables, lens, window=1000, k_scale=0.02, v_scale=0.015),
    )


GPU_VARIANTS = [
    {"fp8_compute": c, "fp8_staging": s} for c in FP8_COMPUTE_CHOICES for s in FP8_STAGING_CHOICES
] + [{"fp8_staging": s, "fp8_tile": "bytes"} for s in FP8_STAGING_CHOICES]


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "dtype"), GPU_SHAPES[:3], ids=str)
@pytest.mark.parametrize("variant", range(len(GPU_VARIANTS)))
def test_gpu_fp8_variants(hq, hkv, d, page, dtype, variant):
    """Every compiled variant (compute dtype x staging x tile sizing) on ragged long contexts,
    single pass and split (windows: the default plan's, test_gpu_fp8_large_shapes)."""
    options = GPU_VARIANTS[variant]
    seq_lens = [3000, 17001, 1, 777]
    k_scale, v_scale = _scales("tensor", hkv, "cuda")
    k, v, tables, lens = fp8_paged_kv(seq_lens, hkv, d, page, "cuda", k_scale, v_scale)
    q = torch.randn(4, hq, d, generator=torch.Generator().manual_seed(variant)).to("cuda", dtype)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    for split in ({"num_splits": 1}, {}):
        plan = plan_decode(
            4, hq, hkv, d, page, 17001, dtype, "cuda", kv_dtype=FP8, **split, **options
        )
        out = torch.full_like(q, float("nan"))
        decode(
            q,
            k,
            v,
            tables,
            lens,
            out=out,
            workspace=plan.allocate_workspace(),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        _assert_close(out, ref)


@pytest.mark.gpu
def test_gpu_fp8_graph_capture_with_scale_tensors():
    dtype = torch.bfloat16
    k_scale, v_scale = _scales("tensor", 8, "cuda")
    k, v, tables, lens = fp8_paged_kv([5000, 100, 2048], 8, 128, 16, "cuda", k_scale, v_scale)
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    plan = plan_decode(
        3, 32, 8, 128, 16, 6000, dtype, "cuda", kv_dtype=FP8, max_blocks_per_seq=tables.shape[1]
    )
    ws = plan.allocate_workspace()
    decode(q, k, v, tables, lens, workspace=ws, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(q, k, v, tables, lens, workspace=ws, k_scale=k_scale, v_scale=v_scale)
    lens.copy_(torch.tensor([4999, 7, 2047], dtype=torch.int32))
    k_scale.mul_(1.5)  # new values, same addresses
    ws.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    _assert_close(ws.out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_fp8_writers_are_bitwise(dtype):
    batch, hq, hkv, d, blocks, bs = 64, 32, 8, 128, 80, 16
    k_scale, v_scale = _scales("tensor", hkv, "cuda")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(batch, h, d, generator=gen).to("cuda", dtype) * 4 for h in (hq, hkv, hkv)
    )
    block_ids, offsets = _slots(batch, blocks, bs, "cuda", seed=5)
    k_cache = torch.zeros(blocks, hkv, bs, d, device="cuda").to(FP8)
    v_cache = torch.zeros(blocks, hkv, bs, d, device="cuda").to(FP8)
    kv_append(k_cache, v_cache, k, v, block_ids, offsets, k_scale=k_scale, v_scale=v_scale)
    got = _written(k_cache, block_ids, offsets).view(torch.uint8)
    assert torch.equal(got, quantize_fp8(k, k_scale).view(torch.uint8))
    positions = torch.randint(0, 30000, (batch,), generator=gen).to("cuda")
    fused_rope_kv_append(
        q, k, v, k_cache, v_cache, block_ids, offsets, positions, k_scale=k_scale, v_scale=v_scale
    )
    got_v = _written(v_cache, block_ids, offsets).view(torch.uint8)
    assert torch.equal(got_v, quantize_fp8(v, v_scale).view(torch.uint8))
    want_k = quantize_fp8(apply_rope(k.float(), positions), k_scale).view(torch.uint8)
    same = (_written(k_cache, block_ids, offsets).view(torch.uint8) == want_k).float().mean()
    assert same > 0.999  # libdevice sin/cos vs torch's may differ in the last bit
