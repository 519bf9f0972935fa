"""Sliding-window decode (``decode(..., window=)``) against the references.

Every case poisons what a windowed call must not touch: table entries of blocks wholly before the
window hold -1, ids past the pool, or the id of a released block filled with NaN, and the K/V of
positions before the window inside its first block are NaN. A read of any of them shows up as an
error, a crash or a NaN in the output.
"""

from __future__ import annotations

import pytest
import torch

from flashdec import dense_decode_attention_ref, paged_decode_attention_ref
from flashdec.kernels import BoundDecode, decode, launch_decode, plan_decode
from tests.helpers import TOLERANCES, make_paged_kv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(4, 2), (8, 1), (2, 2), (6, 2)]  # GQA 2, MQA 8, MHA, odd GQA 3
LENS = [37, 0, 1, 130, 64]


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[out.dtype]
    assert not torch.isnan(out).any(), "NaN in the output: something before the window was read"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _q(batch, num_q_heads, head_dim, dtype, device, seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_q_heads, head_dim, generator=gen).to(device=device, dtype=dtype)


def windowed_kv(
    seq_lens, num_kv_heads, head_dim, block_size, dtype, device, window, poison_lens=None, **kwargs
):
    """``make_paged_kv`` with everything before each row's window poisoned (see the module
    docstring; windows of ``poison_lens``, default ``seq_lens``); the dense copies keep the true
    values."""
    k, v, tables, lens, kd, vd = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, **kwargs
    )
    tok = 2 if kwargs.get("kv_layout", "token_major") == "token_major" else 3
    used = {int(i) for i in tables.flatten().tolist() if i >= 0}
    released = min(set(range(k.shape[0])) - used)  # a block no row uses (extra_blocks > 0)
    k[released] = float("nan")
    v[released] = float("nan")
    for b, length in enumerate(seq_lens if poison_lens is None else poison_lens):
        start = max(0, length - window)
        before = start // block_size  # blocks wholly before the window
        junk = (-1, k.shape[0] + 7, released, 2**31 - 1)[b % 4]
        tables[b, :before] = junk
        if start % block_size:  # positions before the window in its first block
            block = int(tables[b, before])
            index = [block, slice(None), slice(None), slice(None)]
            index[tok] = slice(0, start % block_size)
            k[tuple(index)] = float("nan")
            v[tuple(index)] = float("nan")
    return k, v, tables, lens, kd, vd


# (window, how the call is planned): windows below, at and above the row lengths, not
# multiples of the page; eager (heuristic plan), forced single pass, forced splits
WINDOW_CASES = [
    (window, mode) for window in (1, 5, 8, 37, 50, 200) for mode in ("eager", "single", "split")
]


@pytest.mark.parametrize(("window", "mode"), WINDOW_CASES, ids=str)
def test_window_matches_both_references(window, mode, device):
    case = WINDOW_CASES.index((window, mode))
    dtype = DTYPES[case % 3]
    num_q_heads, num_kv_heads = HEADS[case % len(HEADS)]
    block_size = (8, 16)[case % 2]
    head_dim = 32
    k, v, tables, lens, kd, vd = windowed_kv(
        LENS, num_kv_heads, head_dim, block_size, dtype, device, window
    )
    batch = len(LENS)
    q = _q(batch, num_q_heads, head_dim, dtype, device, seed=case)
    out = torch.full_like(q, float("nan"))
    if mode == "eager":
        got = decode(q, k, v, tables, lens, window=window, out=out)
    else:
        split = {"num_splits": 1} if mode == "single" else {"tokens_per_split": 16, "block_n": 16}
        plan = plan_decode(
            batch,
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
            max(LENS),
            dtype,
            device,
            window=window,
            **split,
        )
        assert plan.uses_split == (mode == "split" and window > 16)
        got = decode(
            q, k, v, tables, lens, window=window, out=out, workspace=plan.allocate_workspace()
        )
    assert got is out
    _assert_close(out, dense_decode_attention_ref(q, kd, vd, lens, window=window))
    _assert_close(out, paged_decode_attention_ref(q, k, v, tables, lens, window=window))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
