"""DecoderAdapter + a dense K/V store generates exactly transformers' greedy tokens (CPU, fp32)."""

from __future__ import annotations

import functools

import pytest
import torch

from flashdec.models import BUILTIN_SHAPES, DecoderAdapter, build_random_model, random_model
from tests.models.greedy import DenseKV, flashdec_greedy, hf_greedy

FAMILY_SHAPES = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-qwen3",
    "tiny",
    "tiny-qwen2-swa",
    "tiny-mistral-swa",
]
PROMPT_LENS = (5, 17, 33)
MAX_NEW_TOKENS = 16


@functools.cache
def _model(name: str):
    return build_random_model(name, dtype=torch.float32, device="cpu", seed=0)


def _prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


@functools.cache
def _hf_tokens(name: str) -> list[list[int]]:
    model = _model(name)
    return hf_greedy(model, _prompts(model.config.vocab_size), MAX_NEW_TOKENS)


@pytest.mark.parametrize("name", FAMILY_SHAPES)
def test_greedy_tokens_equal_transformers(name):
    model = _model(name)
    ours = flashdec_greedy(DecoderAdapter(model), _prompts(model.config.vocab_size), MAX_NEW_TOKENS)
    assert ours == _hf_tokens(name)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_fused_kernels_path_generates_the_same_tokens(name):
    """The CUDA fast path (residual+RMSNorm, SiLU×up kernels), here through the interpreter."""
    model = _model(name)
    adapter = DecoderAdapter(model, fused_kernels=True)
    assert adapter.fused_kernels
    # the interpreter runs every program of every launch in Python: two prompts, 8 steps
    steps, prompts = 8, _prompts(model.config.vocab_size)[:2]
    ours = flashdec_greedy(adapter, prompts, steps)
    assert ours == [tokens[:steps] for tokens in _hf_tokens(name)[:2]]


@pytest.mark.parametrize("shift", [1, -1])
def test_comparison_has_teeth(shift):
    """Negative control: decoding at positions off by one no longer matches transformers."""
    model = _model("tiny-llama")
    prompts = _prompts(model.config.vocab_size)
    assert flashdec_greedy(DecoderAdapter(model), prompts, MAX_NEW_TOKENS, shift) != _hf_tokens(
        "tiny-llama"
    )


@pytest.mark.parametrize("name", FAMILY_SHAPES)
def test_prefill_kv_and_logits_match_transformers(name):
    """Prompt K/V are bit-identical to transformers' own cache (fp32 CPU: same float32 ops),
    the last logits equal within float32 noise; the sink sees each layer once, in order."""
    model = _model(name)
    adapter = DecoderAdapter(model)
    spec = adapter.spec
    ids = torch.tensor(_prompts(spec.vocab_size, lens=(23,))[0])
    calls = []
    logits = adapter.prefill(ids, lambda i, k, v: calls.append((i, k.clone(), v.clone())))
    assert [i for i, _, _ in calls] == list(range(spec.num_layers))
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    for i, k, v in calls:
        assert k.shape == v.shape == (23, spec.num_kv_heads, spec.head_dim)
        assert k.dtype == v.dtype == spec.dtype
        # a sliding-window layer of transformers' cache keeps only the window's tail
        cache = out.past_key_values.layers[i]
        kept = cache.keys.shape[2]
        assert kept == 23 or kept < 23 <= 2 * spec.layer_windows[i]
        assert torch.equal(k[-kept:], cache.keys[0].transpose(0, 1))
        assert torch.equal(v[-kept:], cache.values[0].transpose(0, 1))
    assert logits.shape == (spec.vocab_size,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, out.logits[0, -1], atol=1e-5, rtol=1e-5)


def test_decode_logits_match_transformers_step_by_step():
    """Teacher-forced: each decode step's logits equal transformers' incremental forward."""
    model = _model("tiny-qwen3")
    adapter = DecoderAdapter(model)
    prompt = _prompts(adapter.spec.vocab_size, lens=(9,))[0]
    store = DenseKV(adapter.spec, 1, 32)
    adapter.prefill(torch.tensor(prompt), store.sink(0))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        for token in (7, 200, 31, 31):
            ours = adapter.decode(torch.tensor([token]), store.attention)
            store.seq_lens += 1
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            torch.testing.assert_close(ours[0], out.logits[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_llama_with_every_bias(fused):
    """attention_bias (q/k/v/o) and mlp_bias: each projection's own bias, made non-zero."""
    config = BUILTIN_SHAPES["tiny-llama"].make_config()
    config.attention_bias = config.mlp_bias = True
    model = random_model(config, dtype=torch.float32, device="cpu", seed=2)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    prompts = _prompts(config.vocab_size, lens=(5, 12))
    ours = flashdec_greedy(DecoderAdapter(model, fused_kernels=fused), prompts, 8)
    assert ours == hf_greedy(model, prompts, 8)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_fused_weights_keep_the_tokens_and_the_memory(name):
    """q/k/v and gate/up fused into one tensor each: the model's own parameters become views of
    them (no weight stored twice), transformers still runs the model, the tokens are unchanged."""
    model = build_random_model(name, dtype=torch.float32, device="cpu", seed=0)
    before = sum(p.numel() for p in model.parameters())
    adapter = DecoderAdapter(model, fuse_weights=True)
    layer = adapter._layers[0]
    attn = model.model.layers[0].self_attn
    storage = layer.qkv_weight.untyped_storage().data_ptr()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == storage
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    assert sum(storages.values()) == before * 4  # every parameter stored exactly once
    prompts = _prompts(model.config.vocab_size)
    assert flashdec_greedy(adapter, prompts, MAX_NEW_TOKENS) == _hf_tokens(name)
    assert hf_greedy(model, prompts, MAX_NEW_TOKENS) == _hf_tokens(name)  # the model still works
