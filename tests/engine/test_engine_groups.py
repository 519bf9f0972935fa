"""DecodeEngine over a cache with KV layer groups: a full-attention group and a sliding-window
group with other KV heads and head_dim, interleaved; every layer equals the dense reference over
steps that cross block boundaries and pass the window, and a failure at any layer rolls the
whole token back."""

from __future__ import annotations

import pytest
import torch

from flashdec import PagedKVCache, apply_rope, dense_decode_attention_ref
from flashdec.engine import DecodeEngine
from flashdec.engine.loop import StepExecutor
from flashdec.engine.snapshot import snapshot_from_cache
from flashdec.scheduler import BlockAwareScheduler, RequestSpec, SchedulerConfig
from tests.cache.helpers import group_kv

# group 0: full attention, 2 KV heads of 16; group 1: a 6-token window, 1 KV head of 8
SPEC = "(2,40,4,2,16):float32:2;(2,12,4,1,8):float32:1:window=6"
LAYER_GROUPS = [0, 1, 0]
HQ = 4
GEOMETRY = {0: (2, 16, None), 1: (1, 8, 6)}  # group -> (Hkv, D, window)
BACKENDS = [("torch", "torch"), ("triton", "torch"), ("fused", "triton")]


def make_engine(append_backend="torch", decode_backend="torch", spec=SPEC, layer_groups=None):
    cache = PagedKVCache(
        kv_spec=spec,
        layer_groups=LAYER_GROUPS if layer_groups is None else layer_groups,
        device="cpu",
    )
    return DecodeEngine(cache, append_backend=append_backend, decode_backend=decode_backend)


def geometry(engine, layer):
    return GEOMETRY[engine.cache.layout.layer_group(layer)]


class Shadow:
    """Every layer's K (rotated) and V per request, densely, as the reference reads them."""

    def __init__(self, engine, rids, geometry=GEOMETRY):
        self.engine = engine
        self.geometry = geometry  # group -> (Hkv, D, window)
        layers = range(engine.cache.num_layers)
        self.k = {(layer, rid): [] for layer in layers for rid in rids}
        self.v = {(layer, rid): [] for layer in layers for rid in rids}

    def reference(self, layer, rids, q_rot):
        hkv, d, window = self.geometry[self.engine.cache.layout.layer_group(layer)]
        lens = [len(self.k[layer, rid]) for rid in rids]
        length = max(lens)
        k = torch.zeros(len(rids), length, hkv, d)
        v = torch.zeros(len(rids), length, hkv, d)
        for b, rid in enumerate(rids):
            k[b, : lens[b]] = torch.stack(self.k[layer, rid])
            v[b, : lens[b]] = torch.stack(self.v[layer, rid])
        return dense_decode_attention_ref(q_rot, k, v, torch.tensor(lens), window=window)


def prefill(engine, shadow, rid, length, gen):
    ks, vs = [], []
    for layer in range(3):
        hkv, d, _ = geometry(engine, layer)
        k, v = torch.randn(2, length, hkv, d, generator=gen)
        ks.append(k)
        vs.append(v)
        shadow.k[layer, rid] += list(k)
        shadow.v[layer, rid] += list(v)
    assert engine.prefill_request_layers(rid, ks, vs) == length


def checked_step(engine, shadow, rids, gen):
    cache = engine.cache
    positions = cache.seq_lens_tensor(rids)
    tx = engine.begin_step(rids)
    for layer in range(3):
        hkv, d, _ = geometry(engine, layer)
        q = torch.randn(len(rids), HQ, d, generator=gen)
        k = torch.randn(len(rids), hkv, d, generator=gen)
        v = torch.randn(len(rids), hkv, d, generator=gen)
        out = engine.step_layer(tx, layer, q, k, v)
        k_rot = apply_rope(k, positions)
        for b, rid in enumerate(rids):
            shadow.k[layer, rid].append(k_rot[b])
            shadow.v[layer, rid].append(v[b])
        ref = shadow.reference(layer, rids, apply_rope(q, positions))
        torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
    engine.commit_step(tx)
    cache.validate_invariants()


