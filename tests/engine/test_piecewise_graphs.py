"""Piecewise graphs of a mixed step (``flashdec.engine.piecewise_graphs``): the dense work per
token bucket on fixed, padded buffers, attention on the real rows in between. On the CPU the
pieces run eagerly on the same buffers (``capture=False``), which checks the padding and the
slicing; the GPU tests replay captured graphs."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import flashdec
from flashdec.engine.piecewise_graphs import TOKEN_BUCKETS, PiecewiseGraphs
from flashdec.models import DecoderAdapter, build_random_model


def _causal(spec):
    """Causal attention over the step's own rows (enough to see any row mix-up)."""

    def attend(layer, q, k, v):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=spec.num_q_heads != spec.num_kv_heads,
        )
        return out[0].transpose(0, 1).contiguous()

    return attend


def test_token_buckets_grow_by_sixteens_and_stop_at_1024():
    assert list(TOKEN_BUCKETS) == sorted(set(TOKEN_BUCKETS))
    assert TOKEN_BUCKETS[0] == 16 and TOKEN_BUCKETS[-1] == 1024
    assert all(b % 16 == 0 for b in TOKEN_BUCKETS)
    # padding stays under a quarter of the step above 64 tokens, where GEMMs grow compute-bound
    assert all(b / a <= 1.25 for a, b in itertools.pairwise(TOKEN_BUCKETS[3:]))


