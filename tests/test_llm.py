"""``flashdec.LLM``: tokens equal transformers' greedy ``generate`` through the whole runtime
(paged cache, engine, serving loop) on the CPU, for every supported family — batched, with
staggered arrivals, across block boundaries — and the API's checks."""

from __future__ import annotations

import functools

import pytest
import torch

import flashdec
from flashdec.models import build_random_model
from tests.models.greedy import hf_greedy
from tests.models.test_loading import _save_tokenizer

# the -swa shapes have 16-token sliding windows (Qwen2: every other layer; Mistral: all layers)
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen3", "tiny-qwen2-swa",
            "tiny-mistral-swa"]  # fmt: skip
PROMPT_LENS = (5, 17, 33)  # 5 + 16 new tokens crosses the first 16-token block boundary
NEW = 16


@functools.cache
def _model(name: str):
    return build_random_model(name, dtype=torch.float32, device="cpu", seed=0)


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@functools.cache
def _expected(name: str) -> list[list[int]]:
    model = _model(name)
    return hf_greedy(model, _prompts(model.config.vocab_size), NEW)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_generate_equals_transformers(name):
    model = _model(name)
    llm = flashdec.LLM(model, max_batch_size=4)
    assert llm.generate(_prompts(model.config.vocab_size), NEW) == _expected(name)
    stats = llm.last_stats
    assert stats.num_requests == 3 and stats.generated_tokens == sum(map(len, _expected(name)))
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0  # every block went back
    llm.engine.cache.validate_invariants()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_staggered_arrivals_join_the_running_batch(name):
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, max_batch_size=2, block_size=8)  # at most 2 run at once
    rids = {0: llm.add_request(prompts[0], NEW)}
    steps = 0
    batches = []
    while llm.has_unfinished() or len(rids) < 3:
        if steps == 3:
            rids[1] = llm.add_request(prompts[1], NEW)
        if steps == 5:
            rids[2] = llm.add_request(prompts[2], NEW)
        if llm.has_unfinished():
            record = llm.step()  # None: only the last step's tokens were collected
            batches.append(len(record.served) if record else 0)
        steps += 1
    assert max(batches) == 2  # requests joined a running batch, the third waited its turn
    assert [llm.output(rids[i]) for i in range(3)] == _expected(name)


@pytest.mark.parametrize("name", ["tiny-qwen2-swa", "tiny-mistral-swa"])
def test_sliding_window_layers_hold_bounded_blocks(name):
    """Windowed layers live in their own KV group: exact tokens with staggered arrivals, and a
    request never holds more than ceil(window / block_size) + 1 of that group's blocks."""
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, max_batch_size=2, block_size=4)
    cache = llm.engine.cache
    window_groups = [g for g, spec in enumerate(cache.kv_groups) if spec.window is not None]
    assert window_groups and all(cache.kv_groups[g].window == 16 for g in window_groups)
    rids = [llm.add_request(prompts[0], NEW)]
    peak = {g: 0 for g in window_groups}
    steps = 0
    while llm.has_unfinished() or len(rids) < 3:
        if steps in (2, 4):
            rids.append(llm.add_request(prompts[len(rids)], NEW))
        if llm.has_unfinished():
            llm.step()
            groups = cache.metrics()["groups"]
            for g in window_groups:
                peak[g] = max(peak[g], groups[g]["max_blocks_per_request"])
            cache.validate_invariants()
        steps += 1
    assert [llm.output(r) for r in rids] == _expected(name)
    # 33 + 16 tokens would take 13 blocks of 4 without the window
    assert all(0 < blocks <= 16 // 4 + 1 for blocks in peak.values()), peak


def test_triton_kernels_through_the_interpreter_give_the_same_tokens():
    """The GPU path (fused RoPE+append, split-KV decode), interpreted on the CPU."""
    model = _model("tiny-qwen2")
    prompts = _prompts(model.config.vocab_size)[:2]
    llm = flashdec.LLM(model, max_batch_size=2, append_backend="fused", decode_backend="triton")
    assert (llm.engine.append_backend, llm.engine.decode_backend) == ("fused", "triton")
    assert llm.generate(prompts, 6) == [t[:6] for t in _expected("tiny-qwen2")[:2]]


def test_sliding_window_through_the_interpreter_gives_the_same_tokens():
    """Windowed decode kernels (interpreted) on prompts longer than the window."""
    model = _model("tiny-mistral-swa")
    prompts = _prompts(model.config.vocab_size)[1:]  # 17 and 33 tokens, window 16
    llm = flashdec.LLM(model, max_batch_size=2, block_size=8, append_backend="fused",
                       decode_backend="triton")  # fmt: skip
    assert llm.generate(prompts, 4) == [t[:4] for t in _expected("tiny-mistral-swa")[1:]]


def test_eos_stops_a_sequence_unless_ignored():
    model = _model("tiny-llama")
    prompt = _prompts(model.config.vocab_size)[0]
    free_run = flashdec.LLM(model).generate([prompt], NEW, ignore_eos=True)[0]
    eos = free_run[3]
    model.generation_config.eos_token_id = eos
    try:
        llm = flashdec.LLM(model)
        stopped = llm.generate([prompt], NEW)[0]
        assert stopped == free_run[: free_run.index(eos) + 1]
        assert llm.generate([prompt], NEW, ignore_eos=True)[0] == free_run
    finally:
        model.generation_config.eos_token_id = None


def test_one_new_token_and_sampling():
    model = _model("tiny-llama")
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model)
    assert llm.generate(prompts, 1) == [t[:1] for t in _expected("tiny-llama")]
    a = llm.generate(prompts, 8, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    b = llm.generate(prompts, 8, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert a == b and a != llm.generate(prompts, 8)  # reproducible, and not greedy
    assert all(len(t) == 8 for t in a)


def test_model_directory_with_a_tokenizer(tmp_path):
    model = _model("tiny-llama")
    model.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    llm = flashdec.LLM(str(tmp_path))
    assert llm.tokenizer is not None
    text_out = llm.generate("hello world", 4, ignore_eos=True)
    ids = llm.tokenizer("hello world")["input_ids"]
    assert text_out == [hf_greedy(model, [ids], 4)[0]]


def test_rejected_calls_change_nothing():
    model = _model("tiny-llama")
    llm = flashdec.LLM(model, max_model_len=64)
    vocab = model.config.vocab_size
    for bad, exc in (
        ([[vocab]], ValueError),  # id out of range
        ([[]], ValueError),
        ([[1] * 60], ValueError),  # 60 + 16 > max_model_len
        ("text", ValueError),  # no tokenizer
        ([[1.5]], TypeError),
        ([], TypeError),
    ):
        with pytest.raises(exc):
            llm.generate(bad, NEW)
        assert llm.loop.idle and llm.engine.cache.metrics()["num_requests"] == 0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2]], 4, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate([[1, 2]], 0)
    assert llm.engine.cache.metrics()["num_requests"] == 0


def test_construction_checks():
    model = _model("tiny-llama")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        flashdec.LLM(42)
    with pytest.raises(ValueError, match="does not exist"):
        flashdec.LLM("/no/such/model/dir")
    with pytest.raises(ValueError, match="cuda_graphs"):
        flashdec.LLM(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        flashdec.LLM(model, max_model_len=10**6)
    with pytest.raises(ValueError, match="num_blocks"):
        flashdec.LLM(model, num_blocks=0)


def test_unsupported_architecture_fails_at_construction():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"(?i)mixtral|expert"):
        flashdec.LLM(MixtralForCausalLM(config))
