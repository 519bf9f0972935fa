"""The host tier of automatic prefix caching through ``flashdec.LLM(host_kv_cache_gib=)``: a
prompt whose cached blocks the small GPU pool evicted is served from the host tier, and the
tokens are transformers' (and the same as with the tier off), for every family; a copy that
fails at any point falls back to recomputing with the same tokens; bad sizes are clear errors."""

from __future__ import annotations

import functools

import pytest

import flashdec
from tests.models.greedy import hf_greedy
from tests.test_llm import FAMILIES, _model
from tests.test_llm_prefix_cache import _tokens

NEW = 6
HOST_GIB = 0.001  # 65-262 blocks of a tiny model: every evicted block fits


@functools.cache
def _prompts(name: str) -> tuple[list[int], ...]:
    vocab = _model(name).config.vocab_size
    return tuple(_tokens(vocab, 40, s) for s in (1, 2, 3, 4))


@functools.cache
def _expected(name: str) -> list[list[int]]:
    return hf_greedy(_model(name), list(_prompts(name)), NEW)


def _llm(name: str, **kw) -> flashdec.LLM:
    return flashdec.LLM(_model(name), max_batch_size=1, num_blocks=6, max_model_len=64, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_an_evicted_prompt_is_served_from_the_host_tier(name):
    a, *others = _prompts(name)
    expected = _expected(name)
    llm = _llm(name, host_kv_cache_gib=HOST_GIB)
    cache = llm.engine.cache
    for prompt, tokens in zip(_prompts(name), expected, strict=True):
        assert llm.generate([prompt], NEW) == [tokens]  # a's blocks go down to the host
    stats = llm.prefix_cache_stats()
    assert stats["evicted_blocks"] > 0 and stats["host"]["blocks_down"] > 0
    assert stats["hit_tokens"] == 0
    assert llm.generate([a], NEW) == expected[:1]  # a again: its blocks come back up
    stats = llm.prefix_cache_stats()
    assert stats["host_hit_tokens"] > 0 and stats["hit_tokens"] == 32
    host = stats["host"]
    assert host["blocks_up"] > 0 and host["failed_up"] == host["failed_down"] == 0
    pools = [cache.layout._group(g).block_cache.host for g in range(len(cache.kv_groups))]
    assert host["bytes_up"] == sum(p.blocks_up * p.block_bytes for p in pools)
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks
    off = _llm(name)
    for prompt in (a, *others, a):
        off.generate([prompt], NEW)
    assert off.prefix_cache_stats()["hit_tokens"] < 32  # a partly recomputed without the tier


@pytest.mark.parametrize("direction", ["down", "up"])
def test_a_failed_copy_recomputes_with_the_same_tokens(monkeypatch, direction):
    name = "tiny-llama"
    expected = _expected(name)
    llm = _llm(name, host_kv_cache_gib=HOST_GIB)
    pool = llm.engine.cache.layout._group(0).block_cache.host

    def broken(*args):
        raise RuntimeError(f"injected: copy {direction} failed")

    monkeypatch.setattr(pool.transfer, direction, broken)
    for prompt, tokens in zip(_prompts(name), expected, strict=True):
        assert llm.generate([prompt], NEW) == [tokens]
    assert llm.generate([_prompts(name)[0]], NEW) == expected[:1]
    stats = llm.prefix_cache_stats()
    assert stats["host_hit_tokens"] == 0
    assert stats["host"][f"failed_{direction}"] > 0
    llm.engine.cache.validate_invariants()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"host_kv_cache_gib": -1.0}, ValueError, ">= 0"),
        ({"host_kv_cache_gib": float("nan")}, ValueError, "finite"),
        ({"host_kv_cache_gib": "1"}, TypeError, "must be a number"),
        ({"host_kv_cache_gib": 1.0, "enable_prefix_caching": False}, ValueError, "needs"),
        ({"host_kv_cache_gib": 1e9}, ValueError, "host memory available"),
    ],
)
def test_bad_host_sizes_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        _llm("tiny-llama", **kwargs)
