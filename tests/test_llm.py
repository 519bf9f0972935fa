"""``flashdec.LLM``: tokens equal transformers' greedy ``generate`` through the whole runtime
(paged cache, engine, serving loop) on the CPU, for every supported family — batched, with
staggered arrivals, across block boundaries — and the API's checks."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

import flashdec
from flashdec.models import BUILTIN_SHAPES, build_random_model
from flashdec.runtime import available_host_bytes
from tests.cache.helpers import group_kv
from tests.models.greedy import hf_greedy
from tests.models.test_loading import _save_tokenizer

# the -swa shapes have 16-token sliding windows (Qwen2: every other layer; Mistral: all layers)
FAMILIES = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-qwen3",
    "tiny-qwen2-swa",
    "tiny-mistral-swa",
]
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


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prompts_in_the_running_batch_equal_transformers(name):
    """A 7-token step budget: every prompt but the first arrives in chunks, in steps that also
    decode the running requests (sliding-window families: chunks below their 16-token window),
    and the tokens are still exactly transformers' greedy ones."""
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model, max_batch_size=4, max_num_batched_tokens=7)
    rids = [llm.add_request(prompts[0], NEW)]
    records = []
    while llm.has_unfinished() or len(rids) < 3:
        if len(records) in (2, 4):
            rids.append(llm.add_request(prompts[len(rids)], NEW))
        records.append(llm.step())
    assert [llm.output(rid) for rid in rids] == _expected(name)
    steps = [r for r in records if r is not None]
    # the longest prompts took several steps each, and some of those steps decoded too
    assert sum(rids[2] in r.prefilled for r in steps) >= 33 // 7
    assert any(r.served and r.prefilled for r in steps)
    for rid in rids:
        llm.release(rid)
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0
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
    llm = flashdec.LLM(
        model, max_batch_size=2, block_size=8, append_backend="fused", decode_backend="triton"
    )
    assert llm.generate(prompts, 4) == [t[:4] for t in _expected("tiny-mistral-swa")[1:]]


def test_eos_stops_a_sequence_unless_ignored():
    model = _model("tiny-llama")
    prompt = _prompts(model.config.vocab_size)[0]
    free_run = flashdec.LLM(model).generate([prompt], NEW, ignore_eos=True)[0]
    eos = free_run[3]
    before = model.generation_config.eos_token_id  # the shared model: put it back as it was
    model.generation_config.eos_token_id = eos
    try:
        llm = flashdec.LLM(model)
        stopped = llm.generate([prompt], NEW)[0]
        assert stopped == free_run[: free_run.index(eos) + 1]
        assert llm.generate([prompt], NEW, ignore_eos=True)[0] == free_run
    finally:
        model.generation_config.eos_token_id = before


def test_one_new_token_and_sampling():
    model = _model("tiny-llama")
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model)
    assert llm.generate(prompts, 1) == [t[:1] for t in _expected("tiny-llama")]
    a = llm.generate(prompts, 8, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    b = llm.generate(prompts, 8, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert a == b and a != llm.generate(prompts, 8)  # reproducible, and not greedy
    assert all(len(t) == 8 for t in a)


def test_on_tokens_streams_every_prompts_growing_output():
    model = _model("tiny-llama")
    prompts = _prompts(model.config.vocab_size)
    llm = flashdec.LLM(model)
    seen = []
    out = llm.generate(prompts, NEW, on_tokens=seen.append)
    assert out == _expected("tiny-llama") and seen[-1] == out
    for before, after in itertools.pairwise(seen):  # each call extends the last
        assert all(a[: len(b)] == b for b, a in zip(before, after, strict=True))
    assert len({sum(map(len, s)) for s in seen}) > NEW // 2  # token by token, not at the end
    before = llm.engine.cache.metrics()
    with pytest.raises(TypeError, match="on_tokens must be a callable"):
        llm.generate(prompts, NEW, on_tokens=5)
    assert llm.loop.idle and llm.engine.cache.metrics() == before


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
        ([[1, 2], [vocab]], ValueError),  # the good prompt before the bad one is not queued
        ([[1, 2], [1] * 60], ValueError),
        ([[1, 2], "text"], ValueError),
    ):
        with pytest.raises(exc):
            llm.generate(bad, NEW)
        assert llm.loop.idle and llm.engine.cache.metrics()["num_requests"] == 0
        assert llm._runner.requests == {} and llm._next_id == 0  # nothing queued, no id taken
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2]], 4, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate([[1, 2]], 0)
    assert llm.engine.cache.metrics()["num_requests"] == 0


