"""flashdec.extend against the independent reference (CPU: Triton interpreter; GPU: native).

Odd sizes everywhere: query lengths 1, 2, 3, 5, 17; contexts 0, 5, 54, 97; pages 8/16/32 with
permuted block ids; GQA groups 1, 2, 4, 7 and MQA; head_dim 32 and 48 (a padded tile). CI shapes
stay tiny (the interpreter runs each program's loop step in milliseconds); big shapes, bf16/fp16
natively, head_dim 256 and CUDA-graph capture are behind the ``gpu`` marker.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import flashdec
from flashdec import decode, paged_decode_attention_ref, paged_extend_attention_ref
from flashdec.kernels import (
    ExtendWorkspace,
    _runtime,
    extend,
    launch_extend,
    paged_extend_attention,
    plan_extend,
)
from flashdec.kernels import paged_extend as extend_module
from flashdec.kernels.extend_plan import (
    MAX_MERGE_ROWS,
    allocate_partials,
    extend_plan_variants,
    max_tiles,
)
from tests.helpers import TOLERANCES, device_syncs, make_paged_kv
from tests.kernels.test_fp8 import FP8, fp8_paged_kv

# the interpreter indexes with 0-d arrays (numpy deprecation), harmless here
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[out.dtype]
    assert not torch.isnan(out).any(), "an output row was not written (NaN poison left)"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _q(total, heads, dim, dtype, device, seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(total, heads, dim, generator=gen).to(device=device, dtype=dtype)


def _inputs(contexts, query_lens, hq, hkv, d, page, dtype, device, kv_layout="token_major", seed=0):
    """A paged cache holding ``context + query_len`` tokens per request, the new tokens'
    queries and int32 ``query_lens``."""
    seq_lens = [c + n for c, n in zip(contexts, query_lens, strict=True)]
    gen = torch.Generator().manual_seed(seed)
    k, v, tables, lens, _, _ = make_paged_kv(
        seq_lens, hkv, d, page, dtype, device, kv_layout=kv_layout, generator=gen
    )
    q = _q(sum(query_lens), hq, d, dtype, device, seed=seed + 1)
    qlens = torch.tensor(query_lens, dtype=torch.int32, device=device)
    return q, k, v, tables, lens, qlens


# (dtype, (Hq, Hkv), head_dim, page, contexts, query_lens, window, layout, plan overrides)
# plan overrides None: the eager call (its own plan, metadata checked on the device)
CASES = [
    (torch.float32, (2, 2), 32, 8, [0, 5, 97], [1, 3, 17], None, "token_major", None),
    (torch.float32, (8, 2), 32, 16, [54, 0], [3, 17], None, "token_major", {"block_m": 16}),
    (torch.float32, (14, 2), 32, 8, [97, 0, 54], [2, 5, 1], None, "token_major", {"num_splits": 3}),
    (torch.float32, (4, 1), 48, 32, [5, 54], [17, 3], None, "dim_major", None),
    (torch.float32, (4, 2), 32, 8, [97, 5], [5, 2], 1, "token_major", {"block_m": 16}),
    (torch.float32, (4, 2), 32, 8, [97, 54], [17, 3], 7, "token_major", {"num_splits": 4}),
    (torch.float32, (6, 2), 32, 16, [97, 0, 5], [3, 17, 1], 40, "dim_major", None),
    (torch.bfloat16, (8, 2), 32, 16, [54, 5], [17, 3], None, "token_major", None),
    (torch.bfloat16, (7, 1), 32, 8, [97, 0], [2, 5], 20, "token_major", {"num_splits": 2}),
    (torch.float16, (4, 2), 48, 8, [5, 97, 0], [1, 3, 2], None, "token_major", {"block_n": 16}),
    (torch.float32, (8, 2), 32, 8, [150, 3], [3, 2], None, "token_major", {"num_splits": 7}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_extend_matches_reference(case, device):
    dtype, (hq, hkv), d, page, contexts, qls, window, layout, overrides = CASES[case]
    q, k, v, tables, lens, qlens = _inputs(contexts, qls, hq, hkv, d, page, dtype, device, layout)
    ref = paged_extend_attention_ref(q, k, v, tables, lens, qlens, kv_layout=layout, window=window)
    out = _poisoned(q.shape, dtype, device)
    if overrides is None:
        got = extend(q, k, v, tables, lens, qlens, kv_layout=layout, window=window, out=out)
    else:
        plan = plan_extend(
            len(qls),
            sum(qls),
            hq,
            hkv,
            d,
            page,
            max(lens.tolist()),
            dtype,
            device,
            layout,
            window=window,
            **overrides,
        )
        if "num_splits" in overrides:
            assert plan.uses_split
        ws = plan.allocate_workspace()
        got = extend(
            q, k, v, tables, lens, qlens, kv_layout=layout, window=window, out=out, workspace=ws
        )
        if plan.uses_split:
            assert int(ws.counters.abs().sum()) == 0, "a launch must leave its counters at zero"
    assert got is out
    _assert_close(out, ref)


def test_one_new_token_each_is_decode(device):
    """query_lens of 1: the extend kernel equals decode and the decode reference."""
    dtype = torch.float32
    q, k, v, tables, lens, _ = _inputs([0, 5, 54], [1, 1, 1], 8, 2, 32, 8, dtype, device)
    ones = torch.ones(3, dtype=torch.int64, device=device)
    want = paged_decode_attention_ref(q, k, v, tables, lens)
    _assert_close(extend(q, k, v, tables, lens, ones), want)
    _assert_close(
        extend(q, k, v, tables, lens, ones, window=4), decode(q, k, v, tables, lens, window=4)
    )
    plan = plan_extend(3, 3, 8, 2, 32, 8, 55, dtype, device, num_splits=2, block_n=16)
    _assert_close(extend(q, k, v, tables, lens, ones, workspace=plan.allocate_workspace()), want)


def test_workspace_equals_the_plain_call(device):
    """A workspace planned as the eager call plans (lengths below 64 are not bucketed) gives
    bitwise the eager call's output; any other plan agrees within rounding."""
    dtype = torch.float32
    q, k, v, tables, lens, qlens = _inputs([54, 5], [3, 17], 8, 2, 32, 8, dtype, device)
    eager = extend(q, k, v, tables, lens, qlens)
    same = plan_extend(2, 20, 8, 2, 32, 8, 57, dtype, device, max_query_len=17)
    assert torch.equal(
        extend(q, k, v, tables, lens, qlens, workspace=same.allocate_workspace()), eager
    )
    other = plan_extend(2, 20, 8, 2, 32, 8, 57, dtype, device, block_m=16, num_splits=2)
    _assert_close(extend(q, k, v, tables, lens, qlens, workspace=other.allocate_workspace()), eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seven_splits_of_a_verification_tile_merge_to_the_reference(device, dtype):
    """Verification-sized tiles (16 rows of head_dim 128) cut 7 ways: rows whose position lies
    before a split's keys (lse -inf there) and rows that pad the tile still merge right."""
    contexts, qls = [0, 37, 100], [3, 1, 4]
    q, k, v, tables, lens, qlens = _inputs(contexts, qls, 4, 1, 128, 8, dtype, device, seed=7)
    plan = plan_extend(3, 8, 4, 1, 128, 8, 104, dtype, device, num_splits=7, block_m=16)
    ws = plan.allocate_workspace()
    got = extend(q, k, v, tables, lens, qlens, workspace=ws)
    _assert_close(got, paged_extend_attention_ref(q, k, v, tables, lens, qlens))
    assert int(ws.counters.abs().sum()) == 0


def test_workspace_serves_other_batches_of_its_bounds(device):
    """A plan bounds only the requests and rows: fewer of each, other query lengths and longer
    contexts than planned all run correctly on its workspace, one after another."""
    dtype = torch.float32
    plan = plan_extend(3, 12, 4, 2, 32, 8, 40, dtype, device, num_splits=2, block_m=16)
    ws = plan.allocate_workspace()
    for contexts, qls in (
        ([30, 0, 2], [2, 9, 1]),
        ([100, 3], [5, 7]),
        ([0], [6]),
        ([7, 90, 1], [1, 1, 1]),
    ):
        q, k, v, tables, lens, qlens = _inputs(
            contexts, qls, 4, 2, 32, 8, dtype, device, seed=len(qls)
        )
        got = extend(q, k, v, tables, lens, qlens, workspace=ws)
        assert got.data_ptr() == ws.out.data_ptr() and got.shape == q.shape
        _assert_close(got, paged_extend_attention_ref(q, k, v, tables, lens, qlens))
        assert int(ws.counters.abs().sum()) == 0


def test_trusted_launcher_and_strided_inputs(device):
    """launch_extend with a workspace's buffers; a layer of a 5-D cache, head-strided q and out,
    int64 and non-contiguous metadata."""
    dtype = torch.float16
    q0, k, v, tables, lens, qlens = _inputs([54, 0], [3, 5], 4, 2, 32, 8, dtype, device)
    ref = paged_extend_attention_ref(q0, k, v, tables, lens, qlens)
    plan = plan_extend(2, 8, 4, 2, 32, 8, 57, dtype, device, num_splits=2, block_n=16)
    ws = plan.allocate_workspace()
    out = launch_extend(
        q0,
        k,
        v,
        tables,
        lens,
        qlens,
        32**-0.5,
        plan,
        _poisoned(q0.shape, dtype, device),
        ws.partial_out,
        ws.partial_lse,
        ws.counters,
        2,
    )
    _assert_close(out, ref)

    k5 = torch.randn(3, *k.shape, device=device).to(dtype)
    v5 = torch.randn(3, *v.shape, device=device).to(dtype)
    k5[1], v5[1] = k, v
    q_big = torch.zeros(8, 6, 64, dtype=dtype, device=device)
    q_big[:, 1:5, 16:48] = q0
    q = q_big[:, 1:5, 16:48]
    wide = torch.full((2, tables.shape[1] * 2), 10**6, dtype=torch.int64, device=device)
    wide[:, ::2] = tables
    lens2 = torch.stack([lens.long(), lens.long()], 1)[:, 0]  # non-contiguous
    qlens2 = torch.stack([qlens.long(), qlens.long()], 1)[:, 1]
    assert not (q.is_contiguous() or lens2.is_contiguous() or qlens2.is_contiguous())
    out_t = _poisoned((4, 8, 32), dtype, device).transpose(0, 1)
    extend(q, k5[1], v5[1], wide[:, ::2], lens2, qlens2, out=out_t)
    _assert_close(out_t, ref)


@pytest.mark.parametrize("scales", ["tensor", "float"])
@pytest.mark.parametrize("mode", ["eager", "split", "window"])
def test_fp8_cache_matches_reference(scales, mode, device):
    dtype = torch.float16 if mode == "split" else torch.bfloat16
    hq, hkv, d, page = 8, 2, 32, 8
    k_scale, v_scale = (0.02, 0.015)
    if scales == "tensor":
        k_scale = torch.tensor([0.01, 0.03], device=device)
        v_scale = torch.tensor([0.02, 0.012], device=device)
    contexts, qls = [54, 0, 5], [3, 17, 1]
    seq_lens = [c + n for c, n in zip(contexts, qls, strict=True)]
    k, v, tables, lens = fp8_paged_kv(seq_lens, hkv, d, page, device, k_scale, v_scale)
    assert k.dtype == FP8
    q = _q(sum(qls), hq, d, dtype, device)
    qlens = torch.tensor(qls, device=device)
    window = 9 if mode == "window" else None
    scale_kw = {"k_scale": k_scale, "v_scale": v_scale}
    ref = paged_extend_attention_ref(q, k, v, tables, lens, qlens, window=window, **scale_kw)
    if mode == "split":
        plan = plan_extend(3, 21, hq, hkv, d, page, 57, dtype, device, kv_dtype=FP8, num_splits=3)
        got = extend(q, k, v, tables, lens, qlens, workspace=plan.allocate_workspace(), **scale_kw)
    else:
        got = extend(q, k, v, tables, lens, qlens, window=window, **scale_kw)
    _assert_close(got, ref)


def test_default_scale_alias_public_names_and_empty_batch(device):
    q, k, v, tables, lens, qlens = _inputs([5], [3], 2, 1, 16, 8, torch.float32, device)
    assert flashdec.extend is extend and flashdec.paged_extend_attention is extend
    assert paged_extend_attention is extend and extend_module.extend is extend
    assert flashdec.plan_extend is plan_extend and flashdec.ExtendWorkspace is ExtendWorkspace
    _assert_close(
        extend(q, k, v, tables, lens, qlens),
        paged_extend_attention_ref(q, k, v, tables, lens, qlens),
    )
    empty = torch.empty(0, dtype=torch.int32, device=device)
    q0 = torch.empty(0, 2, 16, device=device)
    assert extend(q0, k, v, tables[:0], empty, empty).shape == (0, 2, 16)


def test_metadata_read_once_then_cached(device, monkeypatch):
    """The eager call checks the metadata on the device once; unmodified tensors are not read
    again, an in-place edit of query_lens is."""
    calls = []
    real = extend_module.extend_metadata_stats
    monkeypatch.setattr(
        extend_module, "extend_metadata_stats", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v, tables, lens, qlens = _inputs([54, 5], [3, 2], 4, 2, 16, 8, torch.float32, device)
    extend(q, k, v, tables, lens, qlens)
    extend(q, k, v, tables, lens, qlens)
    assert len(calls) == 1
    qlens[0] = 4  # now sums to 6: q has 5 rows
    with pytest.raises(ValueError, match="sum"):
        extend(q, k, v, tables, lens, qlens)
    assert len(calls) == 2


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------
def test_plan_tiles_follow_the_queries_and_split_long_contexts():
    bf16 = torch.bfloat16
    # verification: 4 tokens x group 4 fill one 16-row tile; batch 1 over 32k is split wide
    verify = plan_extend(1, 4, 32, 8, 128, 16, 32768, bf16, "cpu", max_query_len=4)
    assert verify.block_m == 16 and verify.max_tiles == 1
    assert verify.num_splits >= 16 and verify.tokens_per_split % verify.block_n == 0
    # group 7 x 8 tokens = 56 rows: one 64-row tile per request
    assert plan_extend(64, 512, 28, 4, 128, 16, 4096, bf16, "cpu", max_query_len=8).block_m == 64
    # prompt chunks: the 128-row tile, no split when the tiles fill the GPU
    chunk = plan_extend(16, 16 * 2048, 32, 8, 128, 16, 2048, bf16, "cpu", max_query_len=2048)
    assert (chunk.block_m, chunk.num_splits) == (128, 1)
    assert 16 * 2048 * 4 // 128 <= chunk.max_tiles < 16 * 2048 * 4 // 128 + 16
    # head_dim 256 halves the tile
    assert plan_extend(1, 512, 16, 8, 256, 16, 512, bf16, "cpu").block_m == 64
    # a window bounds what a tile reads: no split over a 32k context with a 256 window
    windowed = plan_extend(1, 4, 32, 8, 128, 16, 32768, bf16, "cpu", window=256, max_query_len=4)
    assert windowed.num_splits < verify.num_splits
    # a tile's automatic splits stop at 1,024 partial rows (one program merges them)
    wide = plan_extend(1, 8, 28, 4, 128, 16, 32768, bf16, "cpu", max_query_len=8)
    assert wide.block_m == 64 and wide.num_splits * wide.block_m <= MAX_MERGE_ROWS
    assert wide.num_splits == MAX_MERGE_ROWS // 64


def test_max_tiles_bounds_every_split_of_the_rows():
    rng = random.Random(0)
    for _ in range(300):
        batch = rng.randint(1, 9)
        total = rng.randint(batch, 80)
        group, block_m = rng.choice([1, 2, 4, 7]), rng.choice([16, 32, 64, 128])
        cuts = sorted(rng.sample(range(1, total), batch - 1))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        tiles = sum(math.ceil(n * group / block_m) for n in lens)
        assert tiles <= max_tiles(batch, total, group, block_m)


def _kernel_key(plan) -> tuple:
    """What Triton compiles a launch of ``plan`` for (beside the model's fixed geometry)."""
    tiles = (plan.block_m, plan.block_n, plan.block_b)
    return (*tiles, plan.uses_split, plan.num_warps, plan.num_stages)


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "dtype", "kv_dtype", "window", "max_batch"),
    [
        (32, 8, 128, torch.bfloat16, None, None, 64),
        (28, 4, 128, torch.float16, None, 4096, 256),
        (16, 8, 256, torch.bfloat16, FP8, None, 16),
        (32, 1, 64, torch.float32, None, None, 1),
    ],
)
def test_plan_variants_cover_every_plan_the_planner_chooses(
    hq, hkv, d, dtype, kv_dtype, window, max_batch
):
    """A warm start launches each variant once: every layout of up to max_batch requests (a
    chunk, verification rows, decode rows beside a chunk; short and 32k contexts) must plan
    one of them, or a serving step would wait for a compile."""
    variants = extend_plan_variants(
        max_batch,
        hq,
        hkv,
        d,
        16,
        dtype,
        "cpu",
        max_blocks_per_seq=2048,
        window=window,
        kv_dtype=kv_dtype,
    )
    keys = {_kernel_key(p) for p in variants}
    assert len(keys) == len(variants)  # no duplicate launches
    rng = random.Random(0)
    for _ in range(400):
        batch = rng.randint(1, max_batch)
        queries = [rng.choice([1, 1, 2, 4, 8, 33, 512, 2048]) for _ in range(batch)]
        longest = max(queries) + rng.choice([0, 100, 4096, 32768])
        plan = plan_extend(
            batch,
            sum(queries),
            hq,
            hkv,
            d,
            16,
            longest,
            dtype,
            "cpu",
            max_blocks_per_seq=2048,
            max_query_len=max(queries),
            window=window,
            kv_dtype=kv_dtype,
        )
        assert _kernel_key(plan) in keys, (batch, queries, longest)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch": 0}, ValueError, "batch"),
        ({"total_q": 2}, ValueError, "total_q"),
        ({"num_q_heads": 6}, ValueError, "multiple"),
        ({"head_dim": 512}, ValueError, "head_dim"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
        ({"kv_dtype": torch.float16}, TypeError, "kv_dtype"),
        ({"block_m": 24}, ValueError, "block_m"),
        ({"block_n": 8}, ValueError, "block_n"),
        ({"num_warps": 3}, ValueError, "num_warps"),
        ({"tokens_per_split": 40, "block_n": 32}, ValueError, "multiple"),
        ({"window": 0}, ValueError, "window"),
        ({"kv_layout": "nhd"}, ValueError, "kv_layout"),
        ({"max_query_len": 0}, ValueError, "max_query_len"),
    ],
)
def test_plan_errors(kwargs, error, match):
    args = {
        "batch": 3,
        "total_q": 9,
        "num_q_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 64,
        "block_size": 16,
        "max_seq_len": 100,
        "dtype": torch.bfloat16,
        "device": "cpu",
    }
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in args}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        plan_extend(**args, **extra)
    with pytest.raises(TypeError, match="ExtendPlan"):
        ExtendWorkspace.allocate(object())


