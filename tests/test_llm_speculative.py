"""``flashdec.LLM(..., speculative=SpeculativeConfig(...))``: greedy output equals plain greedy
output and transformers', token for token, for every family (sliding-window ones too), while
drafts are accepted; the stats add up; a failure in a verification step leaves every request as
it was; bad configs change nothing."""

from __future__ import annotations

import functools

import pytest
import torch

import flashdec
from flashdec.models import build_random_model
from tests.models.greedy import hf_greedy
from tests.test_llm import FAMILIES, _model, _prompts
from tests.test_llm_failures import _instrument, _llm, _run, _uninterrupted

NEW = 20
# speculation whenever drafts are found: these tests check the mechanism, not whether it pays
# on the CPU (the measured gate is tested on its own below)
SPEC = flashdec.SpeculativeConfig(num_tokens=4, min_speedup=None)


@functools.cache
def _expected(name: str) -> list[list[int]]:
    model = _model(name)
    return hf_greedy(model, _prompts(model.config.vocab_size), NEW, ignore_eos=True)


def _oracle(llm, expected: dict, corrupt_every: int = 3):
    """Replace the n-gram lookup by one that knows each request's greedy continuation (from
    transformers) and spoils every ``corrupt_every``-th draft: drafts are accepted, partly
    accepted and rejected, so every family's verification and rollback are exercised (tiny
    random models rarely repeat their context, so the n-gram drafter alone seldom hits)."""
    calls = [0]

    def propose(rid, prompt, tokens, k, tail=()):
        done = [*tokens, *tail]
        truth = expected[rid][len(done) : len(done) + k]
        calls[0] += 1
        if truth and calls[0] % corrupt_every == 0:
            at = calls[0] % len(truth)
            truth = [*truth[:at], (truth[at] + 1) % llm.adapter.spec.vocab_size, *truth[at + 1 :]]
        return truth

    llm._runner.drafter.propose = propose


@pytest.mark.parametrize("name", FAMILIES)
def test_verified_drafts_keep_greedy_output_exact(name):
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, max_batch_size=4, speculative=SPEC)
    _oracle(llm, dict(enumerate(_expected(name))))
    assert llm.generate(prompts, NEW, ignore_eos=True) == _expected(name)
    stats = llm.last_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # hits and misses
    assert 0 < stats.acceptance_rate < 1
    assert stats.tokens_per_step > 1.5
    assert stats.decode_steps < NEW - 1  # fewer steps than one token each
    assert stats.generated_tokens == sum(map(len, _expected(name)))
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0
    llm.engine.cache.validate_invariants()


@pytest.mark.parametrize("name", FAMILIES)
def test_ngram_speculation_with_chunked_prompts_equals_plain_greedy(name):
    """The real n-gram drafter on repetitive prompts, prompts arriving in chunks that share
    verification steps (a 9-token budget also clips the drafts)."""
    model = _model(name)
    vocab = model.config.vocab_size
    base = _prompts(vocab, lens=(5, 3))
    prompts = [base[0] * 4, base[1] * 7, _prompts(vocab, lens=(9,), seed=2)[0]]
    plain = flashdec.LLM(model, max_batch_size=4).generate(prompts, NEW, ignore_eos=True)
    llm = flashdec.LLM(model, max_batch_size=4, max_num_batched_tokens=9, speculative=SPEC)
    assert (
        llm.generate(prompts, NEW, ignore_eos=True)
        == plain
        == hf_greedy(model, prompts, NEW, ignore_eos=True)
    )
    stats = llm.last_stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens <= stats.draft_tokens
    llm.engine.cache.validate_invariants()


@functools.cache
def _copying_model():
    """tiny-llama without attention output (o_proj = 0): each token's logits depend on that
    token alone, so greedy decoding runs into a cycle the n-gram drafter predicts exactly."""
    model = build_random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def test_ngram_drafts_are_accepted_when_the_model_repeats_its_context():
    model = _copying_model()
    start = hf_greedy(model, [[7]], 300)[0]  # into its cycle (the vocabulary has 256 tokens)
    prompts = [[7, *start], [7, *start[:-3]]]
    expected = hf_greedy(model, prompts, 24)
    llm = flashdec.LLM(model, max_batch_size=2, speculative=SPEC)
    assert llm.generate(prompts, 24) == expected
    stats = llm.last_stats
    assert stats.acceptance_rate > 0.9 and stats.tokens_per_step > 3
    assert stats.decode_steps <= 24 // 4 + 2