@pytest.mark.parametrize("fuse_weights", [False, True], ids=["separate", "fused-qkv"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2"])
def test_padded_pieces_give_the_eager_layers_numbers(name, fuse_weights):
    """Steps of 1..40 tokens, larger then smaller in one bucket (stale padding rows left by
    the larger one): the logits equal the adapter's own forward. With fused weights (the GPU's
    layout) the q/k/v GEMM writes into the shared buffer (bias: Qwen2; head norms: Qwen3)."""
    model = build_random_model(name, dtype=torch.float32, device="cpu", seed=0)
    adapter = DecoderAdapter(model, fuse_weights=fuse_weights)
    graphs = PiecewiseGraphs(adapter, max_tokens=64, capture=False)
    assert graphs.buckets == (16, 32, 48, 64)  # 64 holds the budget: nothing above it
    attend = _causal(adapter.spec)
    gen = torch.Generator().manual_seed(1)
    for num_tokens in (40, 17, 1, 16, 7, 33, 64):
        ids = torch.randint(0, adapter.spec.vocab_size, (num_tokens,), generator=gen)
        rows = torch.tensor([0, num_tokens - 1])
        want = adapter.decode(ids, attend, logits_rows=rows)
        got = adapter.decode(ids, attend, logits_rows=rows, layers=graphs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphs.replays == 0  # nothing captured on the CPU


def test_padding_rows_never_reach_the_real_rows():
    """Every dense op is row-wise: NaN in the padding rows' attention and ids of another token
    leave the real rows' logits as they are."""
    adapter = DecoderAdapter(build_random_model("tiny-llama", device="cpu", seed=0))
    graphs = PiecewiseGraphs(adapter, max_tokens=32, capture=False)
    attend = _causal(adapter.spec)
    ids = torch.arange(1, 21)
    rows = torch.arange(20)
    want = adapter.decode(ids, attend, logits_rows=rows, layers=graphs)
    state = graphs._states[32]
    state.buffers.ids[20:].fill_(adapter.spec.vocab_size - 1)

    def poisoned(layer, q, k, v):  # every layer's padding rows NaN once attention is in
        out = attend(layer, q, k, v)
        state.buffers.attention[20:].fill_(float("nan"))
        return out

    got = adapter.decode(ids, poisoned, logits_rows=rows, layers=graphs)
    assert torch.equal(got, want)
    assert state.outputs[-1][0][20:].isnan().any()  # the padding did carry NaN through


def test_every_bucket_and_layer_views_one_set_of_buffers():
    """What outlives a piece is not allocated per bucket or per layer: q/k/v of every layer
    and the residual stream of every bucket are views of the largest bucket's buffers."""
    adapter = DecoderAdapter(build_random_model("tiny-llama", device="cpu", seed=0))
    graphs = PiecewiseGraphs(adapter, max_tokens=48, capture=False)
    attend = _causal(adapter.spec)
    for num_tokens in (48, 20, 9):
        adapter.decode(torch.arange(1, num_tokens + 1), attend, layers=graphs)
    states = [graphs._states[b] for b in (48, 32, 16)]
    qkv_at = {s.outputs[i][0].data_ptr() for s in states for i in range(graphs.num_layers)}
    residual_at = {s.outputs[0][-1].data_ptr() for s in states}  # the embedding's output
    assert qkv_at == {graphs._buffers.qkv.data_ptr()}
    assert residual_at == {graphs._buffers.residual.data_ptr()}
    assert graphs._buffers.qkv.shape[0] == 48


def test_a_step_above_the_largest_bucket_does_not_fit_and_is_refused():
    adapter = DecoderAdapter(build_random_model("tiny-llama", device="cpu", seed=0))
    graphs = PiecewiseGraphs(adapter, max_tokens=40, capture=False)
    assert graphs.buckets == (16, 32, 48)  # up to the first bucket that holds the budget
    assert graphs.fits(48) and not graphs.fits(49)
    with pytest.raises(ValueError, match="exceeds the largest bucket 48"):
        graphs.layers_forward(torch.zeros(49, dtype=torch.long), _causal(adapter.spec))
    captured = PiecewiseGraphs(adapter, max_tokens=40)  # nothing captured yet
    assert not captured.fits(16)
    assert PiecewiseGraphs(adapter, max_tokens=10).buckets == (16,)  # a budget below 16
    assert PiecewiseGraphs(adapter, max_tokens=5000).buckets == TOKEN_BUCKETS


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral-swa", "tiny-qwen3"])
def test_chunked_prompts_through_the_pieces_decode_the_same_tokens(name):
    """The runner's mixed steps (prompt chunks beside decode rows, attention by the engine over
    the paged cache) on the padded pieces: the same tokens as without them."""
    model = build_random_model(name, dtype=torch.float32, device="cpu", seed=0)
    options = dict(max_batch_size=4, max_num_batched_tokens=48, cuda_graphs=False)
    plain = flashdec.LLM(model, **options)
    pieces = flashdec.LLM(model, **options)
    runner = pieces._runner
    assert runner.mixed_graphs is None  # no CUDA graphs: no pieces by default
    runner.mixed_graphs = PiecewiseGraphs(pieces.adapter, max_tokens=48, capture=False)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (70, 5, 23, 41)]
    assert pieces.generate(prompts, 12, ignore_eos=True) == plain.generate(
        prompts, 12, ignore_eos=True
    )
    assert runner.mixed_graphs._states  # the mixed steps ran on the pieces


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("yes", TypeError, "mixed_step_graphs must be a bool or None"),
        (1, TypeError, "mixed_step_graphs must be a bool or None"),
        (True, ValueError, "mixed_step_graphs=True needs cuda_graphs=True"),
    ],
)
def test_llm_rejects_bad_mixed_step_graphs_before_touching_the_model(value, error, match):
    model = build_random_model("tiny-llama", device="cpu", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        flashdec.LLM(model, cuda_graphs=False, mixed_step_graphs=value)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(after[k].equal(v) for k, v in before.items())


def _tiny_cuda():
    return build_random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", seed=0)


@pytest.mark.gpu
def test_gpu_mixed_steps_replay_the_piecewise_graphs_of_the_warm_start():
    """Every token bucket's graphs are captured before the first request; mixed steps then
    replay them (no eager dense step below the budget) and decode what eager mixed steps do."""
    model = _tiny_cuda()
    options = dict(max_batch_size=8, max_model_len=512, max_num_batched_tokens=256)
    graphed = flashdec.LLM(model, **options)
    eager = flashdec.LLM(model, **options, mixed_step_graphs=False)
    assert eager._runner.mixed_graphs is None
    pieces = graphed._runner.mixed_graphs
    warm = pieces.warm_start
    assert warm.buckets == pieces.buckets and warm.buckets[-1] == 256
    assert warm.graphs == len(warm.buckets) * (pieces.num_layers + 1)
    assert all(pieces.fits(n) for n in (1, 17, 255, 256)) and not pieces.fits(257)
    # the captured GEMMs write q/k/v into the one shared buffer (no per-piece results kept)
    states = pieces._states.values()
    qkv_at = {s.outputs[i][0].data_ptr() for s in states for i in range(pieces.num_layers)}
    assert qkv_at == {pieces._buffers.qkv.data_ptr()}
    assert warm.memory_bytes > 0
    replays = pieces.replays  # the warm start's own mixed steps replay them too
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    for lens in ([300], [5, 17, 33], [2, 255, 100, 64, 3, 31, 16, 7]):
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
        assert graphed.generate(prompts, 24, ignore_eos=True) == eager.generate(
            prompts, 24, ignore_eos=True
        )
    assert pieces.replays > replays
    graphed.engine.cache.validate_invariants()