@pytest.mark.parametrize(("append_backend", "decode_backend"), BACKENDS)
def test_grouped_steps_match_the_reference_across_blocks_and_the_window(
    append_backend, decode_backend
):
    engine = make_engine(append_backend, decode_backend)
    gen = torch.Generator().manual_seed(0)
    rids = ["a", "b", "c"]
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    shadow = Shadow(engine, rids)
    prefill(engine, shadow, "a", 9, gen)  # longer than the window: only its tail is kept
    prefill(engine, shadow, "b", 2, gen)
    steps = 4 if decode_backend == "triton" else 9
    for step in range(steps):
        checked_step(engine, shadow, rids if step % 3 else rids[:2], gen)
    cache = engine.cache
    window_group = cache.metrics()["groups"][1]
    assert window_group["max_blocks_per_request"] <= window_group["block_bound_per_request"] == 3
    lens = [cache.seq_len(rid) for rid in rids]
    assert [len(cache.request_block_ids(r, group=0)) for r in rids] == [-(-n // 4) for n in lens]
    assert cache.seq_len("a") > 6 + 4  # well past the window


def test_a_window_cache_of_one_group_steps_like_the_reference():
    spec = "(2,16,4,2,16):float32:2:window=5"
    engine = make_engine(spec=spec, layer_groups=[0, 0])
    assert engine.group_shapes == ((4, 5),)
    gen = torch.Generator().manual_seed(3)
    engine.add_request("a")
    engine.admit("a")
    shadow = Shadow(engine, ["a"], {0: (2, 16, 5)})
    cache = engine.cache
    for _ in range(11):
        positions = cache.seq_lens_tensor(["a"])
        tx = engine.begin_step(["a"])
        for layer in range(2):
            q = torch.randn(1, HQ, 16, generator=gen)
            k, v = torch.randn(2, 1, 2, 16, generator=gen)
            out = engine.step_layer(tx, layer, q, k, v)
            shadow.k[layer, "a"].append(apply_rope(k, positions)[0])
            shadow.v[layer, "a"].append(v[0])
            ref = shadow.reference(layer, ["a"], apply_rope(q, positions))
            torch.testing.assert_close(out, ref, atol=5e-5, rtol=5e-5)
        engine.commit_step(tx)
        assert len(cache.request_block_ids("a")) <= 3


def _state(cache: PagedKVCache):
    """Everything an aborted token must leave as it was, in every group."""
    requests = {
        rid: (
            cache.request_state(rid),
            cache.seq_len(rid),
            [cache.request_block_ids(rid, group=g) for g in range(cache.layout.num_groups)],
        )
        for rid in cache.request_ids()
    }
    free = [cache.layout.group_free_blocks(g) for g in range(cache.layout.num_groups)]
    storage = [
        torch.cat([t.flatten() for t in group_kv(cache, g)]).clone()
        for g in range(cache.layout.num_groups)
    ]
    return requests, free, storage


def _assert_same(cache, before):
    requests, free, storage = _state(cache)
    assert (requests, free) == before[:2]
    for old, new in zip(before[2], storage, strict=True):
        assert torch.equal(old.view(torch.int32), new.view(torch.int32))
    cache.validate_invariants()


@pytest.mark.parametrize("failing_layer", [0, 1, 2])
@pytest.mark.parametrize("how", ["bad input", "writer fault", "abort"])
def test_a_failure_at_any_layer_leaves_every_group_unchanged(failing_layer, how, monkeypatch):
    engine = make_engine()
    gen = torch.Generator().manual_seed(1)
    rids = ["a", "b"]
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    shadow = Shadow(engine, rids)
    prefill(engine, shadow, "a", 7, gen)
    prefill(engine, shadow, "b", 4, gen)  # at a block boundary: its next token takes a block
    cache = engine.cache
    before = _state(cache)
    tx = engine.begin_step(rids)
    for layer in range(3):
        hkv, d, _ = geometry(engine, layer)
        q = torch.randn(2, HQ, d, generator=gen)
        k, v = torch.randn(2, 2, hkv, d, generator=gen)
        if layer < failing_layer:
            engine.step_layer(tx, layer, q, k, v)
            continue
        if how == "abort":
            engine.abort_step(tx)
        elif how == "bad input":
            with pytest.raises(ValueError):
                engine.step_layer(tx, layer, q, k[:, :, :-2], v)
        else:

            def boom(*args, **kwargs):
                raise RuntimeError("injected write failure")

            monkeypatch.setattr("flashdec.engine.attention.write_rope_layer", boom)
            with pytest.raises(RuntimeError, match="injected"):
                engine.step_layer(tx, layer, q, k, v)
        break
    assert not engine.has_open_step
    _assert_same(cache, before)


def test_grouped_prefill_checks_each_layer_against_its_group():
    engine = make_engine()
    engine.add_request("a")
    engine.admit("a")
    good = [torch.zeros(3, *GEOMETRY[g][:2]) for g in LAYER_GROUPS]
    before = _state(engine.cache)
    with pytest.raises(ValueError, match="one tensor per layer"):
        engine.prefill_request_layers("a", torch.zeros(3, 3, 2, 16), torch.zeros(3, 3, 2, 16))
    with pytest.raises(ValueError, match="layer 1"):
        engine.prefill_request_layers("a", [good[0], good[0], good[2]], good)
    with pytest.raises(ValueError, match="3 layers"):
        engine.prefill_request_layers("a", good[:2], good[:2])
    with pytest.raises(TypeError):
        engine.prefill_request_layers("a", {"k": 1}, good)
    _assert_same(engine.cache, before)
    assert engine.prefill_request_layers("a", good, good) == 3


def test_grouped_engine_refuses_fp8_groups_for_now():
    cache = PagedKVCache(
        kv_spec="(2,8,4,2,16):float8_e4m3fn:1;(2,8,4,2,16):float32:1", device="cpu"
    )
    with pytest.raises(ValueError, match="float8"):
        DecodeEngine(cache, append_backend="torch", decode_backend="torch")


# ---------------------------------------------------------------- scheduling a grouped cache
def _scheduled(spec, layer_groups, requests, config):
    cache = PagedKVCache(kv_spec=spec, layer_groups=layer_groups, device="cpu")
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    for i, (ctx, new) in enumerate(requests):
        engine.submit_request(RequestSpec(f"r{i}", ctx, new, i))
    return engine, BlockAwareScheduler(config)


class RandomExecutor(StepExecutor):
    """A serving loop's executor on random tensors: prefills every layer of each imported request
    and steps one token per layer (K = V; no sampling, the loop only schedules)."""

    def __init__(self, engine, seed):
        self.engine, self.gen = engine, torch.Generator().manual_seed(seed)

    def prefill(self, imports):
        for rid, n in imports:
            layers = [torch.randn(n, *GEOMETRY[g][:2], generator=self.gen) for g in LAYER_GROUPS]
            self.engine.prefill_request_layers(rid, layers, layers)

    def decode(self, batch):
        tx = self.engine.begin_step(list(batch))
        for layer, g in enumerate(LAYER_GROUPS):
            hkv, d, _ = GEOMETRY[g]
            q = torch.randn(len(batch), HQ, d, generator=self.gen)
            kv = torch.randn(len(batch), hkv, d, generator=self.gen)
            self.engine.step_layer(tx, layer, q, kv, kv)
        self.engine.commit_step(tx)
        return ()


def test_the_engine_snapshot_has_every_group_and_admits_more_with_a_window():
    config = SchedulerConfig(max_active_requests=8, max_batch_size=8)
    requests = [(4, 28)] * 6  # 32 tokens: 8 blocks in a full group, 3 in a 6-token window
    windowed, scheduler = _scheduled(SPEC, LAYER_GROUPS, requests, config)
    snap = windowed.scheduling_snapshot(0)
    assert [p.window for p in snap.groups] == [None, 6]
    assert [r.lifetime_private_blocks_by_group for r in snap.waiting] == [(8, 3)] * 6
    decision = scheduler.plan(snap)
    assert len(decision.admit) == 4  # the window group's 12 blocks hold 4 requests of 3
    windowed.apply_scheduler_decision(decision, scheduler=scheduler, snapshot=snap)
    again = windowed.scheduling_snapshot(1)
    assert again == snapshot_from_cache(
        windowed.cache,
        step=1,
        specs={f"r{i}": windowed.submissions.request_spec(f"r{i}") for i in range(6)},
        waiting_ids=["r4", "r5"],
        active_ids=["r0", "r1", "r2", "r3"],
    )
    # the same layers all full-attention on the same 40 + 12 blocks: 12 / 8 = 1 fits
    full, _ = _scheduled(
        "(2,40,4,2,16):float32:2;(2,12,4,1,8):float32:1", LAYER_GROUPS, requests, config
    )
    assert len(scheduler.plan(full.scheduling_snapshot(0)).admit) == 1


def test_a_serving_loop_over_groups_never_stalls():
    from flashdec.engine.loop import ServingLoop, run_loop

    config = SchedulerConfig(max_active_requests=6, max_batch_size=4)
    requests = [(i % 5, 6 + (3 * i) % 11) for i in range(9)]
    engine, scheduler = _scheduled(SPEC, LAYER_GROUPS, [], config)
    loop = ServingLoop(engine, scheduler, RandomExecutor(engine, 5), check_invariants=True)
    specs = [RequestSpec(f"r{i}", ctx, new, i) for i, (ctx, new) in enumerate(requests)]
    run = run_loop(loop, [(i // 2, s) for i, s in enumerate(specs)], max_steps=500)
    assert not run.unfinished and not run.deadlock
    assert all(not step.stuck for step in run.steps)
    assert engine.cache.metrics()["groups"][1]["num_used_blocks"] == 0


@pytest.mark.parametrize("policy", ["greedy", "cancel"])
def test_the_baselines_on_groups_stall_or_cancel_without_breaking_the_cache(policy):
    """Greedy admits on what prompts need now: at block boundaries of the small full group it
    runs dry (stuck requests); cancel frees room by cancelling. The cache stays consistent."""
    from flashdec.engine.loop import ServingLoop, run_loop
    from flashdec.scheduler import make_scheduler

    spec = "(2,6,4,2,16):float32:2;(2,40,4,1,8):float32:1:window=6"
    cache = PagedKVCache(kv_spec=spec, layer_groups=LAYER_GROUPS, device="cpu")
    engine = DecodeEngine(cache, append_backend="torch", decode_backend="torch")
    config = SchedulerConfig(max_active_requests=4, max_batch_size=4)
    executor = RandomExecutor(engine, 7)
    loop = ServingLoop(engine, make_scheduler(policy, config), executor, check_invariants=True)
    specs = [RequestSpec(f"r{i}", 4, 12, i) for i in range(4)]  # 4 full blocks each, 6 in all
    run = run_loop(loop, [(0, s) for s in specs], max_steps=80, patience=10)
    if policy == "greedy":
        assert any(step.stuck for step in run.steps)
    else:
        assert any(step.cancelled for step in run.steps)
        assert not any(step.stuck for step in run.steps)
    assert cache.metrics()["num_active_requests"] == 0
    cache.validate_invariants()


def test_an_extend_step_over_groups_and_a_window_matches_the_torch_backends():
    """An n-token step through the Triton extend kernel (planned per group from the host's
    lengths, window group included) gives every layer the torch backends' attention, over
    contexts that passed the window and block boundaries; then both commit the same lengths."""
    gen = torch.Generator().manual_seed(7)
    engines = [make_engine("torch", "torch"), make_engine("fused", "triton")]
    rids = ["a", "b", "c"]
    contexts = [9, 2, 0]  # past the 6-token window, inside it, empty
    inputs = []
    for length in contexts:
        inputs.append(
            [
                torch.randn(2, length, *geometry(engines[0], layer)[:2], generator=gen)
                for layer in range(3)
            ]
        )
    for engine in engines:
        for rid, length, kv in zip(rids, contexts, inputs, strict=True):
            engine.add_request(rid)
            engine.admit(rid)
            if length:
                engine.prefill_request_layers(rid, [t[0] for t in kv], [t[1] for t in kv])
    counts = [3, 5, 4]  # each below the window
    layers = []
    for layer in range(3):
        hkv, d, _ = geometry(engines[0], layer)
        layers.append(
            (
                torch.randn(sum(counts), HQ, d, generator=gen),
                torch.randn(sum(counts), hkv, d, generator=gen),
                torch.randn(sum(counts), hkv, d, generator=gen),
            )
        )
    outs = []
    for engine in engines:
        tx = engine.begin_step(rids, num_tokens=counts)
        outs.append([engine.step_layer(tx, i, *layer) for i, layer in enumerate(layers)])
        assert engine.commit_step(tx).seq_lens == (12, 7, 4)
        engine.cache.validate_invariants()
    for want, got in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)