def test_window_layouts_and_many_splits(dtype, kv_layout, device):
    """A long row, a short window: the splits cut only the window (tile-aligned start)."""
    seq_lens, window = [300, 29, 100], 45
    k, v, tables, lens, kd, vd = windowed_kv(
        seq_lens, 2, 16, 4, dtype, device, window, kv_layout=kv_layout
    )
    q = _q(3, 4, 16, dtype, device)
    ref = dense_decode_attention_ref(q, kd, vd, lens, window=window)
    plan = plan_decode(
        3,
        4,
        2,
        16,
        4,
        300,
        dtype,
        device,
        kv_layout,
        window=window,
        tokens_per_split=16,
        block_n=16,
    )
    assert plan.num_splits == 3  # ceil(45 / 16): the planned range is the window, not 300
    ws = plan.allocate_workspace()
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    _assert_close(
        decode(q, k, v, tables, lens, kv_layout=kv_layout, window=window, workspace=ws), ref
    )
    _assert_close(decode(q, k, v, tables, lens, kv_layout=kv_layout, window=window), ref)


def test_window_equal_to_length_and_none_agree(device):
    seq_lens = [40, 17]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 1, 16, 8, torch.float16, device)
    q = _q(2, 2, 16, torch.float16, device)
    full = decode(q, k, v, tables, lens)
    for window in (40, 41, 10**9):
        torch.testing.assert_close(decode(q, k, v, tables, lens, window=window), full)


def test_bound_and_trusted_launches_take_the_plans_window(device):
    """The engine's paths: ``launch_decode`` and ``BoundDecode`` read the window off the plan."""
    dtype = torch.float16
    seq_lens, window = [90, 3, 50], 20
    k, v, tables, lens, kd, vd = windowed_kv(seq_lens, 2, 16, 8, dtype, device, window)
    q = _q(3, 4, 16, dtype, device)
    ref = dense_decode_attention_ref(q, kd, vd, lens, window=window)
    for split in ({"num_splits": 1}, {"tokens_per_split": 16, "block_n": 16}):
        plan = plan_decode(3, 4, 2, 16, 8, 90, dtype, device, window=window, **split)
        ws = plan.allocate_workspace()
        out = torch.full_like(q, float("nan"))
        launch_decode(q, k, v, tables, lens, 16**-0.5, plan, out, ws.partial_out, ws.partial_lse, 3)
        _assert_close(out, ref)
        bound = BoundDecode(
            q, k, v, tables, lens, 16**-0.5, plan, ws.out, ws.partial_out, ws.partial_lse, 3
        )
        out.fill_(float("nan"))
        assert bound(q, k, v, out) is out
        _assert_close(out, ref)


def test_window_plan_sizes_splits_for_the_window():
    kwargs = {"dtype": torch.bfloat16, "device": "cpu"}
    windowed = plan_decode(1, 32, 8, 128, 16, 32768, window=512, **kwargs)
    short = plan_decode(1, 32, 8, 128, 16, 512, **kwargs)
    assert (windowed.num_splits, windowed.tokens_per_split) == (
        short.num_splits,
        short.tokens_per_split,
    )
    assert windowed.max_seq_len == 32768 and windowed.window == 512
    full = plan_decode(1, 32, 8, 128, 16, 32768, **kwargs)
    assert full.window is None and full.num_splits > windowed.num_splits
    # total_tokens counts what is attended: capped at batch * window
    big = plan_decode(64, 32, 8, 128, 16, 32768, total_tokens=64 * 32768, window=64, **kwargs)
    small = plan_decode(64, 32, 8, 128, 16, 64, total_tokens=64 * 64, **kwargs)
    assert (big.num_splits, big.tokens_per_split) == (small.num_splits, small.tokens_per_split)
    # a window longer than every request changes nothing but the field
    wide = plan_decode(2, 8, 2, 64, 16, 1000, window=5000, **kwargs)
    same = plan_decode(2, 8, 2, 64, 16, 1000, **kwargs)
    assert wide == same.__class__(**{**same.__dict__, "window": 5000})


