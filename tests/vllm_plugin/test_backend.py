"""The backend's routing, on a stand-in for the few vLLM 0.24.0 names it builds on.

CI has no vLLM, so these tests load ``flashdec.vllm_plugin.backend`` over small fakes of
FlashAttention's classes (the parent ``forward`` records its calls). They check what the plugin
decides — FlashDec for pure decode batches, the parent for everything else, each reason counted
and logged once — and that the FlashDec path gives the reference's numbers on vLLM-shaped
tensors. The real classes are exercised on the GPU machine (benchmarks/bench_vllm_plugin.py).
"""

from __future__ import annotations

import enum
import importlib
import logging
import sys
import types

import pytest
import torch

import flashdec
from flashdec.vllm_plugin import LOGGER_NAME
from flashdec.vllm_plugin.stats import STATS
from tests.helpers import make_paged_kv
from tests.vllm_plugin.fakes import vllm_flash_cache

BACKEND_MODULE = "flashdec.vllm_plugin.backend"


class AttentionCGSupport(enum.Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class AttentionType:
    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_DECODER = "encoder_decoder"


class FakeFlashAttentionBackend:
    @staticmethod
    def get_name():
        return "FLASH_ATTN"


class FakeFlashAttentionMetadataBuilder:
    _cudagraph_support = AttentionCGSupport.ALWAYS

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls._cudagraph_support


class FakeFlashAttentionImpl:
    """The attributes FlashAttentionImpl.__init__ sets, as vLLM 0.24.0 sets them."""

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
    ):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes)
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or 0
        self.attn_type = attn_type
        self.sinks = sinks
        self.total_cp_world_size = 1  # set by AttentionImpl.__new__ in vLLM
        self.parent_calls = 0

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        self.parent_calls += 1
        return output.fill_(-1.0)