def test_construction_checks():
    model = _model("tiny-llama")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        flashdec.LLM(42)
    with pytest.raises(ValueError, match="neither a local model directory nor a built-in"):
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
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
    )
    with pytest.raises(ValueError, match=r"(?i)mixtral|expert"):
        flashdec.LLM(MixtralForCausalLM(config))


# ---------------------------------------------------------------------- FP8 KV cache
@functools.cache
def _bf16_model(name: str):
    return build_random_model(name, dtype=torch.bfloat16, device="cpu", seed=0)


def _teacher_forced_logits(llm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 decode logits ``[len(tokens), V]`` after ``prompt``, feeding ``tokens`` in turn
    (the same context for every KV dtype, unlike free-running generation)."""
    engine, device = llm.engine, llm.adapter.spec.device
    engine.add_request("forced")
    engine.admit("forced")
    tx = engine.begin_prefill(["forced"], [len(prompt)])
    ids = torch.tensor(prompt, device=device)
    llm.adapter.prefill(ids, lambda i, k, v: engine.prefill_layer(tx, i, k, v))
    engine.commit_step(tx)
    rows = []
    for token in tokens:
        tx = engine.begin_step(["forced"])
        attention = lambda i, q, k, v, tx=tx: engine.step_layer(tx, i, q, k, v)  # noqa: E731
        rows.append(llm.adapter.decode(torch.tensor([token], device=device), attention)[0].float())
        engine.commit_step(tx)
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-swa"])
def test_fp8_kv_cache_logits_stay_within_fp8_error(name):
    """Teacher-forced decode logits of an FP8 KV cache against the bf16 one. A random tiny
    model's logits are nearly flat, so its FP8 error (e4m3: 3 mantissa bits on every K/V) flips
    some argmaxes; measured here: relative logit error 0.09 (llama) / 0.15 (qwen2-swa), argmax
    agreement 0.83 / 0.67 — the same as bf16 with K/V fake-quantized through FP8."""
    model = _bf16_model(name)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (17,), generator=gen).tolist()
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=gen).tolist()
    want = _teacher_forced_logits(flashdec.LLM(model), prompt, tokens)
    llm = flashdec.LLM(model, kv_cache_dtype="fp8")
    assert {spec.dtype for spec in llm.engine.cache.kv_groups} == {torch.float8_e4m3fn}
    assert llm.engine.activation_dtype == torch.bfloat16
    got = _teacher_forced_logits(llm, prompt, tokens)
    assert ((got - want).norm() / want.norm()).item() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.5


def test_fp8_kv_cache_generates_through_the_interpreted_kernels():
    """Fused quantizing append + FP8 split-KV decode (interpreted) against the torch backends on
    the same FP8 cache, teacher-forced; then free-running greedy tokens against bf16's."""
    model = _bf16_model("tiny-qwen2")
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (9,), generator=gen).tolist()
    tokens = torch.randint(0, model.config.vocab_size, (6,), generator=gen).tolist()
    torch_fp8 = _teacher_forced_logits(flashdec.LLM(model, kv_cache_dtype="fp8"), prompt, tokens)
    llm = flashdec.LLM(
        model, kv_cache_dtype="fp8", append_backend="fused", decode_backend="triton", block_size=4
    )
    kernel_fp8 = _teacher_forced_logits(llm, prompt, tokens)
    assert ((kernel_fp8 - torch_fp8).norm() / torch_fp8.norm()).item() < 0.05
    prompts = _prompts(model.config.vocab_size)[:2]
    bf16 = flashdec.LLM(model, max_batch_size=2).generate(prompts, 6)
    fp8_llm = flashdec.LLM(
        model,
        max_batch_size=2,
        kv_cache_dtype="fp8",
        kv_scale=0.5,
        append_backend="fused",
        decode_backend="triton",
    )
    fp8 = fp8_llm.generate(prompts, 6)
    assert [len(t) for t in fp8] == [6, 6]
    # the first token comes from the prompt's (unquantized) attention: always equal
    assert [t[0] for t in fp8] == [t[0] for t in bf16]


def test_fp8_kv_pool_counts_one_byte_per_element(monkeypatch):
    model = _bf16_model("tiny-llama")
    monkeypatch.setattr("flashdec.kv_pool.kv_budget_bytes", lambda device, fraction: 2**20)
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = flashdec.LLM(model, kv_cache_dtype=kv, max_batch_size=4096, max_model_len=256)
        cache = llm.engine.cache
        assert group_kv(cache, 0)[0].element_size() == (1 if kv == "fp8" else 2)
        blocks[kv] = cache.kv_groups[0].num_blocks
    assert blocks["fp8"] == 2 * blocks["auto"]
    scales = flashdec.LLM(
        model, kv_cache_dtype="fp8", kv_scale=0.25
    ).engine.cache.layout.group_kv_scales(0)
    assert all(torch.equal(s, torch.full_like(s, 0.25)) for s in scales)