class TestErrors:
    def _inputs(self, device):
        k, v, tables, lens, _, _ = make_paged_kv([10, 20], 2, 16, 8, torch.float16, device)
        return torch.randn(2, 4, 16, dtype=torch.float16, device=device), k, v, tables, lens

    @pytest.mark.parametrize(
        ("window", "error", "match"),
        [
            (0, ValueError, "window must be >= 1, got 0"),
            (-3, ValueError, "window must be >= 1"),
            (2.0, TypeError, "window must be an int"),
            (True, TypeError, "window must be an int"),
            ("4", TypeError, "window must be an int"),
        ],
    )
    def test_bad_window_mutates_nothing(self, window, error, match, device):
        q, k, v, tables, lens = self._inputs(device)
        before = [t.clone() for t in (q, k, v, tables, lens)]
        out = torch.full_like(q, float("nan"))
        ws = plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device).allocate_workspace()
        ws.out.fill_(float("nan"))
        with pytest.raises(error, match=match):
            decode(q, k, v, tables, lens, window=window, out=out)
        with pytest.raises(error, match=match):
            decode(q, k, v, tables, lens, window=window, workspace=ws)
        with pytest.raises(error, match=match):
            plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device, window=window)
        with pytest.raises(error, match=match):
            paged_decode_attention_ref(q, k, v, tables, lens, window=window)
        assert torch.isnan(out).all() and torch.isnan(ws.out).all()
        for old, new in zip(before, (q, k, v, tables, lens), strict=True):
            assert torch.equal(old, new)

    def test_workspace_planned_for_another_window(self, device):
        q, k, v, tables, lens = self._inputs(device)
        ws = plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device, window=8).allocate_workspace()
        ws.out.fill_(float("nan"))
        for window in (None, 9):
            with pytest.raises(ValueError, match=f"planned for window=8, got window={window}"):
                decode(q, k, v, tables, lens, window=window, workspace=ws)
        full = plan_decode(2, 4, 2, 16, 8, 20, torch.float16, device).allocate_workspace()
        with pytest.raises(ValueError, match="planned for window=None, got window=8"):
            decode(q, k, v, tables, lens, window=8, workspace=full)
        assert torch.isnan(ws.out).all()

    def test_used_entries_in_the_window_are_still_checked(self, device):
        q, k, v, tables, lens = self._inputs(device)
        bad = tables.clone()
        bad[1, 0] = k.shape[0]  # block 0 of row 1 (len 20) is in a window of 16 (tokens 4..19)
        with pytest.raises(ValueError, match="block id"):
            decode(q, k, v, bad, lens, window=16)
        out = decode(q, k, v, bad, lens, window=12)  # tokens 8..19: block 0 is never read
        _assert_close(out, paged_decode_attention_ref(q, k, v, bad, lens, window=12))


# --------------------------------------------------------------------------------------------
# GPU only: long contexts, graph capture
# --------------------------------------------------------------------------------------------
GPU_SHAPES = [
    (32, 8, 128, 16, torch.bfloat16),
    (32, 1, 128, 16, torch.float16),
    (16, 8, 256, 32, torch.bfloat16),
    (28, 4, 64, 64, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "d", "page", "dtype"), GPU_SHAPES, ids=str)
@pytest.mark.parametrize("window", [1, 100, 4096, 40000])
def test_gpu_window_large_shapes(hq, hkv, d, page, dtype, window):
    seq_lens = [4000, 33000, 1, 9017, 4097]
    k, v, tables, lens, kd, vd = windowed_kv(seq_lens, hkv, d, page, dtype, "cuda", window)
    q = _q(len(seq_lens), hq, d, dtype, "cuda")
    ref = dense_decode_attention_ref(q, kd, vd, lens, window=window)
    _assert_close(decode(q, k, v, tables, lens, window=window), ref)  # heuristic plan
    for kwargs in ({"num_splits": 1}, {"num_splits": 40}, {}):
        plan = plan_decode(
            len(seq_lens), hq, hkv, d, page, 33000, dtype, "cuda", window=window, **kwargs
        )
        out = torch.full_like(q, float("nan"))
        decode(q, k, v, tables, lens, out=out, window=window, workspace=plan.allocate_workspace())
        _assert_close(out, ref)


@pytest.mark.gpu
def test_gpu_window_graph_capture_and_replay():
    dtype, window = torch.bfloat16, 1000
    seq_lens, later = [5000, 100, 2048], [4999, 7, 2047]
    k, v, tables, lens, kd, vd = windowed_kv(
        seq_lens, 8, 128, 16, dtype, "cuda", window, poison_lens=later
    )
    q = _q(3, 32, 128, dtype, "cuda")
    plan = plan_decode(
        3, 32, 8, 128, 16, 6000, dtype, "cuda", window=window, max_blocks_per_seq=tables.shape[1]
    )
    ws = plan.allocate_workspace()
    decode(q, k, v, tables, lens, window=window, workspace=ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(q, k, v, tables, lens, window=window, workspace=ws)
    lens.copy_(torch.tensor(later, dtype=torch.int32))  # new lengths, same graph
    ws.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(ws.out, dense_decode_attention_ref(q, kd, vd, lens, window=window))
