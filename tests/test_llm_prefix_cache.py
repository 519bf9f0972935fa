"""Automatic prefix caching through ``flashdec.LLM`` (SPEC §8.7): greedy output with caching
on equals output with it off and transformers', for every family (window models included),
with real hits: a shared system prompt, a chat whose history grows, eviction under a small
pool and a hit again; a failure in a step whose requests share cached blocks changes nothing."""

from __future__ import annotations

import functools

import pytest
import torch

import flashdec
from tests.cache.helpers import cached_prefix_tokens
from tests.models.greedy import hf_greedy
from tests.test_llm import FAMILIES, _model
from tests.test_llm_failures import InjectedError, _bookkeeping, _instrument

NEW = 6


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def _system_prompts(vocab: int) -> list[list[int]]:
    system = _tokens(vocab, 37, 5)  # two full 16-token blocks and a partial one
    return [system + _tokens(vocab, n, 10 + n) for n in (3, 9, 20)]


@functools.cache
def _expected_system(name: str) -> list[list[int]]:
    model = _model(name)
    return hf_greedy(model, _system_prompts(model.config.vocab_size), NEW)


@pytest.mark.parametrize("name", FAMILIES)
def test_shared_system_prompt_hits_and_equals_transformers(name):
    model = _model(name)
    prompts = _system_prompts(model.config.vocab_size)
    off = flashdec.LLM(model, max_batch_size=4, enable_prefix_caching=False)
    assert off.generate(prompts, NEW) == _expected_system(name)
    assert off.prefix_cache_stats()["queried_tokens"] == 0
    llm = flashdec.LLM(model, max_batch_size=4)
    assert llm.enable_prefix_caching
    # the first request computes the system prompt; the others then start from its blocks
    assert llm.generate(prompts[:1], NEW) == _expected_system(name)[:1]
    assert llm.generate(prompts[1:], NEW) == _expected_system(name)[1:]
    stats = llm.prefix_cache_stats()
    assert stats["hit_tokens"] == 2 * 32  # both later prompts: the system prompt's full blocks
    assert stats["queried_tokens"] == sum(map(len, prompts))
    assert stats["hit_rate"] == pytest.approx(64 / sum(map(len, prompts)))
    assert stats["cached_blocks"] > 0 and stats["evicted_blocks"] == 0
    cache = llm.engine.cache
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks  # cached blocks count as free


@pytest.mark.parametrize("name", FAMILIES)
def test_concurrent_requests_share_blocks_computed_in_the_same_batch(name):
    """Requests that arrive while their prefix is still being imported (a 7-token step budget:
    the first prompt comes in chunks) get what is already committed, and the output is still
    transformers'."""
    model = _model(name)
    prompts = _system_prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, max_batch_size=4, max_num_batched_tokens=7)
    assert llm.generate(prompts, NEW) == _expected_system(name)
    llm.engine.cache.validate_invariants()