def test_single_pass_plan_has_no_partials():
    plan = plan_extend(2, 8, 4, 2, 32, 8, 40, torch.float32, "cpu", num_splits=1)
    assert not plan.uses_split and all(t.numel() == 0 for t in allocate_partials(plan))


# --------------------------------------------------------------------------------------------
# errors: each bad argument raises its type, and nothing is written
# --------------------------------------------------------------------------------------------
class TestErrors:
    def _inputs(self, device):
        return _inputs([6, 14], [3, 1], 4, 2, 16, 8, torch.float32, device)

    def _rejects(self, error, match, *args, **kwargs):
        out = torch.full((4, 4, 16), 7.0, device=args[0].device if args else "cpu")
        kwargs.setdefault("out", out)
        with pytest.raises(error, match=match):
            extend(*args, **kwargs)
        assert torch.all(out == 7.0), "a rejected call wrote its output"

    def test_bad_types_and_shapes(self, device):
        q, k, v, tables, lens, qlens = self._inputs(device)
        self._rejects(TypeError, "query_lens", q, k, v, tables, lens, qlens.float())
        self._rejects(TypeError, "query_lens", q, k, v, tables, lens, [3, 1])
        self._rejects(ValueError, "query_lens", q, k, v, tables, lens, qlens[None])
        self._rejects(ValueError, "one per request", q, k, v, tables, lens, qlens[:1])
        self._rejects(ValueError, "each >= 1", q[:1], k, v, tables, lens, qlens, out=None)
        self._rejects(TypeError, "dtype", q, k.double(), v, tables, lens, qlens)
        self._rejects(TypeError, "dtype", q, k, v, tables.float(), lens, qlens)
        self._rejects(ValueError, "4-D", q, k[0], v, tables, lens, qlens)
        self._rejects(ValueError, "multiple", q[:, :3], k, v, tables, lens, qlens, out=None)
        self._rejects(ValueError, "kv_layout", q, k, v, tables, lens, qlens, kv_layout="nhd")
        self._rejects(ValueError, "sm_scale", q, k, v, tables, lens, qlens, sm_scale=-1.0)
        self._rejects(TypeError, "sm_scale", q, k, v, tables, lens, qlens, sm_scale="0.5")
        self._rejects(ValueError, "window", q, k, v, tables, lens, qlens, window=0)
        self._rejects(ValueError, "k_scale", q, k, v, tables, lens, qlens, k_scale=1.0)
        self._rejects(TypeError, "workspace", q, k, v, tables, lens, qlens, workspace=object())
        with pytest.raises(ValueError, match="out"):
            extend(q, k, v, tables, lens, qlens, out=torch.empty(3, 4, 16, device=device))
        with pytest.raises(TypeError, match="out"):
            extend(q, k, v, tables, lens, qlens, out=torch.empty(4, 4, 16, device=device).half())

    @pytest.mark.parametrize(
        ("qls", "match"),
        [
            ([4, 0], ">= 1"),
            ([0, 4], ">= 1"),
            ([10, 1], "seq_len"),
            ([2, 1], "sum"),
            ([3, 2], "sum"),
        ],
    )
    def test_bad_query_lens_values(self, qls, match, device):
        q, k, v, tables, lens, _ = self._inputs(device)
        qlens = torch.tensor(qls, dtype=torch.int32, device=device)
        self._rejects(ValueError, match, q, k, v, tables, lens, qlens)

    def test_bad_metadata_values(self, device):
        q, k, v, tables, lens, qlens = self._inputs(device)
        bad = tables.clone()
        bad[1, 0] = k.shape[0]
        self._rejects(ValueError, "block id", q, k, v, bad, lens, qlens)
        self._rejects(ValueError, "seq_lens", q, k, v, tables, lens + 100, qlens)
        # with a window, a table entry the first new token's window reads is still checked
        windowed = tables.clone()
        windowed[0, 0] = -1  # positions 0..7 of request 0: its first new token (3) reads them
        self._rejects(ValueError, "block id", q, k, v, windowed, lens, qlens, window=4)

    def test_workspace_mismatch(self, device):
        q, k, v, tables, lens, qlens = self._inputs(device)

        def ws(**kw):
            args = {"batch": 2, "total_q": 4, "num_q_heads": 4, "num_kv_heads": 2}
            args |= {"head_dim": 16, "block_size": 8, "max_seq_len": 14}
            args |= {"dtype": torch.float32, "device": device}
            return plan_extend(**(args | kw)).allocate_workspace()

        self._rejects(
            ValueError, "batch", q, k, v, tables, lens, qlens, workspace=ws(batch=1, total_q=3)
        )
        self._rejects(ValueError, "total_q", q, k, v, tables, lens, qlens, workspace=ws(total_q=3))
        self._rejects(
            ValueError, "num_q_heads", q, k, v, tables, lens, qlens, workspace=ws(num_q_heads=8)
        )
        self._rejects(
            TypeError, "dtype", q, k, v, tables, lens, qlens, workspace=ws(dtype=torch.float16)
        )
        self._rejects(ValueError, "window", q, k, v, tables, lens, qlens, workspace=ws(window=4))

    def test_cpu_tensors_without_interpreter(self, monkeypatch):
        monkeypatch.setattr(_runtime, "INTERPRET", False)
        q, k, v, tables, lens, qlens = _inputs([4], [2], 2, 1, 16, 8, torch.float32, "cpu")
        with pytest.raises(TypeError, match="CUDA"):
            extend(q, k, v, tables, lens, qlens)


