"""The dense and paged references agree with each other and with hand-computed cases."""

import math

import pytest
import torch

from flashdec import dense_decode_attention_ref, paged_decode_attention_ref
from tests.helpers import make_paged_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2), (5, 1)], ids=["mha", "gqa", "mqa"]
)
@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_paged_matches_dense(dtype, kv_layout, num_q_heads, num_kv_heads, block_size):
    seq_lens = [0, 1, 13, 7]
    gen = torch.Generator().manual_seed(block_size * 31 + num_q_heads)
    k_cache, v_cache, tables, lens, k_dense, v_dense = make_paged_kv(
        seq_lens, num_kv_heads, 12, block_size, dtype, kv_layout=kv_layout, generator=gen
    )
    q = torch.randn(len(seq_lens), num_q_heads, 12, generator=gen).to(dtype)
    paged = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, kv_layout=kv_layout)
    dense = dense_decode_attention_ref(q, k_dense, v_dense, lens)
    assert paged.dtype == dense.dtype == dtype
    torch.testing.assert_close(paged.float(), dense.float(), atol=REF_TOL[dtype], rtol=0)
    assert torch.all(paged[0] == 0), "seq_len 0 must give an all-zero row"


def test_single_token_returns_its_value():
    # softmax over one position is 1: output is exactly that token's V row, whatever q is.
    q = torch.randn(1, 2, 4)
    k = torch.randn(1, 1, 1, 4)
    v = torch.tensor([[[[1.0, -2.0, 3.0, 0.5]]]])
    out = dense_decode_attention_ref(q, k, v, torch.tensor([1], dtype=torch.int32))
    torch.testing.assert_close(out, v[0, 0].expand(2, 4)[None])


def test_hand_computed_two_tokens_with_scale():
    q = torch.tensor([[[1.0, 0.0]]])  # [1, 1, 2]
    k = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # scores with scale 2: [2, 0]
    v = torch.tensor([[[[10.0, 0.0]], [[0.0, 10.0]]]])
    w = math.exp(2.0) / (math.exp(2.0) + 1.0)
    expected = torch.tensor([[[10.0 * w, 10.0 * (1 - w)]]])
    lens = torch.tensor([2], dtype=torch.int32)
    torch.testing.assert_close(dense_decode_attention_ref(q, k, v, lens, sm_scale=2.0), expected)
    # the same two tokens in a paged cache: block 1 holds them (block 0 is junk never read)
    k_pages = torch.stack([torch.full((1, 2, 2), 99.0), k[0].transpose(0, 1)])  # [2, 1, 2, 2]
    v_pages = torch.stack([torch.full((1, 2, 2), 99.0), v[0].transpose(0, 1)])
    tables = torch.tensor([[1, 0]], dtype=torch.int32)
    out = paged_decode_attention_ref(q, k_pages, v_pages, tables, lens, sm_scale=2.0)
    torch.testing.assert_close(out, expected)


def test_default_scale_is_inverse_sqrt_head_dim():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 16, generator=gen)
    k = torch.randn(2, 5, 1, 16, generator=gen)
    v = torch.randn(2, 5, 1, 16, generator=gen)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    a = dense_decode_attention_ref(q, k, v, lens)
    b = dense_decode_attention_ref(q, k, v, lens, sm_scale=0.25)
    torch.testing.assert_close(a, b)


def test_gqa_head_mapping():
    # query heads 0,1 read KV head 0; heads 2,3 read KV head 1 (h // group)
    q = torch.zeros(1, 4, 2)
    k = torch.zeros(1, 1, 2, 2)
    v = torch.tensor([[[[1.0, 1.0], [5.0, 5.0]]]])  # kv head 0 -> 1s, head 1 -> 5s
    out = dense_decode_attention_ref(q, k, v, torch.tensor([1], dtype=torch.int32))
    assert out[0, :2].eq(1.0).all() and out[0, 2:].eq(5.0).all()


def test_tokens_past_seq_len_are_ignored():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables, lens, _, _ = make_paged_kv([9], 1, 8, 4, torch.float32, generator=gen)
    q = torch.randn(1, 2, 8, generator=gen)
    before = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)
    last = int(tables[0, 2])  # block of tokens 8..11: only offset 0 is live
    k_cache[last, :, 1:] = 1e4
    v_cache[last, :, 1:] = float("nan")
    after = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(before, after)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_layout", ["token_major", "dim_major"])