@pytest.mark.parametrize("name", FAMILIES)
def test_multi_turn_chat_hits_its_history(name):
    model = _model(name)
    vocab = model.config.vocab_size
    llm = flashdec.LLM(model, max_batch_size=2)
    history = _tokens(vocab, 21, 3)
    hits = []
    for turn in range(3):
        before = llm.prefix_cache_stats()["hit_tokens"]
        (out,) = llm.generate([history], NEW)
        assert out == hf_greedy(model, [history], NEW)[0]
        hits.append(llm.prefix_cache_stats()["hit_tokens"] - before)
        history = history + out + _tokens(vocab, 11, 20 + turn)
    # each later turn finds at least the previous prompt's full blocks
    assert hits[0] == 0 and hits[1] >= 16 and hits[2] > hits[1]
    llm.engine.cache.validate_invariants()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_finished_answer_is_cached_for_the_next_turn(name):
    """The K/V of prompt + answer (all but the answer's last token, which has none) stays
    cached when a request finishes: the next turn hits through the answer, not only through
    the previous prompt."""
    model = _model(name)
    vocab = model.config.vocab_size
    first = _tokens(vocab, 30, 7)  # 1 full block; + 9 answer tokens with K/V: 39 -> 2 blocks
    llm = flashdec.LLM(model, max_batch_size=2)
    off = flashdec.LLM(model, max_batch_size=2, enable_prefix_caching=False)
    (answer,) = llm.generate([first], 10, ignore_eos=True)
    assert answer == hf_greedy(model, [first], 10, ignore_eos=True)[0]
    assert llm.prefix_cache_stats()["cached_blocks"] >= 2  # every group: the answer's block too
    second = first + answer + _tokens(vocab, 5, 8)
    (out,) = llm.generate([second], NEW, ignore_eos=True)
    assert llm.prefix_cache_stats()["hit_tokens"] == 32  # the prompt alone would give 16
    assert out == off.generate([second], NEW, ignore_eos=True)[0]
    assert out == hf_greedy(model, [second], NEW, ignore_eos=True)[0]
    cache = llm.engine.cache
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral-swa"])
def test_eviction_under_a_small_pool_then_a_hit_again(name):
    model = _model(name)
    vocab = model.config.vocab_size
    a, b, c = (_tokens(vocab, 40, s) for s in (1, 2, 3))
    llm = flashdec.LLM(model, max_batch_size=1, num_blocks=6, max_model_len=64)
    cache = llm.engine.cache
    expected = hf_greedy(model, [a, b, c], NEW)
    assert llm.generate([a], NEW) == expected[:1]
    assert llm.generate([b], NEW) == expected[1:2]  # a's blocks go, least recently used first
    assert llm.generate([c], NEW) == expected[2:]
    stats = llm.prefix_cache_stats()
    assert stats["evicted_blocks"] > 0 and stats["hit_tokens"] == 0
    cache.validate_invariants()
    assert llm.generate([c], NEW) == expected[2:]  # c is still cached: a hit
    assert llm.prefix_cache_stats()["hit_tokens"] == 32
    assert llm.generate([a], NEW) == expected[:1]  # recomputed, same tokens
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks


def test_rejected_calls_change_nothing():
    llm = flashdec.LLM(_model("tiny-llama"), max_batch_size=2)
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        flashdec.LLM(_model("tiny-llama"), enable_prefix_caching=1)
    prompt = _tokens(llm.adapter.spec.vocab_size, 40, 1)
    llm.generate([prompt], NEW)
    cache = llm.engine.cache
    cache.add_request("x")
    before = (cache.metrics(), cache.prefix_cache.stats(), cache.seq_len("x"))
    hashes = cache.prefix_cache.block_hashes(prompt)
    with pytest.raises(TypeError, match="list of bytes"):
        cache.prefix_cache.attach_cached_prefix("x", [1, 2], 40)
    with pytest.raises(ValueError, match="cover every hashed block"):
        cache.prefix_cache.attach_cached_prefix("x", hashes, 16)
    with pytest.raises(ValueError, match="unknown"):
        cache.prefix_cache.attach_cached_prefix("nope", hashes, 40)
    with pytest.raises(RuntimeError, match="no block hashes"):
        cache.prefix_cache.cache_request_blocks("x")
    assert (cache.metrics(), cache.prefix_cache.stats(), cache.seq_len("x")) == before
    assert cached_prefix_tokens(cache, hashes, 40) == 32  # reads only
    assert cache.prefix_cache.attach_cached_prefix("x", hashes, 40) == 32
    with pytest.raises(RuntimeError, match="already"):
        cache.prefix_cache.attach_cached_prefix("x", hashes, 40)
    cache.validate_invariants()
    cache.cancel_request("x")
    cache.validate_invariants()
    off = flashdec.PagedKVCache(1, 1, 4, 4, 4, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="prefix caching is off"):
        off.prefix_cache.block_hashes([1, 2, 3, 4])