# --------------------------------------------------------------------------------------------
# GPU only: large shapes, fp16/bf16 natively, head_dim 256, graph capture
# --------------------------------------------------------------------------------------------
LARGE_HEADS = [
    (32, 8, 128, 16, torch.bfloat16),
    (28, 4, 128, 16, torch.bfloat16),
    (32, 1, 128, 32, torch.float16),
    (16, 8, 256, 16, torch.bfloat16),
    (8, 8, 64, 8, torch.float16),
]
# (contexts, query_lens): prompt chunks over contexts, verification steps, a mixed step
LARGE_BATCHES = [
    ([0, 1000, 3000], [512, 300, 77]),
    ([4096, 33, 9000, 1], [4, 8, 2, 5]),
    ([2500, 0, 700, 5000, 12], [1, 256, 1, 7, 1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "dtype"), LARGE_HEADS, ids=str)
@pytest.mark.parametrize("batch", range(len(LARGE_BATCHES)))
def test_gpu_large_shapes(hq, hkv, d, page, dtype, batch):
    contexts, qls = LARGE_BATCHES[batch]
    q, k, v, tables, lens, qlens = _inputs(contexts, qls, hq, hkv, d, page, dtype, "cuda")
    ref = paged_extend_attention_ref(q, k, v, tables, lens, qlens)
    out = _poisoned(q.shape, dtype, "cuda")
    extend(q, k, v, tables, lens, qlens, out=out)  # the heuristic plan
    _assert_close(out, ref)
    for kw in ({"num_splits": 1}, {"num_splits": 7}, {"block_m": 16}):
        plan = plan_extend(
            len(qls), sum(qls), hq, hkv, d, page, max(lens.tolist()), dtype, "cuda", **kw
        )
        out.fill_(float("nan"))
        extend(q, k, v, tables, lens, qlens, out=out, workspace=plan.allocate_workspace())
        _assert_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 1000])