def test_kv_cache_dtype_checks():
    model = _bf16_model("tiny-llama")
    assert flashdec.LLM(model, kv_cache_dtype="auto").engine.cache.kv_groups[0].dtype == (
        torch.bfloat16
    )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        flashdec.LLM(model, kv_cache_dtype="fp16")
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        flashdec.LLM(model, kv_cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        flashdec.LLM(_model("tiny-llama"), kv_cache_dtype="fp8")  # a float32 model
    with pytest.raises(ValueError, match="kv_scale"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scale=0.0)
    with pytest.raises(ValueError, match="kv_scale"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scale=float("inf"))
    with pytest.raises(TypeError, match="kv_scale"):
        flashdec.LLM(model, kv_cache_dtype="fp8", kv_scale="1")
    with pytest.raises(ValueError, match="only with kv_cache_dtype='fp8'"):
        flashdec.LLM(model, kv_scale=2.0)


@pytest.mark.gpu
def test_fp8_kv_cache_on_the_gpu_graphs_equal_eager():
    """FP8 KV through the fused quantizing append and the FP8 decode kernel: CUDA-graph replay
    gives the eager tokens, and teacher-forced logits stay within FP8 error of bf16's."""
    model = build_random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", seed=0)
    prompts = _prompts(model.config.vocab_size)
    graphed = flashdec.LLM(model, max_batch_size=4, kv_cache_dtype="fp8")
    eager = flashdec.LLM(model, max_batch_size=4, kv_cache_dtype="fp8", cuda_graphs=False)
    assert graphed.cuda_graphs and graphed.engine.append_backend == "fused"
    assert graphed.generate(prompts, NEW) == eager.generate(prompts, NEW)
    assert graphed._runner.graph_replays > 0
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (17,), generator=gen).tolist()
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=gen).tolist()
    want = _teacher_forced_logits(flashdec.LLM(model, cuda_graphs=False), prompt, tokens)
    got = _teacher_forced_logits(
        flashdec.LLM(model, kv_cache_dtype="fp8", cuda_graphs=False), prompt, tokens
    )
    assert ((got - want).norm() / want.norm()).item() < 0.25


@pytest.mark.gpu
def test_graphs_replay_across_batch_sizes_without_a_capture():
    """Batch 1, then a batch of 12, then batch 1 again: the warm start sized the cache's slot
    buffers for the largest bucket, so every step replays a graph captured before it (none is
    made while serving) and the tokens equal eager decoding."""
    model = build_random_model("tiny-llama", dtype=torch.bfloat16, device="cuda", seed=0)
    gen = torch.Generator().manual_seed(3)
    one = [torch.randint(0, model.config.vocab_size, (9,), generator=gen).tolist()]
    many = [
        torch.randint(0, model.config.vocab_size, (5 + i,), generator=gen).tolist()
        for i in range(12)
    ]
    graphed = flashdec.LLM(model, max_batch_size=16)
    eager = flashdec.LLM(model, max_batch_size=16, cuda_graphs=False)
    for prompts in (one, many, one):
        assert graphed.generate(prompts, NEW, ignore_eos=True) == eager.generate(
            prompts, NEW, ignore_eos=True
        )
    assert graphed._runner.graph_replays > 0 and graphed._runner.graphs.eager_steps == 0


_WORKSPACE_SCRIPT = """
import torch, flashdec
from flashdec.models import BUILTIN_SHAPES
from flashdec.models.shapes import random_model
config = BUILTIN_SHAPES["llama3-8b-shape"].make_config()
config.num_hidden_layers = 2  # the 8B GEMM shapes (cuBLAS picks workspace kernels) at 2 layers
model = random_model(config, dtype=torch.bfloat16, device="cuda", seed=0)
gen = torch.Generator().manual_seed(5)
# 48 + 48 tokens: mixed steps of exactly a piecewise bucket (48, 96), so their GEMMs have the
# eager LLM's shapes (a padded step's cuBLAS kernel may round differently); no prefix cache:
# the second round takes the first one's path
prompts = [torch.randint(0, 1000, (48,), generator=gen).tolist() for i in range(2)]
options = dict(max_batch_size=4, max_model_len=256, enable_prefix_caching=False)
graphed = flashdec.LLM(model, **options)  # captures every graph
graphed.generate(prompts[:1], 8, ignore_eos=True)  # replays bucket 1
before = graphed.generate(prompts, 8, ignore_eos=True)  # bucket 2's graphs
graphs = graphed._runner.graphs
for key in [key for key in graphs.graphs if key[0] != 2]:
    del graphs.graphs[key]  # every other graph goes, the first captured ones too
torch._C._cuda_clearCublasWorkspaces()  # as torch.compile's CUDA graph trees do
torch.cuda.empty_cache()
again = graphed.generate(prompts, 8, ignore_eos=True)  # replays bucket 2's graphs
torch.cuda.synchronize()
eager = flashdec.LLM(model, **options, cuda_graphs=False)
want = eager.generate(prompts, 8, ignore_eos=True)
assert again == before == want, (again, before, want)
assert graphed._runner.graph_replays > 0 and graphed._runner.mixed_graphs.replays > 0
print("OK")
"""


