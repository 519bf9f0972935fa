"""CUDA-graph capture and replay of a step's layers (GPU), and the API's refusals (CPU)."""

import contextlib
import gc

import pytest
import torch

from flashdec import DecodeEngine, PagedKVCache, apply_rope, paged_decode_attention_ref
from flashdec.runtime import capture_cuda_graph
from tests.cache.helpers import decode_inputs
from tests.engine.conftest import graphed_step, make_engine, run_step

LAYERS, HQ, HKV, D, BS = 3, 8, 2, 64, 16


@pytest.mark.parametrize(
    ("append_backend", "decode_backend", "message"),
    [
        ("torch", "torch", "decode_backend='triton'"),  # the torch decode syncs the host
        # the torch append writes the capture's live row count on every replay: a later step
        # with padding rows (block id -1) would write them into the pool's last block
        ("torch", "triton", "append_backend 'fused' or 'triton'"),
        ("triton", "triton", "CUDA"),
    ],
)
def test_capture_and_replay_refuse_what_they_cannot_do(
    gen, append_backend, decode_backend, message
):
    engine = make_engine(append_backend=append_backend, decode_backend=decode_backend)  # CPU
    for rid in ("a", "b"):
        engine.add_request(rid)
        engine.admit(rid)
    run_step(engine, ["a", "b"], gen)
    tx = engine.begin_step(["a", "b"])
    with pytest.raises(RuntimeError, match=message):
        engine.capture_step(tx, lambda: None)
    assert engine.has_open_step  # a refused call changes nothing
    assert engine.cache.steps.layers_written(tx) == 0
    with pytest.raises(TypeError, match="CapturedStep"):
        engine.replay_step(tx, object())
    engine.abort_step(tx)


