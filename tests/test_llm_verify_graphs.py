"""Verification steps as CUDA graphs (speculative decoding): which steps pad to a batch bucket
and K drafts a row, that padding drafts are never accepted, greedy output unchanged (CPU: the
padded steps run eagerly); on the GPU a verification step replays a graph captured at the warm
start, and nothing is captured while serving."""

from __future__ import annotations

import pytest
import torch

import flashdec
from flashdec.engine.verify_graphs import VerifyGraphs
from flashdec.models import build_random_model
from tests.test_llm import _model, _prompts
from tests.test_llm_speculative import NEW, SPEC, _expected, _oracle

K = SPEC.num_tokens


def _padded(llm) -> VerifyGraphs:
    """The runner's verification steps through VerifyGraphs with no graph captured (CPU):
    every step that qualifies runs padded, eagerly."""
    runner = llm._runner
    runner.verify_graphs = VerifyGraphs(
        llm.engine,
        runner._verify_forward,
        max_batch_size=llm.max_batch_size,
        num_q_heads=llm.adapter.spec.num_q_heads,
        n=K + 1,
    )
    return runner.verify_graphs


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_padded_verification_steps_keep_greedy_output_exact(name):
    model = _model(name)
    llm = flashdec.LLM(model, max_batch_size=4, speculative=SPEC)
    graphs = _padded(llm)
    _oracle(llm, dict(enumerate(_expected(name))))
    assert llm.generate(_prompts(model.config.vocab_size), NEW, ignore_eos=True) == _expected(name)
    assert graphs.eager_steps > 0 and graphs.replays == 0  # 3 rows padded to the bucket of 4
    assert 0 < llm.last_stats.accepted_tokens < llm.last_stats.draft_tokens


def test_which_verification_steps_pad_to_a_bucket():
    llm = flashdec.LLM(_model("tiny-llama"), max_batch_size=4, speculative=SPEC)
    runner = llm._runner
    assert runner.verify_graphs is None  # no CUDA graphs on the CPU
    runner._caps = {"a": K, "b": K + 3, "c": K}
    assert runner._verify_bucket(["a", "b", "c"], []) is None  # no graphs: packed
    graphs = _padded(llm)
    assert graphs.buckets == (1, 2, 4) and graphs.n == K + 1
    assert runner._verify_bucket(["a", "b", "c"], []) == 4
    assert runner._verify_bucket(["a"], []) == 1
    assert runner._verify_bucket(["a"], [("d", 7)]) is None  # a prompt chunk: packed
    assert runner._verify_bucket([], []) is None
    runner._caps["c"] = K - 1  # its commitment (or a window) leaves fewer than K drafts
    assert runner._verify_bucket(["a", "b", "c"], []) is None
    assert runner._verify_bucket(["a", "b"], []) == 2
    runner.max_step_tokens = 2 * (K + 1) - 1  # two padded rows do not fit a step
    assert runner._verify_bucket(["a", "b"], []) is None
    assert runner._verify_bucket(["a"], []) == 1


def test_padding_drafts_are_never_accepted():
    """A row with one real draft padded to K: the target agreeing with the padding ids (0)
    accepts none of them; the accept count and the emitted tokens stop at the real drafts."""
    llm = flashdec.LLM(_model("tiny-llama"), max_batch_size=4, speculative=SPEC)
    runner = llm._runner
    rids = [llm.add_request([5, 6, 7], 8, ignore_eos=True) for _ in range(2)]
    vocab, n = llm.adapter.spec.vocab_size, K + 1
    logits = torch.zeros(2 * n, vocab)
    logits[0, 9] = 1  # row 0's target matches its real draft 9 ...
    logits[1:n, 0] = 1  # ... then agrees with every padding id
    logits[n:, 0] = 1  # row 1 has no real draft: its target is 0, its padding never taken
    emitted, accepted = runner._verify(logits, rids, [[9], []], [], width=n)
    assert emitted == [[9, 0], [0]] and accepted == [1, 0]


def test_a_step_that_cannot_pad_runs_packed_and_a_bad_n_is_refused():
    llm = flashdec.LLM(_model("tiny-llama"), max_batch_size=4, speculative=SPEC)
    with pytest.raises(ValueError, match="n >= 2"):
        VerifyGraphs(llm.engine, None, max_batch_size=4, num_q_heads=4, n=1)
    graphs = _padded(llm)
    llm._runner.max_step_tokens = K  # never room for a padded row: every step packed
    prompts = _prompts(llm.adapter.spec.vocab_size)
    _oracle(llm, dict(enumerate(_expected("tiny-llama"))))
    assert llm.generate(prompts, NEW, ignore_eos=True) == _expected("tiny-llama")
    assert graphs.eager_steps == 0 and graphs.replays == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "dtype"), [("tiny-llama", torch.float32), ("tiny-qwen2-swa", torch.bfloat16)]
)
def test_verification_graphs_keep_greedy_output_exact_on_the_gpu(name, dtype):
    """Greedy output with speculation and verification graphs is plain greedy's, token for
    token; verification steps replay graphs captured at the warm start (one per bucket and
    launch key, n = K + 1) and nothing is captured while serving."""
    model = build_random_model(name, dtype=dtype, device="cuda", seed=0)
    prompts = _prompts(model.config.vocab_size)
    expected = flashdec.LLM(model, max_batch_size=4).generate(prompts, NEW, ignore_eos=True)
    llm = flashdec.LLM(model, max_batch_size=4, speculative=SPEC)
    graphs = llm._runner.verify_graphs
    assert graphs is not None and graphs.warm_start is not None
    assert set(graphs.warm_start.buckets) == {1, 2, 4}
    captured = dict(graphs.graphs)
    assert captured and all(g.tokens_per_row == K + 1 for g in captured.values())
    _oracle(llm, dict(enumerate(expected)))
    assert llm.generate(prompts, NEW, ignore_eos=True) == expected
    assert graphs.replays > 0 and graphs.eager_steps == 0
    assert graphs.graphs == captured  # nothing captured while serving
    assert 0 < llm.last_stats.accepted_tokens < llm.last_stats.draft_tokens
