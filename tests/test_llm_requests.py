"""``flashdec.LLM``'s serving calls: per-request sampling in one batch (greedy rows exact,
seeded rows independent of their company), ``abort_request`` (blocks back at once, the others
unaffected), ``poll`` (never waits) and ``ServingLoop.cancel``."""

from __future__ import annotations

import functools

import pytest
import torch

import flashdec
from flashdec import SamplingParams
from flashdec.models import build_random_model

NEW = 10


@functools.cache
def _model():
    return build_random_model("tiny", dtype=torch.float32, device="cpu", seed=0)


def _llm(**kw) -> flashdec.LLM:
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_model_len", 128)
    return flashdec.LLM(_model(), **kw)


def _prompts(n: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (5 + 7 * i,), generator=gen).tolist() for i in range(n)]


@functools.cache
def _greedy() -> list[list[int]]:
    return _llm().generate(_prompts(), NEW, ignore_eos=True)


def _drain(llm, rids) -> list[list[int]]:
    for _ in range(10 * NEW):
        if not llm.has_unfinished():
            break
        llm.step()
    assert not llm.has_unfinished()
    return [llm.release(rid) for rid in rids]


def _clean(llm) -> None:
    assert llm.loop.idle and llm._runner.requests == {} and llm._runner.sampled == set()
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0
    llm.engine.cache.validate_invariants()


def test_per_request_sampling_in_one_batch():
    """Greedy rows keep the argmax while others in the same steps sample; top_k=1 sampling is
    the argmax too; a seeded request gives the same tokens alone and in company."""
    prompts, greedy = _prompts(), _greedy()
    hot = SamplingParams(temperature=1.5, seed=11)
    llm = _llm()
    rids = [
        llm.add_request(prompts[0], NEW, ignore_eos=True),
        llm.add_request(prompts[1], NEW, ignore_eos=True, sampling=hot),
        llm.add_request(prompts[2], NEW, ignore_eos=True, sampling=SamplingParams(1.0, top_k=1)),
        llm.add_request(prompts[3], NEW, ignore_eos=True, sampling=SamplingParams(0.7, top_p=0.5)),
    ]
    out = _drain(llm, rids)
    assert out[0] == greedy[0] and out[2] == greedy[2]
    assert out[1] != greedy[1] and all(len(t) == NEW for t in out)
    alone = _llm()
    rid = alone.add_request(prompts[1], NEW, ignore_eos=True, sampling=hot)
    assert _drain(alone, [rid]) == [out[1]]
    _clean(llm)


def test_add_request_refuses_a_bad_sampling_and_queues_nothing():
    llm = _llm()
    for bad in ({"temperature": 1.0}, 0.5, "greedy"):
        with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
            llm.add_request([1, 2, 3], 4, sampling=bad)
    assert llm._next_id == 0 and llm.loop.idle
    _clean(llm)


def test_abort_running_and_waiting_requests():
    prompts, greedy = _prompts(), _greedy()
    llm = _llm(max_batch_size=2)  # two run, two wait
    rids = [llm.add_request(p, NEW, ignore_eos=True) for p in prompts]
    llm.step()
    llm.step()
    used = llm.engine.cache.metrics()["num_used_blocks"]
    assert used > 0 and str(llm.engine.request_state(rids[2])) == "waiting"
    got = llm.abort_request(rids[0])  # running: its blocks return at once
    assert got == greedy[0][: len(got)] and len(got) >= 1
    assert llm.engine.cache.metrics()["num_used_blocks"] < used
    llm.engine.cache.validate_invariants()
    assert llm.abort_request(rids[3]) == []  # waiting: never admitted
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort_request(rids[0])  # forgotten
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort_request(999)
    rest = _drain(llm, [rids[1], rids[2]])
    assert rest == [greedy[1], greedy[2]]  # the others never noticed
    _clean(llm)


def test_abort_a_finished_request_forgets_it():
    llm = _llm()
    rid = llm.add_request(_prompts()[0], 3, ignore_eos=True)
    while llm.has_unfinished():
        llm.step()
    assert llm.abort_request(rid) == _greedy()[0][:3]
    _clean(llm)


def test_poll_reports_tokens_as_they_arrive():
    llm = _llm()
    prompt = _prompts()[1]
    rid = llm.add_request(prompt, NEW, ignore_eos=True)
    assert llm.poll(rid) == ([], False)
    seen: list[int] = []
    finished = False
    for _ in range(3 * NEW):
        if not llm.has_unfinished():
            break
        llm.step()
        new, finished = llm.poll(rid, len(seen))
        seen += new
    assert finished and seen == _greedy()[1]
    with pytest.raises(ValueError, match="unknown request id"):
        llm.poll(12345)
    llm.release(rid)
    _clean(llm)


def test_loop_cancel_checks_its_request():
    llm = _llm()
    rid = llm.add_request([5, 6, 7], 4)
    with pytest.raises(ValueError, match="not live"):
        llm.loop.cancel(rid + 1)
    llm.loop.cancel(rid)
    assert llm.loop.idle and str(llm.engine.request_state(rid)) == "cancelled"
    llm.release(rid)
    _clean(llm)
