"""The warm start: every decode graph captured before ``flashdec.LLM(...)`` returns, keyed by
(batch bucket, decode launches) so that lengths crossing plan buckets neither re-capture nor run
eagerly; ``begin_step(plan_len=...)``, which plans a step for requests not there yet."""

from __future__ import annotations

import pytest
import torch

import flashdec
from flashdec.engine.decode_graphs import DecodeGraphs, placeholder_requests
from flashdec.engine.decode_state import launch_key
from flashdec.kernels import plan_decode
from flashdec.models import build_random_model
from tests.cache.snapshot import assert_same_state, snapshot
from tests.engine.conftest import make_engine


def _tiny(device: str = "cpu", dtype=torch.float32):
    return build_random_model("tiny-llama", dtype=dtype, device=device, seed=0)


def test_a_single_pass_plan_keys_without_its_split_length():
    """Single-pass plans of different lengths launch the same kernel on the same grid: one
    key. Split plans whose split count differs do not share one."""
    short, long = (
        plan_decode(
            64, 32, 8, 128, 16, n, torch.bfloat16, "cpu", max_blocks_per_seq=256, num_splits=1
        )
        for n in (512, 4096)
    )
    assert short.tokens_per_split != long.tokens_per_split
    assert launch_key(short) == launch_key(long)
    two, four = (
        plan_decode(1, 32, 8, 128, 16, 4096, torch.bfloat16, "cpu", num_splits=s) for s in (2, 4)
    )
    assert launch_key(two) != launch_key(four)


def test_plan_lengths_cover_every_key_once():
    llm = flashdec.LLM(_tiny(), max_batch_size=8, cuda_graphs=False)
    assert llm.warm_start is None and llm._runner.graphs is None  # no graphs on the CPU
    graphs = DecodeGraphs(llm.engine, None, max_batch_size=8, num_q_heads=4)
    assert graphs.buckets == (1, 2, 4, 8)
    for bucket in graphs.buckets:
        lengths = graphs.plan_lengths(bucket)
        keys = [graphs.key(bucket, n) for n in lengths]
        assert len(set(keys)) == len(keys)
        limit = llm.engine.cache.max_blocks_per_seq * llm.block_size
        every = {graphs.key(bucket, n) for n in range(1, limit + 1, 7)}
        assert every == set(keys)  # every reachable length maps to a captured key


def test_placeholder_requests_leave_the_cache_as_it_was():
    llm = flashdec.LLM(_tiny(), max_batch_size=4, cuda_graphs=False)
    cache = llm.engine.cache

    # everything but the version and the transactions' history and counts: they move on
    moving = ("version", "num_aborted_transactions", "terminal_transaction_history_count")

    def state():
        now = {k: v for k, v in snapshot(cache).items() if k not in ("version", "history")}
        now["metrics"] = {k: v for k, v in now["metrics"].items() if k not in moving}
        return now

    before = state()
    with placeholder_requests(llm.engine, 3) as rids:
        tx = llm.engine.begin_step(rids, plan_len=200)
        llm.engine.abort_step(tx)
        assert cache.metrics()["num_requests"] == 3
    after = state()
    assert after.pop("k").equal(before.pop("k")) and after.pop("v").equal(before.pop("v"))
    assert after == before
    cache.validate_invariants()
    llm.generate([[1, 2, 3]], 4)  # placeholder ids are free again; the LLM serves as before


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_begin_step_rejects_a_bad_plan_len_and_changes_nothing(bad):
    engine = make_engine()
    engine.add_request("a")
    engine.admit("a")
    before = snapshot(engine.cache)
    with pytest.raises((TypeError, ValueError), match="plan_len"):
        engine.begin_step(["a"], plan_len=bad)
    assert_same_state(engine.cache, before)
    assert not engine.has_open_step


def test_plan_len_is_for_steps_whose_rows_bring_equal_tokens_only():
    engine = make_engine()
    for rid in ("a", "b"):
        engine.add_request(rid)
        engine.admit(rid)
    before = snapshot(engine.cache)
    with pytest.raises(ValueError, match="rows all bring the same number of tokens"):
        engine.begin_step(["a", "b"], num_tokens=[3, 2], plan_len=64)
    assert_same_state(engine.cache, before)
    assert not engine.has_open_step
    tx = engine.begin_step(["a", "b"], num_tokens=[3, 3], plan_len=64)  # a verification step
    assert engine._open.plan_len == 64 and engine._open.tokens_per_row == 3
    engine.abort_step(tx)
    assert [engine.cache.seq_len(r) for r in ("a", "b")] == [0, 0]