def test_speculation_measured_slower_than_plain_decoding_is_held_off():
    """With the default config (``min_speedup=1.0``) the runner times its steps: where
    verification gives fewer tokens per second than plain steps, it runs plain (here a fake
    clock makes every verification step cost 10 plain ones). The output stays plain greedy's
    and ``last_stats.held_steps`` counts the held steps."""
    model = _copying_model()
    start = hf_greedy(model, [[7]], 300)[0]
    prompts = [[7, *start]]
    expected = hf_greedy(model, prompts, 60)
    llm = flashdec.LLM(model, max_batch_size=1, speculative=flashdec.SpeculativeConfig())
    runner, ticks = llm._runner, [0.0]
    runner.gate.clock = lambda: ticks[0]

    def timed(run, cost):
        def wrapper(*args, **kwargs):
            ticks[0] += cost
            return run(*args, **kwargs)

        return wrapper

    runner._run_verify = timed(runner._run_verify, 10.0)
    runner._run_plain = timed(runner._run_plain, 1.0)
    assert llm.generate(prompts, 60) == expected
    stats = llm.last_stats
    assert stats.draft_tokens > 0  # it tried...
    assert stats.held_steps > 20  # ...then ran plain
    assert stats.tokens_per_step < 2


def test_max_new_tokens_and_eos_are_respected():
    """Drafts never carry a request past max_new_tokens; the first EOS among accepted tokens
    ends it."""
    model = _copying_model()
    start = hf_greedy(model, [[7]], 300)[0]
    prompt = [7, *start]
    expected = hf_greedy(model, [prompt], 24, ignore_eos=True)[0]
    llm = flashdec.LLM(model, max_batch_size=2, speculative=SPEC)
    for n in (1, 2, 3, 5, 7):
        assert llm.generate([prompt], n) == [expected[:n]]
    eos = expected[6]
    llm._runner.eos = frozenset({eos})
    out = llm.generate([prompt], 24)[0]
    assert out == expected[: expected.index(eos) + 1]
    assert llm.generate([prompt], 24, ignore_eos=True)[0] == expected


def test_sampling_with_speculation_is_reproducible_under_a_seed():
    model = _copying_model()
    start = hf_greedy(model, [[7]], 300)[0]
    llm = flashdec.LLM(model, max_batch_size=2, speculative=SPEC)
    runs = [llm.generate([[7, *start]] * 2, 16, temperature=0.7, seed=3) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 16 for t in runs[0])
    assert llm.last_stats.draft_tokens > 0


def test_a_large_batch_does_not_speculate():
    model = _copying_model()
    start = hf_greedy(model, [[7]], 300)[0]
    llm = flashdec.LLM(model, max_batch_size=4, speculative=SPEC)
    llm._runner.controller.max_batch = 2
    llm.generate([[7, *start]] * 3, 8)
    assert llm.last_stats.draft_tokens == 0 and llm.last_stats.tokens_per_step == 1.0
    llm.generate([[7, *start]] * 2, 8)
    assert llm.last_stats.draft_tokens > 0


def test_plain_llm_stats():
    model = _copying_model()
    llm = flashdec.LLM(model, max_batch_size=2)
    llm.generate([[7, 8, 9]], 6)
    stats = llm.last_stats
    assert (stats.draft_tokens, stats.accepted_tokens, stats.acceptance_rate) == (0, 0, 0.0)
    assert stats.tokens_per_step == 1.0


