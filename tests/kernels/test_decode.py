"""flashdec.decode against the independent references (CPU: Triton interpreter; GPU: native)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashdec
from flashdec import dense_decode_attention_ref, paged_decode_attention_ref
from flashdec.kernels import DecodeWorkspace, _runtime, decode, paged_decode_attention, plan_decode
from tests.helpers import TOLERANCES, device_syncs, make_paged_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_q_heads, num_kv_heads): MHA, GQA 2, odd GQA 3, MQA 8, MQA 32 (a 32-row tile)
HEADS = [(2, 2), (4, 2), (6, 2), (8, 1), (32, 1)]

# the interpreter indexes with 0-d arrays (numpy deprecation), harmless here
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[out.dtype]
    assert not torch.isnan(out).any(), "an output row was not written (NaN poison left)"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _q(batch, num_q_heads, head_dim, dtype, device, seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_both_references(dtype, kv_layout, block_size, device):
    case = DTYPES.index(dtype) * 6 + ["token_major", "dim_major"].index(kv_layout) * 3
    case += [8, 16, 32].index(block_size)
    num_q_heads, num_kv_heads = HEADS[case % len(HEADS)]
    seq_lens = [37, 0, 1, 130][: 2 + case % 3]
    head_dim = 32 if case % 2 else 64
    k, v, tables, lens, k_dense, v_dense = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, kv_layout=kv_layout
    )
    q = _q(len(seq_lens), num_q_heads, head_dim, dtype, device)
    out = _poisoned(q.shape, dtype, device)
    got = decode(q, k, v, tables, lens, kv_layout=kv_layout, block_size=block_size, out=out)
    assert got is out
    _assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens, kv_layout=kv_layout))
    _assert_close(out, dense_decode_attention_ref(q, k_dense, v_dense, lens))


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), HEADS, ids=lambda x: str(x))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gqa_ratios_split_and_single_pass(num_q_heads, num_kv_heads, num_splits, device):
    dtype = torch.float16
    seq_lens = [71, 3, 0]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, num_kv_heads, 32, 8, dtype, device)
    q = _q(3, num_q_heads, 32, dtype, device)
    plan = plan_decode(
        3, num_q_heads, num_kv_heads, 32, 8, 71, dtype, device, block_n=16, num_splits=num_splits
    )
    assert plan.num_splits == num_splits
    ws = DecodeWorkspace.allocate(plan)
    ws.out.fill_(float("nan"))
    got = decode(q, k, v, tables, lens, workspace=ws)
    assert got.data_ptr() == ws.out.data_ptr()
    _assert_close(got, paged_decode_attention_ref(q, k, v, tables, lens))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
def test_forced_split_matches_single_pass(dtype, kv_layout, device):
    seq_lens = [200, 17, 64, 0]
    k, v, tables, lens, _, _ = make_paged_kv(
        seq_lens, 2, 64, 16, dtype, device, kv_layout=kv_layout
    )
    q = _q(4, 4, 64, dtype, device)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, kv_layout=kv_layout)
    for kwargs in ({"num_splits": 1}, {"tokens_per_split": 32, "block_n": 32}):
        plan = plan_decode(4, 4, 2, 64, 16, 200, dtype, device, kv_layout, **kwargs)
        assert plan.uses_split == ("tokens_per_split" in kwargs)
        out = _poisoned(q.shape, dtype, device)
        decode(
            q, k, v, tables, lens, kv_layout=kv_layout, out=out, workspace=plan.allocate_workspace()
        )
        _assert_close(out, ref)


def test_workspace_serves_smaller_batch_and_longer_sequences(device):
    """The plan bounds nothing that matters for correctness: its last split takes the rest."""
    dtype = torch.float16
    plan = plan_decode(4, 4, 1, 32, 8, 40, dtype, device, block_n=16, tokens_per_split=16)
    assert plan.num_splits == 3
    ws = plan.allocate_workspace()
    seq_lens = [150, 9, 40]  # 150 > planned 40: split 2 covers tokens 32..150
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 1, 32, 8, dtype, device)
    q = _q(3, 4, 32, dtype, device)
    out = _poisoned(q.shape, dtype, device)
    decode(q, k, v, tables, lens, out=out, workspace=ws)
    _assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens))
    got = decode(q, k, v, tables, lens, workspace=ws)  # default output: a view of ws.out
    assert got.data_ptr() == ws.out.data_ptr()
    _assert_close(got, out)


def test_split_programs_loop_over_several_work_items(device):
    """Fewer programs than (split, KV head) items: each program takes items round-robin."""
    dtype = torch.float16
    seq_lens = [100, 0, 33, 64, 1]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 2, 32, 16, dtype, device)
    q = _q(5, 4, 32, dtype, device)
    plan = plan_decode(5, 4, 2, 32, 16, 100, dtype, device, block_n=16, tokens_per_split=32)
    plan = dataclasses.replace(plan, num_programs=3)
    out = _poisoned(q.shape, dtype, device)
    decode(q, k, v, tables, lens, out=out, workspace=plan.allocate_workspace())
    _assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens))


def test_merge_of_many_splits(device):
    """More splits than one merge chunk (32): the running-max merge rescales across chunks."""
    dtype = torch.float32
    seq_lens = [600, 5, 0]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 1, 16, 8, dtype, device)
    q = _q(3, 2, 16, dtype, device) * 3.0  # peaky softmax: the split maxima differ a lot
    plan = plan_decode(3, 2, 1, 16, 8, 600, dtype, device, block_n=16, tokens_per_split=16)
    assert plan.num_splits == 38
    out = _poisoned(q.shape, dtype, device)
    decode(q, k, v, tables, lens, out=out, workspace=plan.allocate_workspace())
    _assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens))


def test_heuristic_splits_long_small_batch(device):
    dtype = torch.bfloat16
    k, v, tables, lens, _, _ = make_paged_kv([300, 5], 1, 16, 32, dtype, device)
    q = _q(2, 2, 16, dtype, device)
    plan = plan_decode(2, 2, 1, 16, 32, 300, dtype, device, min_tokens_per_split=64)
    assert plan.num_splits > 1
    out = _poisoned(q.shape, dtype, device)
    decode(q, k, v, tables, lens, sm_scale=0.3, out=out, workspace=plan.allocate_workspace())
    _assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens, sm_scale=0.3))


def test_strided_caches_layer_view_and_slices(device):
    """A layer of a 5-D cache, a head-strided view and a non-contiguous q."""
    dtype = torch.float16
    seq_lens = [45, 12]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 2, 32, 8, dtype, device, extra_blocks=1)
    k5 = torch.randn(3, *k.shape, dtype=dtype, device=device)
    v5 = torch.randn(3, *v.shape, dtype=dtype, device=device)
    k5[1], v5[1] = k, v
    q_big = _q(2, 6, 64, dtype, device)
    q = q_big[:, :4, 16:48]  # strided heads and dims
    assert not q.is_contiguous()
    ref = paged_decode_attention_ref(q.contiguous(), k, v, tables, lens)
    out = _poisoned(q.shape, dtype, device)
    decode(q, k5[1], v5[1], tables, lens, out=out)
    _assert_close(out, ref)
    # every other KV head of a wider cache, and a table with extra columns
    kw = torch.randn(k.shape[0], 4, *k.shape[2:], dtype=dtype, device=device)
    vw = torch.randn_like(kw)
    kw[:, ::2], vw[:, ::2] = k, v
    wide_tables = torch.full((2, tables.shape[1] + 3), 999, dtype=torch.int64, device=device)
    wide_tables[:, : tables.shape[1]] = tables
    out_t = _poisoned((4, 2, 32), dtype, device).transpose(0, 1)  # strided out [2, 4, 32]
    decode(q, kw[:, ::2], vw[:, ::2], wide_tables, lens.long(), out=out_t)
    _assert_close(out_t, ref)


def test_default_scale_alias_and_public_name(device):
    import flashdec.kernels.paged_decode as module

    k, v, tables, lens, _, _ = make_paged_kv([20], 1, 16, 8, torch.float32, device)
    q = _q(1, 3, 16, torch.float32, device)
    assert flashdec.decode is decode and paged_decode_attention is decode
    assert flashdec.kernels.decode is decode and module.decode is decode  # no shadowed module
    _assert_close(decode(q, k, v, tables, lens), paged_decode_attention_ref(q, k, v, tables, lens))


def test_empty_batch(device):
    k, v, _, _, _, _ = make_paged_kv([4], 1, 16, 8, torch.float16, device)
    q = torch.empty(0, 2, 16, dtype=torch.float16, device=device)
    tables = torch.empty(0, 1, dtype=torch.int32, device=device)
    lens = torch.empty(0, dtype=torch.int32, device=device)
    assert decode(q, k, v, tables, lens).shape == (0, 2, 16)


class TestErrors:
    def _inputs(self, device):
        k, v, tables, lens, _, _ = make_paged_kv([10, 20], 2, 16, 8, torch.float16, device)
        return _q(2, 4, 16, torch.float16, device), k, v, tables, lens

    def test_bad_shapes_and_types(self, device):
        q, k, v, tables, lens = self._inputs(device)
        with pytest.raises(ValueError, match="4-D"):
            decode(q, k[0], v, tables, lens)
        with pytest.raises(TypeError, match="dtype"):
            decode(q, k.float(), v, tables, lens)
        with pytest.raises(TypeError, match="dtype"):
            decode(q, k, v, tables.float(), lens)
        with pytest.raises(ValueError, match="multiple"):
            decode(q[:, :3], k, v, tables, lens)
        with pytest.raises(ValueError, match="block_size"):
            decode(q, k, v, tables, lens, block_size=16)
        with pytest.raises(ValueError, match="kv_layout"):
            decode(q, k, v, tables, lens, kv_layout="nhd")
        with pytest.raises(ValueError, match="sm_scale"):
            decode(q, k, v, tables, lens, sm_scale=-1.0)
        with pytest.raises(ValueError, match="out"):
            decode(q, k, v, tables, lens, out=torch.empty_like(q)[:1])
        with pytest.raises(TypeError, match="workspace"):
            decode(q, k, v, tables, lens, workspace=object())

    def test_bad_values(self, device):
        q, k, v, tables, lens = self._inputs(device)
        bad = tables.clone()
        bad[1, 0] = k.shape[0]
        with pytest.raises(ValueError, match="block id"):
            decode(q, k, v, bad, lens)
        with pytest.raises(ValueError, match="seq_lens"):
            decode(q, k, v, tables, lens + 100)

    def test_workspace_mismatch(self, device):
        q, k, v, tables, lens = self._inputs(device)
        ws = plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device).allocate_workspace()
        with pytest.raises(ValueError, match="batch"):
            decode(
                torch.cat([q, q]),
                k,
                v,
                torch.cat([tables, tables]),
                torch.cat([lens, lens]),
                workspace=ws,
            )
        other = plan_decode(2, 8, 2, 16, 8, 20, torch.float16, device).allocate_workspace()
        with pytest.raises(ValueError, match="num_q_heads"):
            decode(q, k, v, tables, lens, workspace=other)
        fp32 = plan_decode(2, 4, 2, 16, 8, 20, torch.float32, device).allocate_workspace()
        with pytest.raises(TypeError, match="dtype"):
            decode(q, k, v, tables, lens, workspace=fp32)

    def test_cpu_tensors_without_interpreter(self, monkeypatch):
        monkeypatch.setattr(_runtime, "INTERPRET", False)
        k, v, tables, lens, _, _ = make_paged_kv([4], 1, 16, 8, torch.float16, "cpu")
        q = _q(1, 1, 16, torch.float16, "cpu")
        with pytest.raises(TypeError, match="CUDA"):
            decode(q, k, v, tables, lens)


# --------------------------------------------------------------------------------------------
# GPU only: large shapes, the heuristic's own choices, graph capture
# --------------------------------------------------------------------------------------------
LARGE = [
    (32, 8, 128, 16, torch.bfloat16),
    (32, 1, 128, 16, torch.float16),
    (32, 32, 128, 32, torch.bfloat16),
    (32, 8, 64, 32, torch.float16),
    (16, 4, 256, 16, torch.bfloat16),
    (64, 8, 128, 8, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "dtype"), LARGE, ids=str)
def test_gpu_large_shapes(hq, hkv, d, page, dtype):
    seq_lens = [4000, 33000, 1, 9017]
    k, v, tables, lens, kd, vd = make_paged_kv(seq_lens, hkv, d, page, dtype, "cuda")
    q = _q(4, hq, d, dtype, "cuda")
    ref = dense_decode_attention_ref(q, kd, vd, lens)
    out = _poisoned(q.shape, dtype, "cuda")
    decode(q, k, v, tables, lens, out=out)  # heuristic plan
    _assert_close(out, ref)
    for kwargs in ({"num_splits": 1}, {"num_splits": 40}):
        plan = plan_decode(4, hq, hkv, d, page, 33000, dtype, "cuda", **kwargs)
        out.fill_(float("nan"))
        decode(q, k, v, tables, lens, out=out, workspace=plan.allocate_workspace())
        _assert_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_dim_major_and_fp32(dtype):
    seq_lens = [3000, 17, 0, 1025]
    k, v, tables, lens, kd, vd = make_paged_kv(seq_lens, 2, 128, 16, dtype, "cuda")
    q = _q(4, 8, 128, dtype, "cuda")
    ref = dense_decode_attention_ref(q, kd, vd, lens)
    out = decode(
        q,
        k.transpose(2, 3).contiguous(),
        v.transpose(2, 3).contiguous(),
        tables,
        lens,
        kv_layout="dim_major",
    )
    _assert_close(out, ref)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    dtype = torch.bfloat16
    seq_lens = [5000, 100, 2048]
    k, v, tables, lens, kd, vd = make_paged_kv(seq_lens, 8, 128, 16, dtype, "cuda")
    q = _q(3, 32, 128, dtype, "cuda")
    plan = plan_decode(3, 32, 8, 128, 16, 6000, dtype, "cuda", max_blocks_per_seq=tables.shape[1])
    assert plan.uses_split
    ws = plan.allocate_workspace()
    decode(q, k, v, tables, lens, workspace=ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(q, k, v, tables, lens, workspace=ws)
    lens.copy_(torch.tensor([4999, 7, 2047], dtype=torch.int32))  # new lengths, same graph
    ws.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(ws.out, dense_decode_attention_ref(q, kd, vd, lens))


@pytest.mark.gpu
def test_gpu_repeated_calls_take_the_cached_launch_and_stay_correct():
    from flashdec.kernels import paged_decode

    dtype = torch.float16
    seq_lens = [3000, 1, 777]
    k, v, tables, lens, kd, vd = make_paged_kv(seq_lens, 4, 128, 16, dtype, "cuda")
    for splits in (1, 5):
        plan = plan_decode(3, 16, 4, 128, 16, 3000, dtype, "cuda", num_splits=splits)
        ws = plan.allocate_workspace()
        for seed in range(4):
            # new q and out tensors each call (new pointers, passed as ints) and the workspace's
            # own buffers: the cached launch must see every one of them
            q = _q(3, 16, 128, dtype, "cuda", seed=seed + 2)
            out = _poisoned(q.shape, dtype, "cuda")
            ws.out.fill_(float("nan"))
            decode(q, k, v, tables, lens, out=out, workspace=ws)
            _assert_close(out, dense_decode_attention_ref(q, kd, vd, lens))
            _assert_close(decode(q, k, v, tables, lens, workspace=ws), out)
            _assert_close(decode(q, k, v, tables, lens), out)  # eager, no workspace
            counts = (len(paged_decode._DECODE._by_class), len(paged_decode._MERGE._by_class))
            if seed == 0:
                compiled = counts  # everything is compiled by the first round
        assert counts == compiled  # later rounds found their kernels in the launch cache


@pytest.mark.gpu
def test_gpu_eager_decode_reads_the_device_once_then_never():
    dtype = torch.bfloat16
    k, v, tables, lens, kd, vd = make_paged_kv([700, 33, 0, 4096], 8, 128, 16, dtype, "cuda")
    q = _q(4, 32, 128, dtype, "cuda")
    decode(q, k, v, tables.clone(), lens.clone())  # compile outside the count
    torch.cuda.synchronize()

    assert device_syncs(lambda: decode(q, k, v, tables, lens)) == 1  # the one small read
    assert device_syncs(lambda: decode(q, k, v, tables, lens)) == 0  # validated, unmodified
    ws = plan_decode(4, 32, 8, 128, 16, 4096, dtype, "cuda").allocate_workspace()
    assert device_syncs(lambda: decode(q, k, v, tables, lens, workspace=ws)) == 0
    _assert_close(decode(q, k, v, tables, lens), dense_decode_attention_ref(q, kd, vd, lens))