def test_gpu_window_fp8_and_dim_major(window):
    contexts, qls = [3000, 0, 40], [64, 200, 3]
    q, k, v, tables, lens, qlens = _inputs(contexts, qls, 32, 8, 128, 16, torch.bfloat16, "cuda")
    ref = paged_extend_attention_ref(q, k, v, tables, lens, qlens, window=window)
    _assert_close(extend(q, k, v, tables, lens, qlens, window=window), ref)
    kd, vd = k.transpose(2, 3).contiguous(), v.transpose(2, 3).contiguous()
    _assert_close(extend(q, kd, vd, tables, lens, qlens, kv_layout="dim_major", window=window), ref)
    seq_lens = [c + n for c, n in zip(contexts, qls, strict=True)]
    ks, vs = torch.full((8,), 0.02, device="cuda"), torch.full((8,), 0.015, device="cuda")
    k8, v8, t8, l8 = fp8_paged_kv(seq_lens, 8, 128, 16, "cuda", ks, vs)
    ref8 = paged_extend_attention_ref(
        q, k8, v8, t8, l8, qlens, window=window, k_scale=ks, v_scale=vs
    )
    _assert_close(extend(q, k8, v8, t8, l8, qlens, window=window, k_scale=ks, v_scale=vs), ref8)


@pytest.mark.gpu
def test_gpu_fp32_is_exact_enough():
    """fp32 runs its dots in IEEE precision (not tf32)."""
    q, k, v, tables, lens, qlens = _inputs(
        [2000, 5], [33, 100], 8, 2, 128, 16, torch.float32, "cuda"
    )
    out = extend(q, k, v, tables, lens, qlens)
    ref = paged_extend_attention_ref(q, k, v, tables, lens, qlens)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 6])
