"""``flashdec.LLM``'s FP8 KV scales (``kv_scales=``): dynamic ones calibrated from the first
request's prompt before it is queued, static ones, ones loaded from a file, per layer and KV
head in every layer group, in the prefix cache's hash root; and the argument checks."""

from __future__ import annotations

import functools

import pytest
import torch

import flashdec
from flashdec.kv_scales import KVScales, calibrate_kv_scales, load_kv_scales, static_kv_scales
from flashdec.models import build_random_model


@functools.cache
def _model(name: str):
    return build_random_model(name, dtype=torch.bfloat16, device="cpu", seed=0)


def _prompts(vocab: int, lens=(21, 9)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def _cache_scales(llm) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's K and V scales, ``[layers, Hkv]``, read layer by layer through its layout."""
    cache = llm.engine.cache
    pairs = [cache.layout.layer_kv_scales(i) for i in range(cache.num_layers)]
    return torch.stack([p[0].cpu() for p in pairs]), torch.stack([p[1].cpu() for p in pairs])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_dynamic_scales_come_from_the_first_prompt_and_stay(name):
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, kv_cache_dtype="fp8", max_batch_size=2)
    assert llm.kv_scales_in_use is None  # nothing calibrated before a request
    cache_k, cache_v = _cache_scales(llm)
    assert torch.equal(cache_k, torch.ones_like(cache_k)) and torch.equal(cache_v, cache_v * 0 + 1)
    first = llm.generate(prompts, 4)
    want = calibrate_kv_scales(model, prompts[0])
    got = llm.kv_scales_in_use
    assert got.source == "dynamic"
    torch.testing.assert_close(got.k, want.k, rtol=0, atol=0)
    torch.testing.assert_close(got.v, want.v, rtol=0, atol=0)
    # every layer of every group (a window model has two) reads its own row
    cache_k, cache_v = _cache_scales(llm)
    assert torch.equal(cache_k, want.k) and torch.equal(cache_v, want.v)
    assert len(set(want.k.flatten().tolist())) > 1  # per layer and head, not one number
    # later requests keep the scales: the same prompts give the same tokens
    llm.generate(_prompts(model.config.vocab_size, lens=(30,)), 3)
    assert torch.equal(llm.kv_scales_in_use.k, want.k)
    assert llm.generate(prompts, 4) == first


def test_saved_scales_load_back_and_give_the_same_tokens(tmp_path):
    model = _model("tiny-llama")
    prompts = _prompts(model.config.vocab_size)
    dynamic = flashdec.LLM(model, kv_cache_dtype="fp8", max_batch_size=2)
    tokens = dynamic.generate(prompts, 5)
    path = tmp_path / "kv_scales.safetensors"
    dynamic.save_kv_scales(path)
    loaded = flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=path, max_batch_size=2)
    assert loaded.kv_scales_in_use.source == str(path)
    assert torch.equal(loaded.kv_scales_in_use.k, dynamic.kv_scales_in_use.k)
    assert torch.equal(_cache_scales(loaded)[1], dynamic.kv_scales_in_use.v)  # before a request
    assert loaded.generate(prompts, 5) == tokens
    # a KVScales object is used as given
    given = load_kv_scales(path, model.config.num_hidden_layers, model.config.num_key_value_heads)
    direct = flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=given, max_batch_size=2)
    assert direct.generate(prompts, 5) == tokens


def test_static_scales_and_kv_scale_alone():
    model = _model("tiny-llama")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    for llm in (
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scale=0.25),
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales="static", kv_scale=0.25),
    ):
        scales = llm.kv_scales_in_use
        assert scales.source == "static" and scales.k.shape == (layers, heads)
        assert torch.equal(_cache_scales(llm)[0], torch.full((layers, heads), 0.25))
        llm.generate(_prompts(model.config.vocab_size)[:1], 2)
        assert torch.equal(_cache_scales(llm)[0], torch.full((layers, heads), 0.25))  # kept
    assert flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales="static").kv_scale == 1.0
    assert flashdec.LLM(model).kv_scales_in_use is None  # not FP8


def test_the_prefix_cache_hashes_with_the_calibrated_scales_and_still_hits():
    model = _model("tiny-llama")
    prompt = _prompts(model.config.vocab_size, lens=(40,))[0]
    llm = flashdec.LLM(model, kv_cache_dtype="fp8", max_batch_size=2)
    before = llm.engine.cache.prefix_cache.block_hashes(prompt)
    llm.generate([prompt], 2)
    after = llm.engine.cache.prefix_cache.block_hashes(prompt)
    assert before != after  # the root takes the scales
    queried = llm.prefix_cache_stats()["hit_tokens"]
    llm.generate([prompt], 2)  # the first prompt's blocks were hashed after calibration
    assert llm.prefix_cache_stats()["hit_tokens"] - queried >= 32


def test_bad_kv_scales_are_refused(tmp_path):
    model = _model("tiny-llama")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    with pytest.raises(ValueError, match="only with kv_cache_dtype='fp8'"):
        flashdec.LLM(model, kv_scales="dynamic")
    with pytest.raises(ValueError, match=r"kv_scale applies only with kv_scales=.static."):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales="dynamic", kv_scale=0.5)
    with pytest.raises(TypeError, match="kv_scales must be"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=1.0)
    with pytest.raises(ValueError, match="does not exist"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="must be 'dynamic', 'static', an existing"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales="dynamc")  # a typo, not a path
    with pytest.raises(ValueError, match="layers x"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=static_kv_scales(layers + 1, heads))
    wrong = KVScales(torch.ones(layers, heads + 1), torch.ones(layers, heads + 1), "static")
    with pytest.raises(ValueError, match="KV heads"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=wrong)
    with pytest.raises(RuntimeError, match="no FP8 KV scales"):
        flashdec.LLM(model, kv_cache_dtype="fp8").save_kv_scales(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_failed_calibration_queues_nothing_and_the_next_request_calibrates(monkeypatch):
    model = _model("tiny-llama")
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, kv_cache_dtype="fp8", max_batch_size=2)

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(flashdec.llm, "calibrate_kv_scales", fail)
    with pytest.raises(KeyboardInterrupt):
        llm.add_request(prompts[0], 3)
    assert llm.kv_scales_in_use is None and not llm.has_unfinished()
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0
    monkeypatch.undo()
    assert len(llm.generate(prompts, 3)[0]) == 3
    assert torch.equal(llm.kv_scales_in_use.k, calibrate_kv_scales(model, prompts[0]).k)


@pytest.mark.gpu
def test_calibrated_scales_reach_the_cuda_graphs_captured_before_them():
    """The warm start captures every graph before the first request calibrates: the scales are
    updated in place, so the graphs read them; the tokens equal an LLM that had the same scales
    from the start."""
    model = build_random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", seed=0)
    prompts = _prompts(model.config.vocab_size)
    dynamic = flashdec.LLM(model, kv_cache_dtype="fp8", max_batch_size=2)
    assert dynamic.warm_start is not None
    tokens = dynamic.generate(prompts, 8)
    assert dynamic.last_stats.graph_replays > 0
    scales = dynamic.kv_scales_in_use
    assert scales.source == "dynamic" and not torch.equal(scales.k, torch.ones_like(scales.k))
    given = flashdec.LLM(model, kv_cache_dtype="fp8", kv_scales=scales, max_batch_size=2)
    assert given.generate(prompts, 8) == tokens
    assert torch.equal(_cache_scales(given)[0], scales.k)
