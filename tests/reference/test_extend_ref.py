"""The paged extend reference: against the paged decode reference (one new token each), a dense
masked SDPA written here, hand-computed cases, and its argument errors."""

from __future__ import annotations

import pytest
import torch

from flashdec import paged_decode_attention_ref, paged_extend_attention_ref
from flashdec.reference import quantize_fp8
from tests.helpers import make_paged_kv

REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _q(total, heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(total, heads, dim, generator=gen).to(dtype)


def _dense_extend(q, k_dense, v_dense, seq_lens, query_lens, scale, window=None):
    """SDPA over each request's dense K/V with an explicit causal (+ window) mask."""
    out, row = [], 0
    num_q_heads, num_kv_heads = q.shape[1], k_dense.shape[2]
    for b, (length, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        qb = q[row : row + n].float().transpose(0, 1)  # [Hq, n, D]
        k = (
            k_dense[b, :length]
            .float()
            .transpose(0, 1)
            .repeat_interleave(num_q_heads // num_kv_heads, 0)
        )
        v = (
            v_dense[b, :length]
            .float()
            .transpose(0, 1)
            .repeat_interleave(num_q_heads // num_kv_heads, 0)
        )
        pos = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None, :]
        mask = key <= pos
        if window is not None:
            mask &= key > pos - window
        o = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        out.append(o.transpose(0, 1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2), (7, 1)])
def test_matches_dense_masked_sdpa(dtype, kv_layout, window, num_q_heads, num_kv_heads):
    seq_lens, query_lens = [5, 17, 30, 3], [5, 4, 1, 2]
    gen = torch.Generator().manual_seed(num_q_heads * 3 + (window or 0))
    k, v, tables, lens, kd, vd = make_paged_kv(
        seq_lens, num_kv_heads, 8, 4, dtype, kv_layout=kv_layout, generator=gen
    )
    qlens = torch.tensor(query_lens, dtype=torch.int32)
    q = _q(sum(query_lens), num_q_heads, 8, dtype, seed=1)
    got = paged_extend_attention_ref(
        q, k, v, tables, lens, qlens, sm_scale=0.4, kv_layout=kv_layout, window=window
    )
    assert got.dtype == dtype and got.shape == q.shape
    want = _dense_extend(q, kd, vd, seq_lens, query_lens, 0.4, window)
    torch.testing.assert_close(got.float(), want, atol=REF_TOL[dtype], rtol=0)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_one_new_token_each_is_the_decode_reference(window, fp8):
    seq_lens = [1, 9, 33]
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 2, 16, 8, torch.float32)
    scales = {}
    dtype = torch.float32
    if fp8:
        dtype = torch.float16
        ks, vs = torch.tensor([0.02, 0.03]), 0.015
        k = quantize_fp8(k.transpose(1, 2), ks).transpose(1, 2)
        v = quantize_fp8(v.transpose(1, 2), vs).transpose(1, 2)
        scales = {"k_scale": ks, "v_scale": vs}
    q = _q(3, 4, 16, dtype)
    ones = torch.ones(3, dtype=torch.int64)
    got = paged_extend_attention_ref(q, k, v, tables, lens, ones, window=window, **scales)
    want = paged_decode_attention_ref(q, k, v, tables, lens, window=window, **scales)
    torch.testing.assert_close(got, want, atol=REF_TOL[dtype], rtol=0)


def test_hand_computed_causality():
    """Two new tokens and no context: the first sees only itself (its own V row exactly), the
    second both."""
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # one block of 2 tokens, 1 head, D=2
    v = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    q = torch.tensor([[[5.0, 5.0]], [[2.0, 0.0]]])  # [2 tokens, 1 head, 2]
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens, qlens = torch.tensor([2]), torch.tensor([2])
    out = paged_extend_attention_ref(q, k, v, tables, lens, qlens, sm_scale=1.0)
    torch.testing.assert_close(out[0, 0], torch.tensor([10.0, 0.0]))
    w = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    torch.testing.assert_close(out[1, 0], 10.0 * w)
    # a window of 1: each token sees only itself
    out = paged_extend_attention_ref(q, k, v, tables, lens, qlens, sm_scale=1.0, window=1)
    torch.testing.assert_close(out[:, 0], v[0, 0])


def test_blocks_before_the_first_window_are_never_read():
    seq_lens, query_lens, window = [40], [3], 5  # queries at 37..39 read 33..39
    k, v, tables, lens, _, _ = make_paged_kv(seq_lens, 1, 8, 4, torch.float32)
    qlens = torch.tensor(query_lens)
    q = _q(3, 2, 8, torch.float32)
    want = paged_extend_attention_ref(q, k, v, tables, lens, qlens, window=window)
    released = tables.clone()
    released[0, : 33 // 4] = -1  # blocks 0..7 hold positions < 32: released
    got = paged_extend_attention_ref(q, k, v, released, lens, qlens, window=window)
    torch.testing.assert_close(got, want)
    released[0, 33 // 4] = -1  # block 8 holds position 33: read, so checked
    with pytest.raises(ValueError, match="block id"):
        paged_extend_attention_ref(q, k, v, released, lens, qlens, window=window)


class TestErrors:
    def _inputs(self):
        k, v, tables, lens, _, _ = make_paged_kv([6, 3], 1, 8, 4, torch.float32)
        return _q(4, 2, 8, torch.float32), k, v, tables, lens, torch.tensor([3, 1])

    @pytest.mark.parametrize(
        ("qlens", "match"),
        [
            ([4, 0], ">= 1"),
            ([0, 4], ">= 1"),
            ([-1, 5], ">= 1"),
            ([7, 1], "seq_len"),
            ([1, 4], "seq_len"),
            ([2, 1], "sum to q's 4 rows"),
            ([3, 3], "sum to q's 4 rows"),
        ],
    )
    def test_bad_query_lens_values(self, qlens, match):
        q, k, v, tables, lens, _ = self._inputs()
        with pytest.raises(ValueError, match=match):
            paged_extend_attention_ref(q, k, v, tables, lens, torch.tensor(qlens))

    def test_bad_query_lens_structure(self):
        q, k, v, tables, lens, qlens = self._inputs()
        with pytest.raises(TypeError, match="query_lens"):
            paged_extend_attention_ref(q, k, v, tables, lens, qlens.float())
        with pytest.raises(TypeError, match="query_lens"):
            paged_extend_attention_ref(q, k, v, tables, lens, [3, 1])
        with pytest.raises(ValueError, match="query_lens"):
            paged_extend_attention_ref(q, k, v, tables, lens, qlens[None])
        with pytest.raises(ValueError, match="one per request"):
            paged_extend_attention_ref(q, k, v, tables, lens, torch.tensor([2, 1, 1]))
        with pytest.raises(ValueError, match="each >= 1"):
            paged_extend_attention_ref(q[:1], k, v, tables, lens, qlens)

    def test_other_arguments_keep_the_decode_checks(self):
        q, k, v, tables, lens, qlens = self._inputs()
        with pytest.raises(TypeError, match="dtype"):
            paged_extend_attention_ref(q.half(), k, v, tables, lens, qlens)
        k2, v2 = torch.cat([k, k], 1), torch.cat([v, v], 1)  # two KV heads, three q heads
        with pytest.raises(ValueError, match="multiple"):
            paged_extend_attention_ref(torch.cat([q, q[:, :1]], 1), k2, v2, tables, lens, qlens)
        with pytest.raises(ValueError, match="window"):
            paged_extend_attention_ref(q, k, v, tables, lens, qlens, window=0)
        with pytest.raises(ValueError, match="k_scale"):
            paged_extend_attention_ref(q, k, v, tables, lens, qlens, k_scale=1.0)
        bad = tables.clone()
        bad[0, 0] = k.shape[0]
        with pytest.raises(ValueError, match="block id"):
            paged_extend_attention_ref(q, k, v, bad, lens, qlens)