def test_a_failure_in_a_step_sharing_cached_blocks_changes_nothing(monkeypatch):
    """Two requests hit a cached prompt; a failure at every point of each step (scheduling,
    prompt chunks over the shared blocks, decode layers, sampling, commit) leaves every
    request, the pool and the cache's index as they were, and the tokens are an uninterrupted
    run's."""
    model = _model("tiny-llama")
    system = _tokens(model.config.vocab_size, 34, 9)
    prompts = [[*system, 5, 6, 7], [*system, 8, 9]]
    expected = hf_greedy(model, prompts, 3)
    llm = flashdec.LLM(model, max_batch_size=4, num_blocks=32, max_model_len=64)
    llm.generate([system], 2)  # caches the system prompt's two full blocks
    injector, hooks = _instrument(llm, monkeypatch)
    cache = llm.engine.cache

    def state():
        stats = cache.prefix_cache.stats()
        return _bookkeeping(llm), stats["cached_blocks"], stats["evictable_blocks"]

    try:
        rids = [llm.add_request(p, 3) for p in prompts]
        failures = 0
        while llm.has_unfinished():
            offset = 0
            while True:
                before = state()
                injector.arm(offset)
                try:
                    llm.step()
                except (KeyboardInterrupt, InjectedError):
                    assert state() == before, f"after a failure at {injector.where[-1]}"
                    cache.validate_invariants()
                    failures += 1
                    offset += 1
                    continue
                injector.left = None
                break
    finally:
        for hook in hooks:
            hook.remove()
    assert [llm.release(r) for r in rids] == expected
    assert failures > 10
    assert llm.prefix_cache_stats()["hit_tokens"] == 2 * 32
    cache.validate_invariants()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_prefix_caching_with_cuda_graphs_equals_caching_off(name):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run scripts/gpu_check.sh there)")
    model = flashdec.models.build_random_model(name, dtype=torch.float32, device="cuda", seed=0)
    prompts = _system_prompts(model.config.vocab_size)
    off = flashdec.LLM(model, max_batch_size=4, enable_prefix_caching=False, cuda_graphs=True)
    expected = off.generate(prompts, NEW)
    on = flashdec.LLM(model, max_batch_size=4, cuda_graphs=True)
    assert on.generate(prompts[:1], NEW) + on.generate(prompts[1:], NEW) == expected
    assert on.prefix_cache_stats()["hit_tokens"] == 2 * 32
    on.engine.cache.validate_invariants()


def _one_token_steps(llm) -> list:
    """Spy: the prompt inputs of every decode step that carried one-token prompt chunks."""
    runner, seen = llm._runner, []
    decode = runner.decode

    def spy(batch, *, prompt_inputs=None, sampled=None):
        if prompt_inputs is not None:
            seen.append((len(batch), prompt_inputs.shape[0], sampled))
        return decode(batch, prompt_inputs=prompt_inputs, sampled=sampled)

    runner.decode = spy
    return seen


@pytest.mark.parametrize("name", FAMILIES)
def test_prompts_a_hit_leaves_one_token_ride_the_decode_step(name):
    """A prompt one token past its cached full blocks brings that token alone: the step whose
    prompt chunks are all one token is a decode step (on a GPU: a captured graph, not an eager
    step of its own row count, which would build a kernel while serving). Output unchanged."""
    model = _model(name)
    vocab = model.config.vocab_size
    prompts = [_tokens(vocab, 16 * k + 1, 40 + k) for k in (1, 2, 3)]  # 1 past a block
    llm = flashdec.LLM(model, max_batch_size=4)
    want = hf_greedy(model, prompts, NEW, ignore_eos=True)
    assert llm.generate(prompts, NEW, ignore_eos=True) == want
    seen = _one_token_steps(llm)
    assert llm.generate(prompts, NEW, ignore_eos=True) == want  # every prompt hits
    assert seen and all(sampled is None for _, _, sampled in seen)  # each ends its prompt
    assert sum(chunks for _, chunks, _ in seen) == len(prompts)
    llm.engine.cache.validate_invariants()


def test_one_token_chunks_inside_a_prompt_get_no_token():
    """A step budget that leaves one token for a prompt mid-way (3 decode rows + 1) runs the
    step as a decode step too; only the rows that end a prompt (and the decode rows) get a
    token, and sampled requests draw exactly as with a roomy budget (their own generators)."""
    model = _model("tiny-llama")
    vocab = model.config.vocab_size
    prompts = [_tokens(vocab, n, 60 + n) for n in (5, 6, 7, 29)]
    hot = flashdec.SamplingParams(temperature=1.2, seed=5)

    def run(budget):
        llm = flashdec.LLM(
            model, max_batch_size=4, max_num_batched_tokens=budget, enable_prefix_caching=False
        )
        seen = _one_token_steps(llm)
        rids = [
            llm.add_request(p, NEW, ignore_eos=True, sampling=hot if i == 1 else None)
            for i, p in enumerate(prompts)
        ]
        while llm.has_unfinished():
            llm.step()
        return [llm.poll(r)[0] for r in rids], seen

    tight, seen = run(4)
    roomy, _ = run(64)
    assert tight == roomy
    assert tight[0] == hf_greedy(model, [prompts[0]], NEW, ignore_eos=True)[0]
    assert any(sampled is not None for _, _, sampled in seen)  # a chunk inside a prompt
