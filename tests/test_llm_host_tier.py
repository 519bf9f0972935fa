"""The host tier of automatic prefix caching through ``flashdec.LLM(host_kv_cache_gib=)``: a
prompt whose cached blocks the small GPU pool evicted is served from the host tier, and the
tokens are transformers' (and the same as with the tier off), for every family; a copy that
fails at any point falls back to recomputing with the same tokens; a step interrupted in any of
its copies is not taken at all; bad sizes are clear errors."""

from __future__ import annotations

import functools

import pytest

import flashdec
from flashdec.cache.block_transfer import BlockTransfer
from tests.cache.helpers import cached_prefix_tokens
from tests.models.greedy import hf_greedy
from tests.test_llm import FAMILIES, _model
from tests.test_llm_failures import _bookkeeping
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


def _before_a_copying_step() -> tuple[flashdec.LLM, list[list[int]], list]:
    """An LLM whose next step admits a new prompt, then ``a`` again, whose blocks the small
    pool evicted: admitting ``a`` copies a block down (its allocation evicts one) and two up,
    then the prefill's allocations copy four more down, in two copies. Returns the LLM, every
    prompt served so far and the two requests' ids."""
    vocab = _model("tiny-llama").config.vocab_size
    a, *others = _prompts("tiny-llama")
    llm = flashdec.LLM(
        _model("tiny-llama"),
        max_batch_size=2,
        num_blocks=6,
        max_model_len=64,
        host_kv_cache_gib=HOST_GIB,
    )
    for prompt in (a, *others):
        llm.generate([prompt], NEW)
    rids = [llm.add_request(_tokens(vocab, 40, 5), NEW), llm.add_request(a, NEW)]
    return llm, [a, *others], rids


def _step_to_the_end(llm: flashdec.LLM, rids: list) -> list[list[int]]:
    while llm.has_unfinished():
        llm.step()
    return [llm.release(rid) for rid in rids]


@functools.cache
def _uninterrupted() -> list[list[int]]:
    llm, _, rids = _before_a_copying_step()
    return _step_to_the_end(llm, rids)


STEP_COPIES = [("down", 1), ("up", 2), ("down", 3), ("down", 1)]


@pytest.mark.parametrize("at", range(len(STEP_COPIES)))
def test_a_step_interrupted_in_a_copy_is_not_taken(monkeypatch, at):
    """A KeyboardInterrupt in each of the step's copies (the admission's down and up, the
    prefill's downs): every request, the queue, the pool and the counters are as before the
    step, no cached block is lost (each prompt served so far hits as much as before), and
    stepping on gives the tokens of an uninterrupted run."""
    llm, served, rids = _before_a_copying_step()
    cache = llm.engine.cache
    copies = []

    def interrupting(direction):
        original = getattr(BlockTransfer, direction)

        def copy(transfer, first, second):
            copies.append((direction, len(first)))
            if len(copies) > at:
                raise KeyboardInterrupt
            original(transfer, first, second)

        return copy

    for direction in ("down", "up"):
        monkeypatch.setattr(BlockTransfer, direction, interrupting(direction))
    hashes = [cache.prefix_cache.block_hashes(p) for p in served]

    def hits() -> list[int]:
        return [cached_prefix_tokens(cache, h, 40) for h in hashes]

    before, hit_before = _bookkeeping(llm), hits()
    counters = {k: v for k, v in llm.prefix_cache_stats().items() if "tokens" in k}
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert copies == STEP_COPIES[: at + 1]
    cache.validate_invariants()
    assert _bookkeeping(llm) == before
    assert hits() == hit_before
    assert {k: v for k, v in llm.prefix_cache_stats().items() if "tokens" in k} == counters
    monkeypatch.undo()
    assert _step_to_the_end(llm, rids) == _uninterrupted()
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks


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