def test_gpu_cuda_graph_capture_and_replay(splits):
    """The workspace path is captured once and replayed with new lengths and query lengths
    (same total rows); no host sync inside, counters left at zero."""
    dtype = torch.bfloat16
    q, k, v, tables, lens, qlens = _inputs(
        [5000, 100, 2048], [4, 8, 4], 32, 8, 128, 16, dtype, "cuda"
    )
    plan = plan_extend(
        3,
        16,
        32,
        8,
        128,
        16,
        6000,
        dtype,
        "cuda",
        max_blocks_per_seq=tables.shape[1],
        num_splits=splits,
    )
    ws = plan.allocate_workspace()
    extend(q, k, v, tables, lens, qlens, workspace=ws)  # compile outside the capture
    torch.cuda.synchronize()
    assert device_syncs(lambda: extend(q, k, v, tables, lens, qlens, workspace=ws)) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        extend(q, k, v, tables, lens, qlens, workspace=ws)
    for new_lens, new_qlens in (([5000, 100, 2048], [4, 8, 4]), ([4990, 9, 2000], [1, 9, 6])):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        qlens.copy_(torch.tensor(new_qlens, dtype=torch.int32))
        ws.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(ws.out, paged_extend_attention_ref(q, k, v, tables, lens, qlens))
        assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_eager_reads_the_device_once_then_never():
    dtype = torch.bfloat16
    q, k, v, tables, lens, qlens = _inputs(
        [700, 33, 4096], [17, 2, 64], 32, 8, 128, 16, dtype, "cuda"
    )
    extend(q, k, v, tables.clone(), lens.clone(), qlens.clone())  # compile outside the count
    torch.cuda.synchronize()
    assert device_syncs(lambda: extend(q, k, v, tables, lens, qlens)) == 1  # the one small read
    assert device_syncs(lambda: extend(q, k, v, tables, lens, qlens)) == 0  # validated
    _assert_close(
        extend(q, k, v, tables, lens, qlens),
        paged_extend_attention_ref(q, k, v, tables, lens, qlens),
    )