@pytest.mark.parametrize("window", [1, 3, 4, 5, 13, 14, 100])
def test_window_paged_matches_dense(dtype, kv_layout, window):
    seq_lens = [0, 1, 13, 7, 4, 5]  # windows shorter than, equal to and past each length
    gen = torch.Generator().manual_seed(window)
    k_cache, v_cache, tables, lens, k_dense, v_dense = make_paged_kv(
        seq_lens, 2, 12, 4, dtype, kv_layout=kv_layout, generator=gen
    )
    q = torch.randn(len(seq_lens), 6, 12, generator=gen).to(dtype)
    paged = paged_decode_attention_ref(
        q, k_cache, v_cache, tables, lens, kv_layout=kv_layout, window=window
    )
    dense = dense_decode_attention_ref(q, k_dense, v_dense, lens, window=window)
    torch.testing.assert_close(paged.float(), dense.float(), atol=REF_TOL[dtype], rtol=0)
    # the window equals attention over the last `window` tokens moved to the front
    for b, seq_len in enumerate(seq_lens):
        first = max(0, seq_len - window)
        shifted_k = torch.zeros_like(k_dense[b : b + 1])
        shifted_v = torch.zeros_like(v_dense[b : b + 1])
        shifted_k[0, : seq_len - first] = k_dense[b, first:seq_len]
        shifted_v[0, : seq_len - first] = v_dense[b, first:seq_len]
        full = dense_decode_attention_ref(
            q[b : b + 1], shifted_k, shifted_v, torch.tensor([seq_len - first])
        )
        torch.testing.assert_close(dense[b : b + 1], full)


def test_window_at_least_the_length_is_full_attention():
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, tables, lens, _, _ = make_paged_kv(
        [9, 3], 2, 8, 4, torch.float32, generator=gen
    )
    q = torch.randn(2, 4, 8, generator=gen)
    full = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(
        paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, window=9), full
    )


def test_window_never_reads_blocks_before_it():
    """Blocks wholly before the window may be released: their table entries and contents are
    ignored, even when the id is out of range (a released slot)."""
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables, lens, _, _ = make_paged_kv(
        [11], 1, 8, 4, torch.float32, generator=gen
    )
    q = torch.randn(1, 2, 8, generator=gen)
    before = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, window=6)  # tokens 5..10
    k_cache[int(tables[0, 0])] = float("nan")  # tokens 0..3: wholly before the window
    tables = tables.clone()
    tables[0, 0] = -1
    after = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, window=6)
    torch.testing.assert_close(before, after)
    tables[0, 1] = -1  # tokens 4..7: token 5 is in the window, so this block is read
    with pytest.raises(ValueError, match="block id"):
        paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, window=6)


@pytest.mark.parametrize(
    ("window", "error"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_bad_window(window, error):
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, tables, lens, k_dense, v_dense = make_paged_kv(
        [3], 1, 8, 4, torch.float32, generator=gen
    )
    q = torch.randn(1, 1, 8, generator=gen)
    with pytest.raises(error, match="window"):
        paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, window=window)
    with pytest.raises(error, match="window"):
        dense_decode_attention_ref(q, k_dense, v_dense, lens, window=window)


class TestErrors:
    def setup_method(self):
        gen = torch.Generator().manual_seed(3)
        self.k, self.v, self.t, self.l, _, _ = make_paged_kv(
            [5, 3], 2, 8, 4, torch.float32, generator=gen
        )
        self.q = torch.randn(2, 4, 8, generator=gen)

    def call(self, **kw):
        args = dict(q=self.q, k_cache=self.k, v_cache=self.v, block_tables=self.t, seq_lens=self.l)
        args.update(kw)
        return paged_decode_attention_ref(**args)

    def test_dtype_mismatch(self):
        with pytest.raises(TypeError, match="k_cache"):
            self.call(k_cache=self.k.half())

    def test_not_a_tensor(self):
        with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
            self.call(q=[1, 2])

    def test_bad_gqa_ratio(self):
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            self.call(q=torch.randn(2, 3, 8))

    def test_head_dim_mismatch(self):
        with pytest.raises(ValueError, match="head_dim"):
            self.call(q=torch.randn(2, 4, 6))

    def test_seq_len_too_long(self):
        with pytest.raises(ValueError, match="seq_lens must be <="):
            self.call(seq_lens=torch.tensor([500, 1], dtype=torch.int32))

    def test_negative_seq_len(self):
        with pytest.raises(ValueError, match=">= 0"):
            self.call(seq_lens=torch.tensor([-1, 1], dtype=torch.int32))

    def test_block_id_out_of_range(self):
        tables = self.t.clone()
        tables[0, 0] = 10_000
        with pytest.raises(ValueError, match="block id"):
            self.call(block_tables=tables)

    def test_bad_layout(self):
        with pytest.raises(ValueError, match="kv_layout"):
            self.call(kv_layout="blocked")

    def test_float_tables(self):
        with pytest.raises(TypeError, match="block_tables"):
            self.call(block_tables=self.t.float())

    def test_bad_scale(self):
        with pytest.raises(ValueError, match="sm_scale"):
            self.call(sm_scale=-1.0)