def engine_config(max_num_seqs=4, max_model_len=512, ubatching=False):
    ns = types.SimpleNamespace
    return ns(
        scheduler_config=ns(max_num_seqs=max_num_seqs),
        compilation_config=ns(max_cudagraph_capture_size=None),
        model_config=ns(max_model_len=max_model_len),
        parallel_config=ns(use_ubatching=ubatching),
    )


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the fakes, import the backend over them, and forget both afterwards."""
    state = types.SimpleNamespace(config=engine_config(), batch_invariant=False)
    modules = {}
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        modules[name] = types.ModuleType(name)
        modules[name].__path__ = []
    modules["vllm"].__version__ = "0.24.0"
    envs = modules["vllm.envs"] = types.ModuleType("vllm.envs")
    envs.VLLM_BATCH_INVARIANT = False
    config = modules["vllm.config"] = types.ModuleType("vllm.config")
    config.get_current_vllm_config_or_none = lambda: state.config
    backend = modules["vllm.v1.attention.backend"] = types.ModuleType("vllm.v1.attention.backend")
    backend.AttentionCGSupport, backend.AttentionType = AttentionCGSupport, AttentionType
    flash = types.ModuleType("vllm.v1.attention.backends.flash_attn")
    flash.FlashAttentionBackend = FakeFlashAttentionBackend
    flash.FlashAttentionImpl = FakeFlashAttentionImpl
    flash.FlashAttentionMetadata = types.SimpleNamespace
    flash.FlashAttentionMetadataBuilder = FakeFlashAttentionMetadataBuilder
    modules[flash.__name__] = flash
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, BACKEND_MODULE, raising=False)
    STATS.reset()
    state.module = importlib.import_module(BACKEND_MODULE)
    state.envs = envs
    yield state
    sys.modules.pop(BACKEND_MODULE, None)
    STATS.reset()


def make_impl(fake_vllm, hq=4, hkv=2, d=32, **kwargs):
    args = dict(alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(kwargs)
    return fake_vllm.module.FlashDecImpl(hq, d, 0.25, hkv, **args)


def decode_batch(lens, hq=4, hkv=2, d=32, bs=16, dtype=torch.float32, device="cpu", pad=0):
    """vLLM-shaped inputs of a pure decode batch (``pad`` extra CUDA-graph rows)."""
    k, v, tables, seq_lens, *_ = make_paged_kv(lens, hkv, d, bs, dtype, device)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(len(lens) + pad, hq, d, generator=gen).to(device=device, dtype=dtype)
    meta = types.SimpleNamespace(
        max_query_len=1,
        seq_lens=seq_lens,
        block_table=tables,
        causal=True,
        mm_prefix_range_tensor=None,
    )
    return dict(query=query, kv_cache=vllm_flash_cache(k, v), meta=meta, k=k, v=v)


def run(impl, batch, meta=None):
    output = torch.zeros_like(batch["query"])
    meta = batch["meta"] if meta is None else meta
    impl.forward(None, batch["query"], None, None, batch["kv_cache"], meta, output)
    return output


def test_decode_batches_run_flashdec_on_vllms_cache(fake_vllm, device):
    impl = make_impl(fake_vllm)
    batch = decode_batch([1, 40, 17], device=device, pad=2)
    output = run(impl, batch)
    n = 3
    meta = batch["meta"]
    expected = flashdec.paged_decode_attention_ref(
        batch["query"][:n], batch["k"], batch["v"], meta.block_table, meta.seq_lens, sm_scale=0.25
    )
    torch.testing.assert_close(output[:n], expected, atol=2e-3, rtol=2e-3)
    assert (output[n:] == 0).all()
    assert impl.parent_calls == 0 and STATS.decode_calls == 1 and not STATS.fallbacks


def test_layers_of_one_shape_share_one_workspace_pool(fake_vllm):
    batch = decode_batch([5, 9])
    first, second = make_impl(fake_vllm), make_impl(fake_vllm)
    run(first, batch), run(second, batch)
    assert first._pool is second._pool and len(fake_vllm.module._POOLS) == 1
    assert first._pool.max_batch == 4  # max_num_seqs of the engine config


def test_prefill_and_mixed_batches_go_to_the_parent_and_are_logged_once(fake_vllm, caplog):
    impl = make_impl(fake_vllm)
    batch = decode_batch([5, 9])
    mixed = types.SimpleNamespace(**{**vars(batch["meta"]), "max_query_len": 7})
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for _ in range(3):
            assert (run(impl, batch, mixed) == -1).all()
    assert impl.parent_calls == 3 and STATS.decode_calls == 0
    assert STATS.fallbacks == {"prefill and mixed batches": 3}
    logged = [r for r in caplog.records if "prefill and mixed" in r.getMessage()]
    assert len(logged) == 1


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("mm_prefix_range_tensor", torch.zeros(2, 1, 2), "multimodal prefix-LM ranges"),
        ("causal", torch.ones(2, dtype=torch.int32), "per-request causality"),
    ],
)
def test_per_call_cases_go_to_the_parent(fake_vllm, field, value, reason):
    impl = make_impl(fake_vllm)
    batch = decode_batch([5, 9])
    meta = types.SimpleNamespace(**{**vars(batch["meta"]), field: value})
    run(impl, batch, meta)
    assert impl.parent_calls == 1 and STATS.fallbacks == {reason: 1}


def test_profiling_runs_and_oversized_batches_go_to_the_parent(fake_vllm):
    impl = make_impl(fake_vllm)
    batch = decode_batch([5, 9, 3, 4, 8])  # max_num_seqs is 4
    output = torch.zeros_like(batch["query"])
    impl.forward(None, batch["query"], None, None, batch["kv_cache"], None, output)
    run(impl, batch)
    assert impl.parent_calls == 2
    assert STATS.fallbacks == {"profiling runs": 1, "decode batches above 4 requests": 1}


def test_a_kv_cache_of_another_dtype_goes_to_the_parent(fake_vllm):
    impl = make_impl(fake_vllm)
    batch = decode_batch([5, 9])
    batch["query"] = batch["query"].to(torch.bfloat16)
    run(impl, batch)
    assert impl.parent_calls == 1 and len(STATS.fallbacks) == 1


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(sliding_window=64), "sliding-window attention"),
        (dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), "ALiBi"),
        (dict(logits_soft_cap=30.0), "logits soft-capping"),
        (dict(kv_cache_dtype="fp8"), "KV cache dtype 'fp8'"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "encoder_decoder attention"),
        (dict(sinks=torch.zeros(4)), "attention sinks"),
    ],
)
def test_unsupported_layers_always_use_the_parent_counted_once(fake_vllm, kwargs, reason):
    impl = make_impl(fake_vllm, **kwargs)
    assert STATS.fallbacks == {reason: 1}
    batch = decode_batch([5, 9])
    run(impl, batch), run(impl, batch)
    assert impl.parent_calls == 2 and STATS.decode_calls == 0
    assert STATS.fallbacks == {reason: 1}  # counted per layer, at construction


def test_engine_wide_modes_fall_back(fake_vllm):
    fake_vllm.config = engine_config(ubatching=True)
    make_impl(fake_vllm)
    fake_vllm.config = engine_config()
    fake_vllm.envs.VLLM_BATCH_INVARIANT = True
    make_impl(fake_vllm)
    assert set(STATS.fallbacks) == {"micro-batching (dual-batch overlap)", "batch-invariant mode"}


def test_the_device_counter_counts_every_launch(fake_vllm, monkeypatch):
    monkeypatch.setattr(STATS, "device_counting", True)
    impl = make_impl(fake_vllm)
    batch = decode_batch([5, 9])
    for _ in range(3):
        run(impl, batch)
    snap = STATS.snapshot()
    assert snap["device_decode_launches"] == 3 and snap["decode_calls"] == 3
    assert snap["first_decode"] == dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32)


def test_cuda_graph_support_is_capped_at_uniform_batches(fake_vllm, monkeypatch):
    builder = fake_vllm.module.FlashDecMetadataBuilder
    assert builder.get_cudagraph_support(None, None) is AttentionCGSupport.UNIFORM_BATCH
    monkeypatch.setattr(
        FakeFlashAttentionMetadataBuilder, "_cudagraph_support", AttentionCGSupport.NEVER
    )
    assert builder.get_cudagraph_support(None, None) is AttentionCGSupport.NEVER


def test_the_backend_is_custom_with_flashdecs_impl_and_builder(fake_vllm):
    backend = fake_vllm.module.FlashDecBackend
    assert backend.get_name() == "CUSTOM"
    assert backend.get_impl_cls() is fake_vllm.module.FlashDecImpl
    assert backend.get_builder_cls() is fake_vllm.module.FlashDecMetadataBuilder
    assert issubclass(backend, FakeFlashAttentionBackend)


def test_counters_made_under_inference_mode_reset_outside_it():
    # vLLM's TP workers capture (and create the counter) under inference mode, then reset it
    # from an RPC outside inference mode
    from flashdec.vllm_plugin.stats import PluginStats

    stats = PluginStats(device_counting=True)
    with torch.inference_mode():
        stats.device_counter(torch.device("cpu")).add_(3)
    assert stats.snapshot()["device_decode_launches"] == 3
    stats.reset()
    assert stats.snapshot()["device_decode_launches"] == 0
