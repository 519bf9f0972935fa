"""Preemption by swap through ``flashdec.LLM(host_kv_cache_gib=, swap_patience=)``: a request
whose lifetime commitment holds back a waiting one is swapped out (its full blocks cached, down
to the host tier as the pool needs them) and resumes later from them; the tokens are
transformers' for every family; a random workload on a small pool never leaves a request stuck,
each request is swapped at most once, and the output equals a run without swaps."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashdec
from flashdec.scheduler import RequestSpec
from tests.models.greedy import hf_greedy
from tests.profiles import examples
from tests.test_llm import FAMILIES, _model
from tests.test_llm_failures import InjectedError, _instrument
from tests.test_llm_prefix_cache import _tokens

HOST_GIB = 0.001


def _llm(name: str, num_blocks: int = 8, **kw) -> flashdec.LLM:
    kw.setdefault("host_kv_cache_gib", HOST_GIB)
    kw.setdefault("swap_patience", 2)
    return flashdec.LLM(
        _model(name), max_batch_size=4, num_blocks=num_blocks, max_model_len=128, **kw
    )


@functools.cache
def _long_and_short(name: str) -> tuple[list[int], list[int]]:
    vocab = _model(name).config.vocab_size
    return _tokens(vocab, 40, 1), _tokens(vocab, 60, 2)


@functools.cache
def _expected(name: str) -> tuple[list[int], list[int]]:
    model = _model(name)
    long, short = _long_and_short(name)
    return (
        hf_greedy(model, [long], 60, ignore_eos=True)[0],
        hf_greedy(model, [short], 40, ignore_eos=True)[0],
    )


def _serve(llm: flashdec.LLM, requests, limit: int | None = None) -> tuple[list[list[int]], list]:
    """Add every ``(prompt, max_new_tokens)`` at once, step to the end (within ``limit`` steps);
    outputs and records."""
    rids = [llm.add_request(p, n, ignore_eos=True) for p, n in requests]
    records, steps = [], 0
    while llm.has_unfinished():
        assert limit is None or steps < limit, f"requests left after {limit} steps"
        record = llm.step()
        steps += 1
        if record is not None:
            records.append(record)
    return [llm.release(rid) for rid in rids], records


@pytest.mark.parametrize("name", FAMILIES)
def test_a_long_request_gives_way_and_resumes_with_transformers_tokens(name):
    """The first request's lifetime commitment (7 of 8 blocks) holds the second back; after
    two steps it is swapped out, the second runs (evicting its cached blocks to the host
    tier), then it resumes from its cached blocks: both outputs are transformers'."""
    long, short = _long_and_short(name)
    llm = _llm(name)
    outputs, records = _serve(llm, [(long, 60), (short, 40)])
    assert outputs == list(_expected(name))
    if all(w is not None for w in llm.adapter.spec.layer_windows):
        # every layer windowed: a request holds a window's blocks, both fit at once
        assert records[0].admitted == (0, 1) and llm.num_swaps == 0
        return
    swaps = [r for r in records if r.swapped]
    assert len(swaps) == 1 and swaps[0].swapped == (0,) and swaps[0].admitted == (1,)
    assert llm.num_swaps == 1
    stats = llm.prefix_cache_stats()
    assert stats["hit_tokens"] >= 32  # it resumed from at least its prompt's full blocks
    assert stats["host"]["blocks_down"] > 0  # the short request's room came from them
    cache = llm.engine.cache
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks


def test_without_the_host_tier_or_with_patience_none_nothing_is_swapped():
    long, short = _long_and_short("tiny-llama")
    for kw in ({"host_kv_cache_gib": 0.0}, {"swap_patience": None}):
        llm = _llm("tiny-llama", **kw)
        outputs, records = _serve(llm, [(long, 60), (short, 40)])
        assert outputs == list(_expected("tiny-llama"))
        assert llm.num_swaps == 0 and not any(r.swapped for r in records)


def test_a_failed_step_after_a_swap_keeps_the_tokens(monkeypatch):
    """A failure at every point of every step (scheduling, prompt chunks, layers, sampling)
    while requests are swapped and resumed: stepping on gives transformers' tokens."""
    long, short = _long_and_short("tiny-llama")
    llm = _llm("tiny-llama")
    injector, _ = _instrument(llm, monkeypatch)
    rids = [llm.add_request(p, n, ignore_eos=True) for p, n in [(long, 60), (short, 40)]]
    failures = 0
    while llm.has_unfinished():
        offset = 0
        while True:
            injector.arm(offset)
            try:
                llm.step()
            except (KeyboardInterrupt, InjectedError):
                llm.engine.cache.validate_invariants()
                failures += 1
                offset += 1
                if offset > 6:
                    injector.left = None
                continue
            injector.left = None
            break
    assert failures > 0 and llm.num_swaps >= 1
    assert [llm.release(r) for r in rids] == list(_expected("tiny-llama"))