def _filled_engine(seed: int) -> tuple[DecodeEngine, list[str]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = PagedKVCache(
        LAYERS, HKV, D, BS, 64, dtype=torch.bfloat16, device="cuda", max_blocks_per_seq=16
    )
    engine = DecodeEngine(cache)  # fused append, Triton decode
    rids = ["a", "b", "c"]
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    lengths = [BS - 1, 2 * BS - 2, 5]  # a crosses a block boundary on its second step
    tx = engine.begin_prefill(rids, lengths)
    for layer in range(LAYERS):
        kv = torch.randn(2, sum(lengths), HKV, D, generator=gen, device="cuda")
        engine.prefill_layer(tx, layer, kv[0].bfloat16(), kv[1].bfloat16())
    engine.commit_step(tx)
    return engine, rids


@pytest.mark.gpu
def test_replayed_steps_equal_eager_steps_across_a_block_boundary():
    eager, rids = _filled_engine(0)
    graphed, _ = _filled_engine(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    static = [
        tuple(torch.empty(3, h, D, dtype=torch.bfloat16, device="cuda") for h in (HQ, HKV, HKV))
        for _ in range(LAYERS)
    ]
    captured = None
    for step in range(6):
        inputs = [
            tuple(
                torch.randn(3, h, D, generator=gen, device="cuda").bfloat16()
                for h in (HQ, HKV, HKV)
            )
            for _ in range(LAYERS)
        ]
        positions = eager.cache.seq_lens_tensor(rids)
        tx = eager.begin_step(rids)
        want = [eager.step_layer(tx, i, *inputs[i]) for i in range(LAYERS)]
        tables, lens = decode_inputs(eager.cache, tx)
        refs = [
            paged_decode_attention_ref(
                apply_rope(inputs[i][0], positions), *eager.cache.layout.layer_kv(i), tables, lens
            )
            for i in range(LAYERS)
        ]
        eager.commit_step(tx)

        got, captured = graphed_step(graphed, rids, static, inputs, step, captured)
        for i in range(LAYERS):
            torch.testing.assert_close(got[i], want[i], atol=0, rtol=0)
            torch.testing.assert_close(got[i].float(), refs[i].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(eager.cache.k_cache, graphed.cache.k_cache)
    assert torch.equal(eager.cache.v_cache, graphed.cache.v_cache)
    assert graphed.cache.seq_lens_tensor(rids).tolist() == [BS + 5, 2 * BS + 4, 11]
    graphed.cache.validate_invariants()


@pytest.mark.gpu
def test_capture_outside_capture_step_is_refused():
    engine, rids = _filled_engine(0)
    tx = engine.begin_step(rids)
    inputs = [torch.randn(3, h, D, device="cuda").bfloat16() for h in (HQ, HKV, HKV)]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capture_step"), torch.cuda.graph(graph):
        engine.step_layer(tx, 0, *inputs)
    assert not engine.has_open_step


@pytest.mark.gpu
def test_padded_rows_are_neither_stored_nor_attended():
    engine, rids = _filled_engine(0)
    before_k = engine.cache.k_cache.clone()
    gen = torch.Generator(device="cuda").manual_seed(2)
    tx = engine.begin_step(rids[:2], pad_to=4)  # 2 real rows, 2 padding rows
    outs = []
    for layer in range(LAYERS):
        q, k, v = (
            torch.randn(4, h, D, generator=gen, device="cuda").bfloat16() for h in (HQ, HKV, HKV)
        )
        outs.append(engine.step_layer(tx, layer, q, k, v))
    engine.commit_step(tx)
    for out in outs:
        assert out.shape[0] == 4 and not out[2:].any()  # empty rows attend to nothing
    changed = (engine.cache.k_cache != before_k).any(dim=(0, 2, 3, 4)).nonzero().flatten()
    blocks = {b for rid in rids[:2] for b in engine.cache.request_block_ids(rid)}
    assert set(changed.tolist()) <= blocks
    engine.cache.validate_invariants()


def _warm_and_capture(engine, rids, static):
    """One eager step (compiles), then a captured one; returns the captured step."""
    tx = engine.begin_step(rids)
    for i in range(LAYERS):
        engine.step_layer(tx, i, *static[i])
    engine.commit_step(tx)
    tx = engine.begin_step(rids)
    captured = engine.capture_step(
        tx, lambda: [engine.step_layer(tx, i, *static[i]) for i in range(LAYERS)]
    )
    engine.commit_step(tx)
    return captured


@pytest.mark.gpu
def test_abort_after_a_replay_or_a_failed_capture_leaves_storage_bit_identical():
    """The fused append saves each layer's old slot bytes in its own launch (replayed with the
    graph); a capture that fails never ran its kernels, so abort restores from the cache's own
    copy taken before the capture."""
    engine, rids = _filled_engine(3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    static = [
        tuple(torch.randn(3, h, D, generator=gen, device="cuda").bfloat16() for h in (HQ, HKV, HKV))
        for _ in range(LAYERS)
    ]
    captured = _warm_and_capture(engine, rids, static)
    cache = engine.cache
    for _ in range(BS):  # every offset of a block, one crossing
        before = (cache.k_cache.clone(), cache.v_cache.clone(), cache.seq_lens_tensor(rids))
        tx = engine.begin_step(rids)
        engine.replay_step(tx, captured)
        assert not torch.equal(cache.k_cache, before[0])  # the replay did write
        engine.abort_step(tx)
        assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])
        assert torch.equal(cache.seq_lens_tensor(rids), before[2])
        tx = engine.begin_step(rids)  # then really advance one token
        engine.replay_step(tx, captured)
        engine.commit_step(tx)
    before = (cache.k_cache.clone(), cache.v_cache.clone())
    tx = engine.begin_step(rids)

    def fails_after_two_layers():
        for i in range(2):
            engine.step_layer(tx, i, *static[i])
        raise OSError("injected in the captured body")

    with pytest.raises(OSError, match="injected"):
        engine.capture_step(tx, fails_after_two_layers)
    assert not engine.has_open_step
    torch.cuda.synchronize()
    assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])
    cache.validate_invariants()


@pytest.mark.parametrize("fails", [False, True])
def test_capture_pauses_automatic_garbage_collection(monkeypatch, fails):
    """Inside a capture no automatic collection runs (it could free a dead graph mid-capture);
    collections resume after it, when the capture fails too, and a disabled collector stays
    disabled."""
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):  # stands in for torch.cuda.graph on the CPU
        seen.append((graph, pool, gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with contextlib.suppress(ValueError), capture_cuda_graph("g", "p"):
        if fails:
            raise ValueError("the body failed")
    assert seen == [("g", "p", False)] and gc.isenabled()
    gc.disable()
    try:
        with capture_cuda_graph("g"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.gpu
def test_gpu_capture_survives_a_collection_that_frees_a_dead_graph():
    """A dead CUDA graph in a reference cycle (an earlier LLM's, say) is freed only by a
    collection; one that the capture's allocations trigger would destroy it mid-capture, which
    invalidates the capture (cudaErrorStreamCaptureInvalidated: seen in a warm start)."""
    x = torch.zeros(4, device="cuda")
    dead = torch.cuda.CUDAGraph()
    with capture_cuda_graph(dead):
        x.add_(5)
    cycle = [dead]
    cycle.append(cycle)
    del dead, cycle
    graph = torch.cuda.CUDAGraph()
    with capture_cuda_graph(graph):
        thresholds = gc.get_threshold()
        gc.set_threshold(1, 1, 1)  # an automatic collection at almost every allocation
        try:
            junk = [[i] for i in range(1000)]
        finally:
            gc.set_threshold(*thresholds)
        x.add_(len(junk))
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1000.0] * 4
    gc.collect()  # the dead graph goes now, outside any capture