@pytest.mark.parametrize("budget", [2048, 6])
def test_a_failure_anywhere_in_a_verification_step_changes_no_later_token(monkeypatch, budget):
    """tests/test_llm_failures.py's run with speculation: a failure at every point of every
    step (verification steps too: each layer, the accept rule, the commit) leaves every request
    as the step found it, and the tokens are those of an uninterrupted plain run."""
    llm = _llm(speculative=SPEC, max_num_batched_tokens=budget)
    _oracle(llm, dict(enumerate(_uninterrupted())), corrupt_every=2)
    injector, hooks = _instrument(llm, monkeypatch)
    injector.wrap(llm._runner, "_verify", monkeypatch)  # the accept rule
    try:
        outputs, failures = _run(llm, injector)
    finally:
        for hook in hooks:
            hook.remove()
    assert outputs == _uninterrupted()
    assert llm._runner.counters["draft_tokens"] > 0
    assert llm._runner.counters["accepted_tokens"] > 0
    assert failures >= 20


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"method": "beam"}, ValueError),
        ({"method": 3}, TypeError),
        ({"num_tokens": 0}, ValueError),
        ({"num_tokens": 2.0}, TypeError),
        ({"num_tokens": 65}, ValueError),
        ({"min_ngram": 0}, ValueError),
        ({"min_ngram": 3, "max_ngram": 2}, ValueError),
        ({"max_ngram": True}, TypeError),
        ({"min_speedup": 0.0}, ValueError),
        ({"min_speedup": float("nan")}, ValueError),
        ({"min_speedup": 5.0}, ValueError),
        ({"min_speedup": "1"}, TypeError),
        ({"min_speedup": True}, TypeError),
    ],
)
def test_bad_configs_are_rejected(kwargs, exc):
    with pytest.raises(exc):
        flashdec.SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"method": "draft"}, ValueError, "needs draft_model="),
        ({"method": "draft", "draft_model": 3}, TypeError, "draft_model must be"),
        ({"draft_model": "tiny-llama"}, ValueError, "only with method='draft'"),
        ({"method": "eagle"}, ValueError, "method"),
    ],
)
def test_bad_draft_configs_are_rejected(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flashdec.SpeculativeConfig(**kwargs)


def _draft_llm(model, draft, **kwargs):
    spec = flashdec.SpeculativeConfig(
        method="draft", draft_model=draft, num_tokens=4, min_speedup=None
    )
    return flashdec.LLM(model, max_batch_size=4, speculative=spec, **kwargs)


def _draft_cache(llm):
    return llm._runner.drafter.engine.cache


@pytest.mark.parametrize("name", FAMILIES)
def test_a_draft_model_equal_to_the_target_is_always_accepted(name):
    """Draft = target (a copy of its weights): every draft is the target's own greedy token,
    so each verification step brings n = 5 tokens and keeps them all; the output is plain
    greedy's, and the draft cache ends empty and consistent."""
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    llm = _draft_llm(model, _model(name))
    assert llm.generate(prompts, NEW, ignore_eos=True) == _expected(name)
    stats = llm.last_stats
    assert stats.draft_tokens > 0 and stats.acceptance_rate == 1.0
    assert stats.tokens_per_step > 4  # 5 per verification, fewer only where a request ends
    cache = _draft_cache(llm)
    assert cache.metrics()["num_used_blocks"] == 0 and not cache.request_ids()
    cache.validate_invariants()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_an_unrelated_draft_model_changes_no_token(name):
    """Another model's drafts (other weights) are mostly rejected, and every rejection rolls
    back: the output is still exactly plain greedy's, over several rounds per request, with
    prompts longer than a catch-up chunk's limit too."""
    model = _model(name)
    vocab = model.config.vocab_size
    prompts = _prompts(vocab)
    draft = build_random_model("tiny-llama", dtype=torch.float32, device="cpu", seed=5)
    llm = _draft_llm(model, draft)
    assert llm.generate(prompts, NEW, ignore_eos=True) == _expected(name)
    stats = llm.last_stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens < stats.draft_tokens
    _draft_cache(llm).validate_invariants()


def test_draft_steps_leave_the_draft_cache_holding_only_verified_tokens(monkeypatch):
    """After each round the draft cache holds exactly the tokens the target verified (the
    context minus the token being verified next): drafts never stay in it."""
    from flashdec.engine import draft_model

    model = _model("tiny-llama")
    llm = _draft_llm(model, _model("tiny-llama"))
    drafter = llm._runner.drafter
    seen = []
    original = drafter.propose_many

    def propose_many(wanted):
        out = original(wanted)
        for rid, want in wanted.items():
            context = want.prompt.shape[0] + len(want.tokens) + len(want.tail)
            seen.append((drafter.engine.cache.seq_len(rid), context))
        return out

    monkeypatch.setattr(drafter, "propose_many", propose_many)
    monkeypatch.setattr(draft_model, "MAX_CATCH_UP_TOKENS", 4)  # prompts come in chunks
    prompts = _prompts(model.config.vocab_size)
    assert llm.generate(prompts, NEW, ignore_eos=True) == _expected("tiny-llama")
    assert seen and all(held == context for held, context in seen)


def _tiny_llama_with(**overrides):
    """tiny-llama's architecture with some config fields changed (random weights)."""
    from transformers import LlamaForCausalLM

    config = _model("tiny-llama").config.to_dict()
    config.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(type(_model("tiny-llama").config).from_dict(config)).float()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"vocab_size": 300}, r"draft model's vocabulary \(300\) is larger than the target's"),
        ({"max_position_embeddings": 64}, r"draft model's max_position_embeddings \(64\)"),
    ],
)
def test_a_draft_model_that_cannot_serve_the_target_is_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        _draft_llm(_model("tiny-llama"), _tiny_llama_with(**overrides))