def _prompts(vocab: int, lens, seed: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.gpu
def test_gpu_warm_start_serves_every_step_from_a_graph_captured_before_it():
    """After construction no graph is captured and no decode step runs eagerly, over batch
    sizes 1..12 and lengths that cross plan buckets both ways; tokens equal eager decoding."""
    model = _tiny("cuda", torch.bfloat16)
    vocab = model.config.vocab_size
    graphed = flashdec.LLM(model, max_batch_size=16, max_model_len=512)
    eager = flashdec.LLM(model, max_batch_size=16, max_model_len=512, cuda_graphs=False)
    warm = graphed.warm_start
    graphs = graphed._runner.graphs
    assert warm.buckets == graphs.buckets == (1, 2, 4, 8, 16)
    assert (
        warm.graphs == len(graphs.graphs) == sum(len(graphs.plan_lengths(b)) for b in warm.buckets)
    )
    assert graphed.engine.cache.metrics()["num_requests"] == 0
    assert graphed.engine.cache.metrics()["num_used_blocks"] == 0
    captured = dict(graphs.graphs)
    # 120 -> 184 tokens crosses the 128 plan bucket; then short ones again, then 12 at once
    for lens in ([120], [3, 250], [9], [5 + 7 * i for i in range(12)], [60, 300]):
        prompts = _prompts(vocab, lens)
        assert graphed.generate(prompts, 64, ignore_eos=True) == eager.generate(
            prompts, 64, ignore_eos=True
        )
    assert graphs.graphs == captured  # the same objects: nothing re-captured
    assert graphs.eager_steps == 0 and graphs.replays > 0
    graphed.engine.cache.validate_invariants()


@pytest.mark.gpu
def test_gpu_warm_start_fits_a_small_pool_and_serves_it():
    """A pool smaller than the largest bucket: the buckets that fit are captured, the rest of
    the steps run eagerly (counted), and the tokens still equal eager decoding."""
    model = _tiny("cuda", torch.bfloat16)
    graphed = flashdec.LLM(model, max_batch_size=8, num_blocks=6, max_model_len=64)
    eager = flashdec.LLM(model, max_batch_size=8, num_blocks=6, max_model_len=64, cuda_graphs=False)
    assert graphed.warm_start.buckets == (1, 2, 4)
    prompts = _prompts(model.config.vocab_size, [5, 6, 7, 9, 3])
    assert graphed.generate(prompts, 8, ignore_eos=True) == eager.generate(
        prompts, 8, ignore_eos=True
    )
    assert graphed._runner.graphs.eager_steps > 0  # the 5-request steps: bucket 8, not captured


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral-swa"])
@pytest.mark.parametrize("num_blocks", [None, 5, 2])  # 2: no room for a chunk
def test_the_mixed_warm_up_steps_leave_nothing_behind(name, num_blocks):
    """The warm start's mixed steps (one committed chunk, one aborted step over its context)
    run on placeholders, which take their blocks with them: the pool is whole again."""
    model = build_random_model(name, dtype=torch.float32, device="cpu", seed=0)
    llm = flashdec.LLM(model, max_batch_size=4, num_blocks=num_blocks, cuda_graphs=False)
    cache = llm.engine.cache
    free = cache.num_free_blocks
    with placeholder_requests(llm.engine, 4) as rids:
        llm._runner._compile_mixed_steps(rids)
        assert cache.metrics()["num_committed_transactions"] == (num_blocks != 2)
    assert cache.num_free_blocks == free and cache.metrics()["num_requests"] == 0
    cache.validate_invariants()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = flashdec.LLM(model, max_batch_size=4, num_blocks=num_blocks, cuda_graphs=False)
    assert llm.generate(prompts, 6) == want.generate(prompts, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("max_batch", [16, 1])
def test_gpu_serving_after_the_warm_start_compiles_no_kernel(max_batch):
    """Triton compiles a kernel per constexpr set and per class of its int arguments: after
    the warm start, steps of every batch size and prompt length (chunked, beside decode rows,
    over long and empty contexts) compile nothing: no prompt waits for a compile. The second
    round repeats the prompts, so every one starts from a prefix-cache hit (as the second pass
    of a replayed trace does): those steps compile nothing either."""
    from flashdec.runtime import KernelBuilds

    model = _tiny("cuda", torch.bfloat16)
    llm = flashdec.LLM(  # a pool that keeps the first round's blocks cached for the second
        model,
        max_batch_size=max_batch,
        max_model_len=512,
        max_num_batched_tokens=256,
        num_blocks=1024,
    )
    vocab = model.config.vocab_size
    rounds = ([300], [5, 17, 33], [2, 255, 100, 64, 3, 31, 16, 1, 7, 480], [129] * 16) * 2
    with KernelBuilds() as builds:
        for lens in rounds:
            rids = [llm.add_request(p, 24, ignore_eos=True) for p in _prompts(vocab, lens)]
            while llm.has_unfinished():
                llm.step()
            for rid in rids:
                llm.release(rid)
    assert llm.engine.cache.prefix_cache.stats()["hit_tokens"] > 0  # the second round hit
    assert builds.count == 0, builds.names


def test_kernel_builds_counts_through_tritons_hook_and_restores_it():
    import triton

    from flashdec.runtime import KernelBuilds

    seen = []
    runtime = triton.knobs.runtime
    before = runtime.jit_post_compile_hook
    earlier = runtime.jit_post_compile_hook = lambda **kw: seen.append(kw)  # one already there
    try:
        with KernelBuilds() as builds:
            hook = runtime.jit_post_compile_hook
            # what Triton 3.6 passes: a JitFunctionInfo, and the build's description
            from triton.runtime.jit import JitFunctionInfo

            fn = JitFunctionInfo(None, "_tiny", None)
            hook(fn=fn, key="k", repr="_tiny[num_warps=4](n: i32)")
            hook(fn=fn, key="k2", repr="_tiny[num_warps=4](n: constexpr)")
        assert builds.count == 2 and builds.names == {"_tiny": 2}
        assert builds.signatures == [
            "_tiny[num_warps=4](n: i32)",
            "_tiny[num_warps=4](n: constexpr)",
        ]
        assert len(seen) == 2  # the earlier hook still ran
        assert runtime.jit_post_compile_hook is earlier  # restored on exit
    finally:
        runtime.jit_post_compile_hook = before


def test_the_torch_append_turns_graphs_off_and_refuses_them():
    """A graph of the torch append would replay the capture's row count, writing a later step's
    padding rows into the pool: by default the LLM runs without graphs (on CUDA; the CPU has
    none anyway), and asking for them is refused before anything is built."""
    model = _tiny()
    for backend in ("torch", None):
        llm = flashdec.LLM(model, max_batch_size=2, max_model_len=64, append_backend=backend)
        assert not llm.cuda_graphs and llm.warm_start is None
    with pytest.raises(ValueError, match="needs append_backend 'fused' or 'triton'"):
        flashdec.LLM(model, max_model_len=64, append_backend="torch", cuda_graphs=True)


@pytest.mark.gpu
def test_gpu_the_torch_append_runs_without_graphs():
    model = _tiny("cuda", torch.bfloat16)
    llm = flashdec.LLM(model, max_batch_size=4, max_model_len=64, append_backend="torch")
    assert not llm.cuda_graphs and llm._runner.graphs is None
    graphed = flashdec.LLM(model, max_batch_size=4, max_model_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]  # two rows in a bucket of two: no padding
    assert llm.generate(prompts, 6) == graphed.generate(prompts, 6)


@pytest.mark.gpu
def test_gpu_the_torch_decode_runs_without_graphs_and_refuses_them():
    model = _tiny("cuda", torch.bfloat16)
    llm = flashdec.LLM(model, max_batch_size=4, max_model_len=64, decode_backend="torch")
    assert not llm.cuda_graphs and llm.warm_start is None and llm._runner.graphs is None
    assert len(llm.generate([[1, 2, 3]], 4)[0]) == 4
    with pytest.raises(ValueError, match="cuda_graphs=True needs decode_backend='triton'"):
        flashdec.LLM(model, max_model_len=64, decode_backend="torch", cuda_graphs=True)


def test_a_failing_warm_up_step_raises_its_own_error_and_leaves_nothing_open():
    """A layer that fails inside a warm-up step aborts it (step_layer's rule): the warm start
    must raise that error, not a second one from aborting again, and leave no step open."""
    llm = flashdec.LLM(_tiny(), max_batch_size=4, cuda_graphs=False)
    engine = llm.engine

    def broken_forward(tx, slots):
        engine.step_layer(tx, 0, *(torch.zeros(1, 1, 1),) * 3)  # wrong shapes: ValueError

    graphs = DecodeGraphs(engine, broken_forward, max_batch_size=4, num_q_heads=4)
    with placeholder_requests(engine, 2) as rids:
        with pytest.raises(ValueError):
            graphs._step(rids, 64, capture=False)
        assert not engine.has_open_step
    assert engine.cache.metrics()["num_requests"] == 0
