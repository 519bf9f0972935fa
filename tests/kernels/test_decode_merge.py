"""The split path's in-kernel merge: the last split of each (request, KV head) merges.

Each case poisons the output, checks against the paged reference, and checks that the launch left
the workspace's arrival counters at zero (the next launch or graph replay must start clean). The
separate merge kernel (a plan without ``fused_merge``, or a launch without counters) is the
other side of every comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashdec import dense_decode_attention_ref, paged_decode_attention_ref
from flashdec.kernels import BoundDecode, DecodeWorkspace, decode, launch_decode, plan_decode
from flashdec.kernels.decode_plan import FUSED_MERGE_MAX_ROWS, MERGE_TILE_ELEMS
from tests.helpers import make_paged_kv
from tests.kernels.test_decode import _assert_close, _q
from tests.kernels.test_decode_window import windowed_kv
from tests.kernels.test_fp8 import FP8, fp8_paged_kv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# one request per split count: 1 (written directly), 2, 4, many; a seq_len 0 row
RAGGED = [200, 0, 17, 64, 1, 130]


def _split_plan(batch, hq, hkv, d, page, max_len, dtype, device, **kwargs):
    kwargs.setdefault("block_n", 16)
    kwargs.setdefault("tokens_per_split", 16)
    return plan_decode(batch, hq, hkv, d, page, max_len, dtype, device, **kwargs)


class TestPlan:
    def test_small_merges_are_fused_large_ones_launch_the_merge_kernel(self):
        gqa = plan_decode(1, 32, 8, 128, 16, 32768, torch.bfloat16, "cpu")
        assert gqa.uses_split and gqa.fused_merge
        assert gqa.group_size * gqa.num_splits <= FUSED_MERGE_MAX_ROWS
        mqa = plan_decode(1, 32, 1, 128, 16, 32768, torch.bfloat16, "cpu")
        assert mqa.group_size * mqa.num_splits > FUSED_MERGE_MAX_ROWS and not mqa.fused_merge
        single = plan_decode(64, 32, 8, 128, 16, 2048, torch.bfloat16, "cpu")
        assert not single.uses_split and not single.fused_merge
        forced = plan_decode(1, 32, 1, 128, 16, 32768, torch.bfloat16, "cpu", fused_merge=True)
        assert forced.fused_merge and forced.num_splits == mqa.num_splits
        off = plan_decode(1, 32, 8, 128, 16, 32768, torch.bfloat16, "cpu", fused_merge=False)
        assert not off.fused_merge
        # a single pass has nothing to merge, whatever was asked
        assert not plan_decode(
            1, 4, 2, 64, 16, 10, torch.float16, "cpu", fused_merge=True
        ).fused_merge

    def test_merge_chunk_fits_the_tile(self):
        for hq, hkv, d in ((32, 8, 128), (32, 1, 128), (8, 8, 64), (16, 4, 256), (28, 4, 128)):
            plan = plan_decode(1, hq, hkv, d, 16, 32768, torch.float16, "cpu", fused_merge=True)
            g, s = plan.merge_block_g, plan.merge_chunk_splits
            assert g >= plan.group_size and g & (g - 1) == 0 and s & (s - 1) == 0
            assert g * s * plan.block_d <= max(MERGE_TILE_ELEMS, g * plan.block_d)
            assert s <= max(1, 2 * plan.num_splits)

    def test_merge_launch_tile_fits(self):
        for hq, hkv, d in ((32, 1, 128), (28, 4, 128), (16, 4, 256), (14, 2, 64), (8, 1, 80)):
            plan = plan_decode(1, hq, hkv, d, 16, 32768, torch.float16, "cpu", fused_merge=False)
            s, dims = plan.merge_block_s, plan.merge_block_d
            assert plan.block_d % dims == 0 and s & (s - 1) == 0
            assert s * dims <= MERGE_TILE_ELEMS and s <= 2 * plan.num_splits

    def test_merge_launch_slices_head_dims_only_for_few_pairs(self):
        """Fewer (request, query head) pairs than SMs: 32-dim slices; a batch with enough pairs
        keeps one program per pair (slices would multiply short programs)."""
        one = plan_decode(1, 32, 1, 128, 16, 32768, torch.bfloat16, "cpu")
        assert not one.fused_merge and (one.merge_block_d, one.merge_block_s) == (32, 256)
        skewed = plan_decode(
            64, 32, 1, 128, 16, 32768, torch.bfloat16, "cpu", total_tokens=32768 + 63 * 1024
        )
        assert not skewed.fused_merge and skewed.merge_block_d == skewed.block_d == 128
        assert skewed.merge_block_s == 32

    def test_rejects_a_non_bool(self):
        with pytest.raises(TypeError, match="fused_merge"):
            plan_decode(1, 4, 2, 64, 16, 10, torch.float16, "cpu", fused_merge=1)  # type: ignore[arg-type]

    def test_workspace_counters_start_at_zero(self):
        plan = plan_decode(3, 8, 2, 64, 16, 4096, torch.float16, "cpu")
        ws = DecodeWorkspace.allocate(plan)
        assert ws.counters.shape == (3, 2) and ws.counters.dtype == torch.int32
        assert not ws.counters.any()


# groups of 1, 3 (padded to the merge tile's 4) and 8 (MQA)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (8, 1), (6, 2)], ids=str)
def test_ragged_batch_fused_and_separate_merge(hq, hkv, device):
    dtype = torch.float16
    k, v, tables, lens, kd, vd = make_paged_kv(RAGGED, hkv, 32, 8, dtype, device)
    q = _q(len(RAGGED), hq, 32, dtype, device)
    ref = dense_decode_attention_ref(q, kd, vd, lens)
    for fused in (True, False):
        plan = _split_plan(len(RAGGED), hq, hkv, 32, 8, 200, dtype, device, fused_merge=fused)
        assert plan.num_splits == 13 and plan.fused_merge is fused
        ws = plan.allocate_workspace()
        ws.out.fill_(float("nan"))
        _assert_close(decode(q, k, v, tables, lens, workspace=ws), ref)
        assert not ws.counters.any()


def test_repeated_launches_on_one_workspace(device):
    """New lengths each call (split counts change per request) over the same counters; the same
    inputs twice give the same bits."""
    dtype = torch.bfloat16
    k, v, tables, lens, kd, vd = make_paged_kv([150, 150, 150], 2, 32, 16, dtype, device)
    q = _q(3, 8, 32, dtype, device)
    plan = _split_plan(3, 8, 2, 32, 16, 150, dtype, device)
    assert plan.fused_merge
    ws = plan.allocate_workspace()
    first = None
    for new_lens in ([150, 90, 40], [16, 150, 0], [33, 1, 150], [150, 90, 40]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out = torch.full_like(q, float("nan"))
        decode(q, k, v, tables, lens, out=out, workspace=ws)
        _assert_close(out, dense_decode_attention_ref(q, kd, vd, lens))
        assert not ws.counters.any()
        if first is None:
            first = out
    assert torch.equal(out, first)


def test_bound_and_trusted_launches_with_counters(device):
    """The engine's paths: a bound launch replayed with lengths changed in place (as a CUDA graph
    is), and the trusted launcher; without counters they launch the merge kernel instead."""
    dtype = torch.float16
    k, v, tables, lens, kd, vd = make_paged_kv([120, 120, 120], 2, 16, 8, dtype, device)
    q = _q(3, 4, 16, dtype, device)
    plan = _split_plan(3, 4, 2, 16, 8, 120, dtype, device)
    ws = plan.allocate_workspace()
    bound = BoundDecode(
        q,
        k,
        v,
        tables,
        lens,
        16**-0.5,
        plan,
        ws.out,
        ws.partial_out,
        ws.partial_lse,
        3,
        counters=ws.counters,
    )
    separate = BoundDecode(
        q, k, v, tables, lens, 16**-0.5, plan, ws.out, ws.partial_out, ws.partial_lse, 3
    )
    for new_lens in ([120, 5, 70], [0, 119, 64], [120, 5, 70]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        ref = dense_decode_attention_ref(q, kd, vd, lens)
        for launch in (bound, separate):
            out = torch.full_like(q, float("nan"))
            assert launch(q, k, v, out) is out
            _assert_close(out, ref)
            assert not ws.counters.any()
        out = torch.full_like(q, float("nan"))
        launch_decode(
            q,
            k,
            v,
            tables,
            lens,
            16**-0.5,
            plan,
            out,
            ws.partial_out,
            ws.partial_lse,
            3,
            counters=ws.counters,
        )
        _assert_close(out, ref)
        assert not ws.counters.any()


def test_workspace_without_counters_launches_the_merge_kernel(device, monkeypatch):
    """A workspace built without counters (e.g. by hand, over the caller's own buffers) still
    serves a fused_merge plan: a second launch merges."""
    from flashdec.kernels import paged_decode

    dtype = torch.float16
    k, v, tables, lens, kd, vd = make_paged_kv([100, 30], 1, 16, 8, dtype, device)
    q = _q(2, 2, 16, dtype, device)
    plan = _split_plan(2, 2, 1, 16, 8, 100, dtype, device)
    assert plan.fused_merge
    full = plan.allocate_workspace()
    ws = DecodeWorkspace(plan, full.partial_out, full.partial_lse, full.out)
    assert ws.counters is None
    launches = []
    for name in ("_DECODE", "_MERGE"):
        launcher = getattr(paged_decode, name)
        monkeypatch.setattr(paged_decode, name, _Counting(launcher, name, launches))
    ws.out.fill_(float("nan"))
    _assert_close(
        decode(q, k, v, tables, lens, workspace=ws), dense_decode_attention_ref(q, kd, vd, lens)
    )
    assert launches == ["_DECODE", "_MERGE"]


def test_work_list_loop_and_chunked_merge(device):
    """Fewer programs than work items (a program may count in twice on one counter) and more
    splits than one merge chunk (the running maximum rescales across chunks)."""
    dtype = torch.float32
    seq_lens = [300, 3, 0, 45]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 1, 64, 8, dtype, device)
    q = _q(4, 8, 64, dtype, device) * 3.0  # peaky softmax: the split maxima differ a lot
    plan = _split_plan(4, 8, 1, 64, 8, 300, dtype, device, fused_merge=True)
    assert plan.num_splits == 19 and plan.merge_chunk_splits < plan.num_splits
    plan = dataclasses.replace(plan, num_programs=3)
    ws = plan.allocate_workspace()
    ws.out.fill_(float("nan"))
    _assert_close(
        decode(q, k, v, tables, lens, workspace=ws),
        paged_decode_attention_ref(q, k, v, tables, lens),
    )
    assert not ws.counters.any()


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_merge_launch_over_several_steps(dtype, sliced, device):
    """The merge launch, its head_dim 80 cut into 32-dim slices (the last one all padding) or
    whole (a batch of many pairs), with a small split step: several loop steps per program."""
    seq_lens = [150, 7, 0, 97]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 2, 80, 8, dtype, device)
    q = _q(4, 8, 80, dtype, device) * 3.0  # peaky softmax: the split maxima differ a lot
    plan = _split_plan(4, 8, 2, 80, 8, 150, dtype, device, fused_merge=False)
    assert plan.block_d // plan.merge_block_d == 4 and plan.num_splits == 10
    plan = dataclasses.replace(plan, merge_block_s=4)
    if not sliced:
        plan = dataclasses.replace(plan, merge_block_d=plan.block_d)
    ws = plan.allocate_workspace()
    ws.out.fill_(float("nan"))
    _assert_close(
        decode(q, k, v, tables, lens, workspace=ws),
        paged_decode_attention_ref(q, k, v, tables, lens),
    )


def test_window(device):
    dtype = torch.float16
    seq_lens, window = [140, 3, 0, 60], 50
    k, v, tables, lens, kd, vd = windowed_kv(seq_lens, 2, 16, 8, dtype, device, window)
    q = _q(4, 4, 16, dtype, device)
    plan = _split_plan(4, 4, 2, 16, 8, 140, dtype, device, window=window)
    assert plan.fused_merge and plan.num_splits == 4
    ws = plan.allocate_workspace()
    ws.out.fill_(float("nan"))
    _assert_close(
        decode(q, k, v, tables, lens, window=window, workspace=ws),
        dense_decode_attention_ref(q, kd, vd, lens, window=window),
    )
    assert not ws.counters.any()


def test_fp8(device):
    dtype = torch.bfloat16
    k_scale = torch.linspace(0.01, 0.03, 2, device=device)
    v_scale = torch.linspace(0.02, 0.012, 2, device=device)
    k, v, tables, lens = fp8_paged_kv([90, 0, 3, 50], 2, 32, 8, device, k_scale, v_scale)
    q = _q(4, 4, 32, dtype, device, seed=5)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale)
    plan = _split_plan(4, 4, 2, 32, 8, 90, dtype, device, kv_dtype=FP8)
    assert plan.fused_merge
    ws = plan.allocate_workspace()
    ws.out.fill_(float("nan"))
    _assert_close(
        decode(q, k, v, tables, lens, workspace=ws, k_scale=k_scale, v_scale=v_scale), ref
    )
    assert not ws.counters.any()


def test_eager_call_merges_in_place(device, monkeypatch):
    """Without a workspace the call allocates zeroed counters itself: one launch."""
    from flashdec.kernels import paged_decode

    dtype = torch.float16
    k, v, tables, lens, kd, vd = make_paged_kv([280, 7], 1, 16, 8, dtype, device)
    q = _q(2, 2, 16, dtype, device)
    launches = []
    for name in ("_DECODE", "_MERGE"):
        launcher = getattr(paged_decode, name)
        monkeypatch.setattr(paged_decode, name, _Counting(launcher, name, launches))
    out = decode(q, k, v, tables, lens)
    _assert_close(out, dense_decode_attention_ref(q, kd, vd, lens))
    assert launches == ["_DECODE"]


class _Counting:
    def __init__(self, launcher, name, log) -> None:
        self.launcher, self.name, self.log = launcher, name, log

    def __call__(self, *args, **kwargs):
        self.log.append(self.name)
        return self.launcher(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# GPU only: real concurrency (the interpreter runs programs one after another)
# --------------------------------------------------------------------------------------------
GPU_SHAPES = [
    # (hq, hkv, d, page, dtype, lens)
    (32, 8, 128, 16, torch.bfloat16, [32768]),
    (32, 8, 128, 16, torch.float16, [32768, 0, 1, 4000, 129, 17000]),
    (28, 4, 128, 16, torch.bfloat16, [32768]),
    (32, 1, 128, 16, torch.bfloat16, [32768, 5, 9000]),
    (16, 4, 256, 16, torch.bfloat16, [20000, 300]),
    (64, 8, 64, 32, torch.float16, [12000, 1, 0, 7777]),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "dtype", "seq_lens"), GPU_SHAPES, ids=str)
def test_gpu_fused_merge_is_exact_and_bitwise_reproducible(hq, hkv, d, page, dtype, seq_lens):
    """Real races between splits: the output is right, bitwise the same over many runs, and
    every run leaves the counters at zero; the separate merge agrees."""
    batch = len(seq_lens)
    k, v, tables, lens, kd, vd = make_paged_kv(seq_lens, hkv, d, page, dtype, "cuda")
    q = _q(batch, hq, d, dtype, "cuda")
    ref = dense_decode_attention_ref(q, kd, vd, lens)
    max_len = max(seq_lens)
    plan = plan_decode(batch, hq, hkv, d, page, max_len, dtype, "cuda", fused_merge=True)
    assert plan.uses_split and plan.fused_merge
    ws = plan.allocate_workspace()
    first = decode(q, k, v, tables, lens, workspace=ws).clone()
    _assert_close(first, ref)
    for _ in range(50):
        ws.out.fill_(float("nan"))
        decode(q, k, v, tables, lens, workspace=ws)
        assert torch.equal(ws.out, first)
    assert not ws.counters.any()
    separate = dataclasses.replace(plan, fused_merge=False)
    _assert_close(decode(q, k, v, tables, lens, workspace=separate.allocate_workspace()), ref)
    # the work list loop: a program takes several items, of one counter too
    few = dataclasses.replace(plan, num_programs=7)
    ws_few = few.allocate_workspace()
    _assert_close(decode(q, k, v, tables, lens, workspace=ws_few), ref)
    assert not ws_few.counters.any()


@pytest.mark.gpu
def test_gpu_fused_merge_graph_replays_with_new_lengths():
    """One capture, many replays with lengths changed in place (split counts per request change
    between replays, rows go to 0 and back): each replay starts from zeroed counters."""
    dtype = torch.bfloat16
    seq_lens = [9000, 9000, 9000, 9000]  # pages for the longest; replays use any prefix
    k, v, tables, lens, kd, vd = make_paged_kv(seq_lens, 8, 128, 16, dtype, "cuda")
    q = _q(4, 32, 128, dtype, "cuda")
    plan = plan_decode(4, 32, 8, 128, 16, 9000, dtype, "cuda", max_blocks_per_seq=tables.shape[1])
    assert plan.fused_merge
    ws = plan.allocate_workspace()
    decode(q, k, v, tables, lens, workspace=ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):  # several launches per graph, as in a multi-layer step
            decode(q, k, v, tables, lens, workspace=ws)
    gen = torch.Generator().manual_seed(3)
    for replay in range(20):
        new = torch.randint(0, 9001, (4,), generator=gen, dtype=torch.int32)
        new[replay % 4] = 0 if replay % 3 == 0 else new[replay % 4]
        lens.copy_(new)
        ws.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(ws.out, dense_decode_attention_ref(q, kd, vd, lens))
        assert not ws.counters.any()


@pytest.mark.gpu
def test_gpu_fused_merge_fp8_and_window():
    dtype = torch.float16
    k_scale = torch.linspace(0.01, 0.03, 4, device="cuda")
    v_scale = torch.linspace(0.02, 0.012, 4, device="cuda")
    seq_lens = [30000, 0, 4097]
    k, v, tables, lens = fp8_paged_kv(seq_lens, 4, 128, 16, "cuda", k_scale, v_scale)
    q = _q(3, 16, 128, dtype, "cuda")
    for window in (None, 1000, 20000):
        ref = paged_decode_attention_ref(
            q, k, v, tables, lens, k_scale=k_scale, v_scale=v_scale, window=window
        )
        plan = plan_decode(3, 16, 4, 128, 16, 30000, dtype, "cuda", kv_dtype=FP8, window=window)
        assert plan.fused_merge
        ws = plan.allocate_workspace()
        outs = [
            decode(
                q, k, v, tables, lens, workspace=ws, window=window, k_scale=k_scale, v_scale=v_scale
            ).clone()
            for _ in range(5)
        ]
        _assert_close(outs[0], ref)
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert not ws.counters.any()