def test_config_is_frozen_and_a_bad_argument_builds_nothing():
    config = flashdec.SpeculativeConfig()
    assert (config.method, config.num_tokens, config.min_ngram, config.max_ngram) == (
        "ngram",
        4,
        1,
        4,
    )
    with pytest.raises(AttributeError):
        config.num_tokens = 2
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        flashdec.LLM(_copying_model(), speculative={"method": "ngram"})


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_verified_drafts_keep_greedy_output_exact_on_the_gpu(name):
    """The same exactness on the GPU (float32, eager verification steps; plain decode steps
    between them are CUDA graphs)."""
    model = build_random_model(name, dtype=torch.float32, device="cuda", seed=0)
    prompts = _prompts(model.config.vocab_size)
    expected = flashdec.LLM(model, max_batch_size=4).generate(prompts, NEW, ignore_eos=True)
    llm = flashdec.LLM(model, max_batch_size=4, speculative=SPEC)
    _oracle(llm, dict(enumerate(expected)))
    assert llm.generate(prompts, NEW, ignore_eos=True) == expected
    assert 0 < llm.last_stats.accepted_tokens < llm.last_stats.draft_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_a_draft_model_keeps_greedy_output_exact_on_the_gpu(name):
    """The draft-model method on the GPU (bf16, the Triton kernels in both engines): a copy
    of the target as draft and an unrelated draft both give plain greedy's tokens."""
    model = build_random_model(name, dtype=torch.bfloat16, device="cuda", seed=0)
    prompts = _prompts(model.config.vocab_size)
    expected = flashdec.LLM(model, max_batch_size=4).generate(prompts, NEW, ignore_eos=True)
    for draft_seed in (0, 5):
        draft = build_random_model(name, dtype=torch.bfloat16, device="cuda", seed=draft_seed)
        llm = _draft_llm(model, draft)
        assert llm.generate(prompts, NEW, ignore_eos=True) == expected
        assert llm.last_stats.draft_tokens > 0
        _draft_cache(llm).validate_invariants()


