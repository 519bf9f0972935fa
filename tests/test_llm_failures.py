"""``flashdec.LLM`` under failure: an exception at any point of a step (scheduling, each prompt's
import, each layer's attention and MLP, sampling, the commit, the host tier's copies) leaves
every request as the step found it, and stepping on gives exactly the tokens of an
uninterrupted run; results are whole when a request leaves; a request that can never fit is
refused up front; a rejected or interrupted ``generate`` leaves nothing behind."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import flashdec
from flashdec.models import build_random_model

# (arrival step, prompt, max_new_tokens): two prompts imported in one step, a third joining the
# running batch, a step that only decodes
ARRIVALS = (
    (0, [3, 14, 15, 92, 65], 4),
    (0, [35, 89, 79, 32, 38, 46, 26], 3),
    (1, [43, 38], 2),
)


@functools.cache
def _model():
    return build_random_model("tiny", dtype=torch.float32, device="cpu", seed=0)


def _llm(**kw) -> flashdec.LLM:
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("num_blocks", 16)
    kw.setdefault("max_model_len", 64)
    return flashdec.LLM(_model(), **kw)


class InjectedError(RuntimeError):
    pass


class Injector:
    """Counts every call at a failure point of a step and raises at the armed one."""

    def __init__(self) -> None:
        self.left: int | None = None  # calls to let through before raising; None: disarmed
        self.exc: type[BaseException] = InjectedError
        self.where: list[str] = []
        self.failed_at: Counter[str] = Counter()  # the points raised at, over every try

    def arm(self, offset: int) -> None:
        self.left = offset
        self.exc = KeyboardInterrupt if offset % 2 == 0 else InjectedError
        self.where = []

    def hit(self, where: str, exc: type[BaseException] | None = None) -> None:
        if self.left is None:
            return
        self.where.append(where)
        if self.left == 0:
            self.left = None
            self.failed_at[where] += 1
            raise (exc or self.exc)(f"injected at {where}")
        self.left -= 1

    def wrap(self, obj, name: str, monkeypatch, exc: type[BaseException] | None = None) -> None:
        """Make ``obj.name`` a failure point (raising ``exc``, else the armed exception)."""
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            self.hit(name, exc)
            return original(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapped)


def _instrument(llm, monkeypatch) -> tuple[Injector, list]:
    injector = Injector()
    injector.wrap(llm.scheduler, "plan", monkeypatch)  # scheduling
    injector.wrap(llm.adapter, "prefill", monkeypatch)  # each prompt
    injector.wrap(llm.engine, "prefill_layer", monkeypatch)  # each prompt layer's K/V import
    injector.wrap(llm.engine, "step_layer", monkeypatch)  # each decode layer's attention
    injector.wrap(llm._runner, "_choose", monkeypatch)  # sampling
    injector.wrap(llm.engine, "commit_step", monkeypatch)  # every commit
    cache = llm.engine.cache
    for g in range(len(cache.kv_groups)):
        host = cache.layout._group(g).block_cache.host
        if host is not None:  # the host tier's copies: down (an eviction), up (a hit)
            for direction in ("down", "up"):
                # an Exception there only makes the tier recompute (test_llm_host_tier.py):
                # an interrupt is what fails the step
                injector.wrap(host.transfer, direction, monkeypatch, KeyboardInterrupt)
    hooks = [  # each layer's MLP, in prefill and decode
        layer.mlp.register_forward_pre_hook(lambda *_: injector.hit("mlp"))
        for layer in llm.model.model.layers
    ]
    return injector, hooks


def _bookkeeping(llm) -> dict:
    """Every request as the engine, the cache, the loop and the runner see it."""
    engine, cache, runner, loop = llm.engine, llm.engine.cache, llm._runner, llm.loop
    rows = {}
    for rid, req in runner.requests.items():
        state = str(engine.request_state(rid))
        seq_len = cache.seq_len(rid) if state != "waiting" else None
        rows[rid] = (state, seq_len, loop.generated.get(rid), list(req.tokens), req.first_token_at)
        if state == "active":  # its context: a prompt part way in (chunks), or all of it
            prompt = req.prompt.shape[0]
            in_flight = runner.pending is not None and rid in runner.pending[0]
            if seq_len < prompt:  # mid-prompt: no token yet
                assert loop.generated[rid] == 0 and not req.tokens and not in_flight, rows[rid]
            else:
                assert seq_len == prompt + loop.generated[rid], rows[rid]
                assert len(req.tokens) + in_flight == 1 + loop.generated[rid], rows[rid]
    snapshot = engine.scheduling_snapshot(loop.step_index)
    return {
        "requests": rows,
        "active": snapshot.active,
        "waiting": tuple(snapshot.waiting),
        "free": cache.num_free_blocks,
        "step": loop.step_index,
        "live": loop.live_ids,
    }


def _run(llm, injector: Injector | None = None, arrivals=ARRIVALS) -> tuple[list[list[int]], int]:
    """Step ``arrivals`` to the end. With an injector, every step is first tried with the
    failure at its 1st point, then its 2nd, ... until a try gets through; each failed try must
    leave everything as it was. Returns the outputs and the number of failed tries."""
    rids, step, failures = [], 0, 0
    while step <= max(a for a, _, _ in arrivals) or llm.has_unfinished():
        rids += [llm.add_request(p, n) for at, p, n in arrivals if at == step]
        offset = 0
        while injector is not None:
            before = _bookkeeping(llm)
            pending = llm._runner.pending
            injector.arm(offset)
            try:
                llm.step()
            except (KeyboardInterrupt, InjectedError) as exc:
                assert str(exc).startswith("injected"), exc
                assert _bookkeeping(llm) == before, f"after a failure at {injector.where[-1]}"
                assert llm._runner.pending is pending  # the late-read tokens stay pending
                llm.engine.cache.validate_invariants()
                failures += 1
                offset += 1
                continue
            assert injector.left is not None, "an injected failure was swallowed"
            injector.left = None
            break
        else:
            llm.step()
        step += 1
    llm.engine.cache.validate_invariants()
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.max_blocks
    return [llm.release(rid) for rid in rids], failures


@functools.cache
def _uninterrupted(budget: int = 2048) -> list[list[int]]:
    return _run(_llm(max_num_batched_tokens=budget))[0]


# a 2-block prompt, two others whose admissions and imports evict its blocks to the host tier
# (a 4-block pool), then the first again, whose admission copies them up
HOST_ARRIVALS = (
    (0, list(range(100, 133)), 2),
    (2, list(range(200, 233)), 2),
    (4, list(range(300, 333)), 2),
    (6, list(range(100, 133)), 2),
)


def _host_tier_llm() -> flashdec.LLM:
    return _llm(num_blocks=4, host_kv_cache_gib=0.001)


def test_a_failure_anywhere_in_a_step_changes_no_later_token(monkeypatch):
    llm = _llm()
    injector, hooks = _instrument(llm, monkeypatch)
    try:
        outputs, failures = _run(llm, injector)
    finally:
        for hook in hooks:
            hook.remove()
    assert outputs == _uninterrupted()
    assert [len(t) for t in outputs] == [n for _, _, n in ARRIVALS]
    # step 0 alone: the plan, two prompts (each: the call, 4 layers of K/V import and MLP, the
    # first token, its commit) and a decode of both (4 layers of attention and MLP, sampling,
    # the commit)
    assert failures >= 1 + 2 * 11 + 10


def test_a_failure_in_a_chunked_prompt_step_changes_no_later_token(monkeypatch):
    """A 3-token step budget: the prompts arrive in chunks that share steps with decodes; a
    failure at any point of such a step leaves the chunk, the decodes and the pool as they were."""
    llm = _llm(max_num_batched_tokens=3)
    injector, hooks = _instrument(llm, monkeypatch)
    try:
        outputs, failures = _run(llm, injector)
    finally:
        for hook in hooks:
            hook.remove()
    assert outputs == _uninterrupted(3) == _uninterrupted()
    assert failures >= 20


def test_a_failure_in_a_host_tier_copy_changes_no_later_token(monkeypatch):
    """The same with a host tier on a pool too small for the prompts: failures land in the
    copies down (evictions at admission and at the prompts' imports) and up (a hit)."""
    plain = _host_tier_llm()
    expected = _run(plain, arrivals=HOST_ARRIVALS)[0]
    stats = plain.prefix_cache_stats()
    assert stats["host_hit_tokens"] == 32 and stats["host"]["blocks_down"] > 0
    llm = _host_tier_llm()
    injector, hooks = _instrument(llm, monkeypatch)
    try:
        outputs = _run(llm, injector, HOST_ARRIVALS)[0]
    finally:
        for hook in hooks:
            hook.remove()
    assert outputs == expected
    assert injector.failed_at["down"] >= 3 and injector.failed_at["up"] >= 1
    # a try taken back after its copy up keeps those blocks cached: the retry hits them on the
    # GPU (the lookups of the tries taken back do not count)
    assert llm.prefix_cache_stats()["hit_tokens"] == 32


@pytest.mark.gpu
def test_a_failure_anywhere_in_a_graphed_step_changes_no_later_token(monkeypatch):
    """The same on the GPU with CUDA graphs: failures land in eager warm-up runs, in graph
    captures and around replays (the MLP runs fused there: its hooks never fire)."""
    model = build_random_model("tiny", dtype=torch.bfloat16, device="cuda", seed=0)

    def make():
        return flashdec.LLM(
            model, max_batch_size=4, num_blocks=16, max_model_len=64, cuda_graphs=True
        )

    expected = _run(make())[0]
    llm = make()
    injector, hooks = _instrument(llm, monkeypatch)
    try:
        outputs, failures = _run(llm, injector)
    finally:
        for hook in hooks:
            hook.remove()
    assert outputs == expected and failures > 0
    assert llm._runner.graph_replays > 0  # retried steps replayed graphs captured on a try


def test_a_failed_decode_keeps_the_pending_tokens_and_the_counts(monkeypatch):
    """Step 1 (the two running requests' decode and the late prompt, in one mixed step) fails
    after step 0's tokens (the first ones, from the prompts) were handed off: they stay
    pending, step 0's admissions stay, step 1's admission is taken back."""
    llm = _llm()
    rids = [llm.add_request(p, n) for at, p, n in ARRIVALS if at == 0]
    llm.step()
    late = llm.add_request(ARRIVALS[2][1], ARRIVALS[2][2])
    pending = llm._runner.pending
    assert pending is not None and set(pending[0]) == set(rids)
    calls = []

    def failing_mlp(module, args):
        calls.append(args[0].shape[0])
        if args[0].shape[0] == 4:  # two decode rows and the late prompt's two tokens
            raise KeyboardInterrupt

    hook = llm.model.model.layers[2].mlp.register_forward_pre_hook(failing_mlp)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.step()
    finally:
        hook.remove()
    assert 4 in calls
    assert llm._runner.pending is pending
    assert llm.loop.generated == {rids[0]: 0, rids[1]: 0, late: 0}
    assert str(llm.engine.request_state(late)) == "waiting"
    assert llm.output(late) == [] and llm.request_timing(late).first_token_at is None
    assert [len(llm._runner.requests[r].tokens) for r in rids] == [0, 0]  # 1st token pending
    while llm.has_unfinished():
        llm.step()
    assert [llm.release(r) for r in [*rids, late]] == _uninterrupted()


def test_release_returns_every_token():
    llm = _llm()
    rid = llm.add_request([1, 2, 3], 4)
    while rid in llm.loop.live_ids:
        llm.step()
    assert llm.output(rid) == llm.release(rid)
    expected = _llm().generate([[1, 2, 3]], 4)[0]
    assert len(expected) == 4
    llm = _llm()
    rid = llm.add_request([1, 2, 3], 4)
    while rid in llm.loop.live_ids:
        llm.step()
    assert llm.release(rid) == expected


def test_a_request_that_can_never_fit_is_refused_up_front():
    llm = _llm(num_blocks=4, max_model_len=512)  # 4 blocks of 16 tokens
    with pytest.raises(ValueError, match=r"never fit the KV cache.*7-block.* 4"):
        llm.generate([list(range(100))], 4)
    with pytest.raises(ValueError, match=r"never fit the KV cache.*7-block.* 4"):
        llm.add_request(list(range(100)), 4)
    assert llm.loop.idle and llm._runner.requests == {} and llm._next_id == 0
    assert llm.generate([list(range(60))], 4) == _llm(max_model_len=512).generate(
        [list(range(60))], 4
    )


def test_a_request_that_can_never_fit_is_refused_per_kv_group():
    model = build_random_model("tiny-qwen2-swa", dtype=torch.float32, device="cpu", seed=0)
    llm = flashdec.LLM(model, num_blocks=3, max_batch_size=2, max_model_len=256)
    with pytest.raises(ValueError, match=r"never fit the KV cache: it needs .* group \d"):
        llm.add_request(list(range(60)), 4)
    assert llm.loop.idle and llm._runner.requests == {}


def test_a_request_the_scheduler_rejects_carries_the_reason(monkeypatch):
    llm = _llm(num_blocks=4, max_model_len=512)
    # skip the up-front check, as if the pool had shrunk since
    monkeypatch.setattr(llm.loop, "rejection_reason", lambda spec: None, raising=False)
    rid = llm.add_request(list(range(100)), 4)
    record = llm.step()
    assert record.rejected == (rid,) and "7-block table" in record.rejection_reasons[0]
    with pytest.raises(RuntimeError, match=r"did not run: the scheduler rejected it.*7-block"):
        llm.output(rid)
    assert llm.release(rid) == []
    with pytest.raises(RuntimeError, match=r"prompt 1 did not run.*7-block"):
        llm.generate([[1, 2], list(range(100))], 4)
    assert llm.loop.idle and llm._runner.requests == {}


def test_a_rejected_generate_queues_nothing():
    llm = _llm(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2], [3] * 64], 8)
    assert llm.loop.idle and llm._runner.requests == {} and llm._next_id == 0
    assert llm.engine.cache.metrics()["num_requests"] == 0


def test_an_interrupted_generate_leaves_no_record(monkeypatch):
    llm = _llm()
    kept = llm.add_request([5, 6, 7], 2)  # the caller's own request survives the interruption
    while llm.has_unfinished():
        llm.step()
    calls = []

    def stop_after_two_steps(done, total):
        calls.append(done)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5]], 8, progress=stop_after_two_steps)
    assert list(llm._runner.requests) == [kept]
    assert llm.loop.idle and llm._runner.pending is None
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.max_blocks
    llm.engine.cache.validate_invariants()
    assert llm.generate([[1, 2, 3]], 3) == _llm().generate([[1, 2, 3]], 3)
    assert list(llm._runner.requests) == [kept] and len(llm.release(kept)) == 2