@functools.cache
def _plain_outputs(name: str, requests: tuple) -> list[list[int]]:
    """The same requests with a pool large enough that nothing waits for blocks."""
    llm = flashdec.LLM(_model(name), max_batch_size=4, num_blocks=64, max_model_len=128)
    return _serve(llm, [(list(p), n) for p, n in requests])[0]


def _watch_swaps(llm: flashdec.LLM) -> list[tuple[object, tuple]]:
    """Every swap from now on, as ``(the waiting head it made room for, the requests swapped
    out)``, read off the snapshot each step's preemption was given."""
    preemption, swaps = llm.loop.preemption, []
    before_step = preemption.before_step

    def watched(loop, snapshot):
        swapped = before_step(loop, snapshot)
        if swapped:
            swaps.append((snapshot.waiting[0].request_id, swapped))
        return swapped

    preemption.before_step = watched
    return swaps


@st.composite
def _swapping_workloads(draw) -> list[tuple[int, int]]:
    """``(prompt length, max_new_tokens)`` of 2-6 requests, each fitting the 8-block pool alone:
    the first commits 7 of its blocks for long, the second needs 2 or more, so the second
    waits and a swap must make room for it; the rest are anything."""
    first_prompt = draw(st.integers(33, 60))
    first = (first_prompt, draw(st.integers(100, 112)) - first_prompt)  # 40-79 new tokens
    second = draw(st.tuples(st.integers(17, 50), st.integers(2, 40)))
    rest = draw(st.lists(st.tuples(st.integers(1, 50), st.integers(2, 40)), max_size=4))
    return [first, second, *rest]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])  # one KV group, two
@settings(
    max_examples=examples(24, 4),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(lengths=_swapping_workloads(), patience=st.integers(0, 3), seed=st.integers(0, 10**6))
@pytest.mark.large
def test_swaps_never_leave_a_request_stuck(name, lengths, patience, seed):
    """Random requests on a pool of 8 blocks (in every KV group) that must swap: every request
    finishes within a bounded number of steps, none is swapped twice, a swapped head never
    causes a swap, and the tokens equal a run where nothing waits for blocks."""
    vocab = _model(name).config.vocab_size
    requests = tuple((tuple(_tokens(vocab, p, seed + i)), n) for i, (p, n) in enumerate(lengths))
    llm = _llm(name, swap_patience=patience)
    swaps = _watch_swaps(llm)
    # bounded: every token of every request, plus the chunks of a prompt import per admission
    # (a window model imports at most a window per step), a swapped request's twice
    chunk = llm.engine.max_tokens_per_request_step or llm.max_model_len
    imports = [-(-(len(p) + n) // chunk) for p, n in requests]
    tokens = sum(n for _, n in requests)
    outputs, records = _serve(llm, [(list(p), n) for p, n in requests], tokens + 2 * sum(imports))
    # the first request gave way to the second (with the later ones running beside it)
    assert swaps[0][0] == 1 and 0 in swaps[0][1]
    swapped = [rid for r in records for rid in r.swapped]
    assert swapped == [rid for _, victims in swaps for rid in victims]
    assert len(swapped) == len(set(swapped)) == llm.num_swaps  # at most once each
    assert len(records) <= tokens + sum(imports) + sum(imports[rid] for rid in swapped)
    for i, (head, _) in enumerate(swaps):  # a head that gave way never takes the room back
        assert all(head not in victims for _, victims in swaps[:i])
    assert outputs == _plain_outputs(name, requests)
    cache = llm.engine.cache
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks


def test_rejected_preempt_calls_change_nothing():
    long = _long_and_short("tiny-llama")[0]
    llm = _llm("tiny-llama", swap_patience=None)
    rid = llm.add_request(long, 60, ignore_eos=True)
    llm.step()
    llm.step()
    submissions, cache = llm.engine.submissions, llm.engine.cache
    context = long + llm._runner.requests[rid].tokens
    before = (cache.metrics(), cache.prefix_cache.stats(), llm.engine.request_state(rid))
    bad = [
        (RequestSpec(rid + 1, len(context), 10, 7), ValueError, "of request"),
        (RequestSpec(rid, len(context) + 1, 10, 7), ValueError, "cover the context"),
        (RequestSpec(rid, len(context), 10, 0), ValueError, "already used"),
        ("spec", ValueError, "RequestSpec"),
    ]
    for spec, error, match in bad:
        with pytest.raises(error, match=match):
            submissions.preempt(rid, spec, context)
    with pytest.raises(ValueError, match="unknown"):
        submissions.preempt("nope", RequestSpec("nope", 1, 1, 9), [1])
    assert (cache.metrics(), cache.prefix_cache.stats(), llm.engine.request_state(rid)) == before
    cache.validate_invariants()
    llm.abort_request(rid)