def test_a_verification_step_reads_the_device_once(monkeypatch):
    """Every token a verification step decides (greedy targets, sampled accepts and next
    tokens, first tokens of prompts that end in it) reaches the host in ONE read: on a GPU
    that read is the step's one wait (the uploads around it are pinned and asynchronous)."""
    from flashdec.engine.runner import ModelRunner
    from flashdec.engine.sampling import SamplingParams

    model = _copying_model()
    prompts = [[7, 1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5, 6], [9, 8, 7, 9, 8, 7, 9] * 3]
    expected = flashdec.LLM(model, max_batch_size=4).generate(prompts, 12, ignore_eos=True)
    llm = flashdec.LLM(model, max_batch_size=4, max_num_batched_tokens=10, speculative=SPEC)
    sampled = SamplingParams(temperature=0.3, seed=5)
    rids = [llm.add_request(prompts[0], 12, ignore_eos=True)]
    rids.append(llm.add_request(prompts[1], 12, ignore_eos=True, sampling=sampled))
    truth = dict(zip(rids, expected, strict=False))
    _oracle(llm, truth)
    reads, calls = [0], []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counting(method):
        def read(self, *args, **kwargs):
            reads[0] += 1
            return method(self, *args, **kwargs)

        return read

    verify = ModelRunner._verify

    def counted_verify(self, logits, live, drafted, first_rids):
        monkeypatch.setattr(torch.Tensor, "tolist", counting(tolist))
        monkeypatch.setattr(torch.Tensor, "item", counting(item))
        reads[0] = 0
        try:
            return verify(self, logits, live, drafted, first_rids)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
            monkeypatch.setattr(torch.Tensor, "item", item)
            calls.append((reads[0], bool(first_rids), any(r in self.sampled for r in live)))

    monkeypatch.setattr(ModelRunner, "_verify", counted_verify)
    for _ in range(3):
        llm.step()
    rids.append(llm.add_request(prompts[2], 12, ignore_eos=True))  # its chunks join the steps
    truth[rids[2]] = expected[2]
    while llm.has_unfinished():
        llm.step()
    assert calls and all(n == 1 for n, _, _ in calls)
    assert any(first for _, first, _ in calls) and any(s for _, _, s in calls)
    assert [llm.output(rids[i]) for i in (0, 2)] == [expected[0], expected[2]]  # greedy: exact