@pytest.mark.gpu
def test_graphs_survive_cleared_blas_workspaces_and_a_dropped_first_graph():
    """A captured GEMM bakes in the cuBLAS workspace's address: each graph's workspace must
    live in the graphs' own pool (kept while a graph lives), or clearing the workspaces —
    torch.compile's CUDA graph trees do — leaves later graphs replaying into freed, then
    unmapped, memory (an illegal
    memory access on the H200 after transformers' compiled generate). A subprocess: such a
    fault poisons the CUDA context of the whole process."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _WORKSPACE_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


def test_bad_arguments_fail_before_anything_runs():
    model = _model("tiny-llama")
    llm = flashdec.LLM(model, max_model_len=64)
    with pytest.raises(TypeError, match="progress must be a callable"):
        llm.generate([[1, 2]], 4, progress=5)
    assert llm.loop.step_index == 0 and llm.engine.cache.metrics()["num_requests"] == 0
    bad = (
        ([np.float64(1.0)], "numpy.float64 at index 0"),
        ([1, np.bool_(True)], "numpy.bool.* at index 1"),
        ([1, True], "got bool at index 1"),
        (np.array([1.0, 2.0]), "array of float64"),
        (torch.tensor([True]), "array of torch.bool"),
        ({1, 2}, "got set"),
    )
    for prompt, message in bad:
        with pytest.raises(TypeError, match=message):
            llm.generate([prompt], 4)
        with pytest.raises(TypeError, match=message):
            llm.add_request(prompt, 4)
    with pytest.raises(ValueError, match="1-D"):
        llm.add_request(np.array([[1, 2]]), 4)
    assert llm._runner.requests == {} and llm._next_id == 0
    ints = [5, 6, 7]
    expected = llm.generate([ints], 4)
    for same in (np.array(ints), [np.int64(t) for t in ints], torch.tensor(ints), tuple(ints)):
        assert llm.generate([same], 4) == expected


def test_construction_fails_cleanly_before_allocating():
    model = _model("tiny-llama")
    with pytest.raises(ValueError, match="not available"):
        flashdec.LLM(model, device="cuda:99" if torch.cuda.is_available() else "cuda")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        flashdec.LLM(model, device="meta")
    with pytest.raises(TypeError, match=r"device must be a str or torch\.device"):
        flashdec.LLM(model, device=0.5)
    assert next(model.parameters()).device.type == "cpu"  # the model did not move
    for fraction in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"gpu_memory_fraction must be in \(0, 1\]"):
            flashdec.LLM(model, gpu_memory_fraction=fraction)
    for fraction in ("0.5", True):
        with pytest.raises(TypeError, match="gpu_memory_fraction must be a float"):
            flashdec.LLM(model, gpu_memory_fraction=fraction)
    assert flashdec.LLM(model, gpu_memory_fraction=1, max_batch_size=2).engine is not None
    too_many = available_host_bytes() // 64 + 1  # every block takes more than 64 bytes
    for name in ("tiny-llama", "tiny-qwen2-swa"):  # one pool, and one pool per KV group
        with pytest.raises(ValueError, match=r"num_blocks=\d+ needs a KV pool of .* free on cpu"):
            flashdec.LLM(_model(name), num_blocks=too_many)


def test_a_model_name_is_a_built_in_shape_or_a_directory():
    llm = flashdec.LLM("tiny", max_batch_size=2)
    assert llm.adapter.spec.num_layers == BUILTIN_SHAPES["tiny"].make_config().num_hidden_layers
    assert len(llm.generate([[1, 2, 3]], 2)[0]) == 2
    with pytest.raises(ValueError, match=r"nor a built-in shape \(tiny, .*tiny-llama"):
        flashdec.LLM("tiny-lama")