@pytest.mark.gpu
def test_a_verification_step_synchronises_once_on_the_gpu(monkeypatch):
    """torch's sync debug mode flags every call that waits for the GPU (``.tolist()``,
    pageable uploads; an explicit ``cudaEventSynchronize`` is not one). Within a greedy
    verification step the runner's own flagged calls are exactly one: the read of the step's
    tokens. The engine's and the model's calls are counted apart (``engine.py`` uploads the
    step's query lengths). The wait for the previous step's token (``_peek``, before drafting)
    comes before the verification step."""
    import copy
    import os
    import warnings

    from flashdec.engine.runner import ModelRunner

    model = copy.deepcopy(_copying_model()).to("cuda")
    prompts = [[7, 1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5, 6], [9, 8, 7, 9, 8, 7, 9] * 3]
    expected = flashdec.LLM(model, max_batch_size=4).generate(prompts, 16, ignore_eos=True)
    llm = flashdec.LLM(model, max_batch_size=4, max_num_batched_tokens=10, speculative=SPEC)
    _oracle(llm, dict(enumerate(expected)))
    flagged = []
    run_verify = ModelRunner._run_verify
    runner_file = os.path.join("engine", "runner.py")

    def counted(self, *args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return run_verify(self, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                flagged.append(
                    sum(
                        "synchronizing" in str(w.message) and w.filename.endswith(runner_file)
                        for w in caught
                    )
                )

    monkeypatch.setattr(ModelRunner, "_run_verify", counted)
    assert llm.generate(prompts, 16, ignore_eos=True) == expected
    assert flagged and all(n == 1 for n in flagged), flagged


def _pool_bytes(groups) -> int:
    return sum(
        g.kv_size
        * g.num_blocks
        * g.layer_count
        * g.num_kv_heads
        * g.block_size
        * g.head_dim
        * torch.empty((), dtype=g.dtype).element_size()
        for g in groups
    )


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_a_draft_model_shares_the_kv_budget_and_gets_as_many_tokens(monkeypatch, name):
    """With a draft model the memory budget covers both pools: the target's full-attention
    pool shrinks (to half when the draft is the same model and has no window group), both fit
    the budget together, and the draft's pool holds as many blocks as the target's full one."""
    budget = 2**23  # about half of what the requests would take: the pools are sized by it
    monkeypatch.setattr("flashdec.kv_pool.kv_budget_bytes", lambda device, fraction: budget)
    model = _model(name)
    limits = {"max_batch_size": 64, "max_model_len": 512}
    alone = flashdec.LLM(model, **limits).engine.cache.kv_groups
    spec = flashdec.SpeculativeConfig(method="draft", draft_model=_model("tiny-llama"))
    llm = flashdec.LLM(model, speculative=spec, **limits)
    paired, draft = llm.engine.cache.kv_groups, _draft_cache(llm).kv_groups
    full_alone = [g.num_blocks for g in alone if g.window is None]
    full_paired = [g.num_blocks for g in paired if g.window is None]
    assert full_paired < full_alone
    if name == "tiny-llama":
        assert full_paired == [n // 2 for n in full_alone]
    assert _pool_bytes(paired) + _pool_bytes(draft) <= budget
    assert {g.num_blocks for g in draft} == set(full_paired)


def test_a_failure_anywhere_in_a_draft_model_round_changes_no_later_token(monkeypatch):
    """An exception at any point of a speculative step with a draft model — the draft's catch-up
    and draft steps (each layer, each commit), the target's verification — leaves every
    request as the step found it (the draft cache may keep verified tokens, never a draft),
    and stepping on gives exactly the tokens of an uninterrupted run without speculation."""
    from tests.test_llm_failures import _model as tiny

    spec = flashdec.SpeculativeConfig(
        method="draft",
        draft_model=build_random_model("tiny", dtype=torch.float32, device="cpu", seed=3),
        num_tokens=3,
        min_speedup=None,
    )
    llm = _llm(speculative=spec)
    assert llm.model is tiny()
    injector, hooks = _instrument(llm, monkeypatch)
    drafter = llm._runner.drafter
    injector.wrap(drafter.engine, "step_layer", monkeypatch)
    injector.wrap(drafter.engine, "commit_step", monkeypatch)
    try:
        outputs, failures = _run(llm, injector)
    finally:
        for hook in hooks:
            hook.remove()
    assert outputs == _uninterrupted()
    assert failures > 0 and llm.speculative_counters()["draft_tokens"] > 0
    cache = drafter.engine.cache
    cache.validate_invariants()
    assert not cache.request_ids() and cache.num_free_blocks == cache.max_blocks


def test_a_finished_request_leaves_the_draft_cache_before_it_is_released():
    """Requests driven by add_request / step and never released: each one's draft-cache
    blocks return as it finishes, so a long-running server's draft pool cannot fill up."""
    model = _model("tiny-llama")
    llm = _draft_llm(model, _model("tiny-llama"))
    prompts = _prompts(model.config.vocab_size)
    rids = [
        llm.add_request(p, n, ignore_eos=True) for p, n in zip(prompts, (3, 9, 14), strict=True)
    ]
    cache = _draft_cache(llm)
    while llm.has_unfinished():
        llm.step()
        live = {rid for rid in rids if llm.loop.is_live(rid)}
        assert set(cache.request_ids()) <= live
    assert [llm.output(rid) for rid in rids] == [
        e[:n] for e, n in zip(_expected("tiny-llama"), (3, 9, 14), strict=True)
    ]
    assert not cache.request_ids() and cache.num_free_blocks == cache.max_blocks


def test_the_config_repr_names_a_draft_model_without_printing_it():
    module = _model("tiny-llama")
    config = flashdec.SpeculativeConfig(method="draft", draft_model=module, num_tokens=2)
    assert repr(config) == (
        "SpeculativeConfig(method='draft', num_tokens=2, min_ngram=1, max_ngram=4, "
        "draft_model=<LlamaForCausalLM>)"
    )
    assert repr(flashdec.SpeculativeConfig()).endswith("max_ngram=4)")
    assert repr(flashdec.SpeculativeConfig(min_speedup=None)).endswith("min_speedup=None)")
    assert "draft_model='smollm2'" in repr(
        flashdec.SpeculativeConfig(method="draft", draft_model="smollm2")
    )
