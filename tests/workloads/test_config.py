"""Workload configs check the whole configuration at construction; estimates match the formulas."""

import dataclasses
import math

import pytest
import torch

from flashdec.scheduler import SchedulerConfig
from flashdec.workloads import (
    IntegratedWorkloadConfig,
    SchedulerWorkloadConfig,
    SyntheticWorkloadConfig,
)
from flashdec.workloads.knobs import HOST_BYTES_PER_REQUEST, HOST_BYTES_PER_STEP
from flashdec.workloads.model_config import GenerateConfig, ServeConfig

HAS_CUDA = torch.cuda.is_available()

BAD_SYNTHETIC = [
    ({"num_requests": 0}, ValueError, "num_requests must be >= 1"),
    ({"num_requests": "3"}, TypeError, "num_requests must be an int"),
    ({"num_requests": True}, TypeError, "num_requests must be an int"),
    ({"num_requests": 2**31}, ValueError, "num_requests must be <= 2147483647"),
    ({"num_q_heads": 2048, "num_kv_heads": 2}, ValueError, "num_q_heads must be <= 1024"),
    ({"num_kv_heads": 3}, ValueError, "must be a multiple of num_kv_heads (3)"),
    ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be >= 1"),
    ({"head_dim": 7}, ValueError, "head_dim must be even"),
    ({"head_dim": 0}, ValueError, "head_dim must be >= 2"),
    ({"head_dim": 258}, ValueError, "head_dim must be <= 256 (the kernels' limit)"),
    ({"block_size": 99999999999999999999}, ValueError, "block_size must be <= 1024"),
    ({"num_blocks": 2**31}, ValueError, "block ids are int32"),
    ({"reserve_blocks": 48}, ValueError, "reserve_blocks (48) must be below num_blocks (48)"),
    ({"aging_threshold": -1}, ValueError, "aging_threshold must be >= 0"),
    ({"min_context": 9, "max_context": 3}, ValueError, "min_context (9) must not exceed"),
    ({"min_new_tokens": 9, "max_new_tokens": 3}, ValueError, "min_new_tokens (9) must not"),
    ({"min_new_tokens": 0}, ValueError, "min_new_tokens must be >= 1"),
    ({"max_context": 2**31 - 10}, ValueError, "max_context + max_new_tokens must be <="),
    ({"arrivals_per_step": 0.0}, ValueError, "arrivals_per_step must be > 0"),
    ({"arrivals_per_step": -1}, ValueError, "arrivals_per_step must be > 0"),
    ({"arrivals_per_step": math.nan}, ValueError, "arrivals_per_step must be finite"),
    ({"arrivals_per_step": math.inf}, ValueError, "arrivals_per_step must be finite"),
    ({"arrivals_per_step": "fast"}, TypeError, "arrivals_per_step must be a number"),
    ({"arrivals_per_step": True}, TypeError, "arrivals_per_step must be a number"),
    ({"dtype": "int8"}, ValueError, "dtype must be one of"),
    ({"dtype": torch.float16}, TypeError, "dtype must be a str"),
    ({"device": "tpu"}, ValueError, "device must be one of"),
    ({"append_backend": "cuda"}, ValueError, "append_backend must be one of"),
    ({"decode_backend": "fused"}, ValueError, "decode_backend must be one of"),
    ({"seed": -1}, ValueError, "seed must be >= 0"),
    ({"seed": 2**63}, ValueError, "seed must be <= 9223372036854775807"),
    ({"max_steps": 0}, ValueError, "max_steps must be >= 1"),
    ({"check_invariants": "yes"}, TypeError, "check_invariants must be a bool"),
    ({"warmup_run": 1}, TypeError, "warmup_run must be a bool"),
]

BAD_INTEGRATED = [
    ({"num_layers": 0}, ValueError, "num_layers must be >= 1"),
    ({"num_layers": 100000}, ValueError, "num_layers must be <= 1024"),
    ({"failure_rate": 1.5}, ValueError, "failure_rate must be <= 1.0"),
    ({"failure_rate": -0.1}, ValueError, "failure_rate must be >= 0.0"),
    ({"prefix_hit_rate": math.nan}, ValueError, "prefix_hit_rate must be finite"),
    ({"num_prefixes": 0}, ValueError, "prefix hits need num_prefixes >= 1"),
    ({"prefix_blocks": 0}, ValueError, "prefix hits need num_prefixes >= 1"),
    (
        {"num_prefixes": 4, "prefix_blocks": 12},
        ValueError,
        "num_prefixes x prefix_blocks (48) must be below num_blocks (48)",
    ),
]


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_SYNTHETIC)
def test_synthetic_config_rejects(overrides, error, message):
    with pytest.raises(error) as exc:
        SyntheticWorkloadConfig(**overrides)
    assert message in str(exc.value)
    # the integrated config inherits every rule
    with pytest.raises(error):
        IntegratedWorkloadConfig(**overrides)


@pytest.mark.parametrize(("overrides", "error", "message"), BAD_INTEGRATED)
def test_integrated_config_rejects(overrides, error, message):
    with pytest.raises(error) as exc:
        IntegratedWorkloadConfig(**overrides)
    assert message in str(exc.value)


def test_a_rejected_replace_leaves_the_config_as_it_was():
    config = IntegratedWorkloadConfig(num_kv_heads=4, seed=5)
    before = dataclasses.asdict(config)
    with pytest.raises(ValueError):
        dataclasses.replace(config, num_kv_heads=3)
    assert dataclasses.asdict(config) == before


def test_prefix_rules_apply_only_when_requests_can_hit_prefixes():
    config = IntegratedWorkloadConfig(prefix_hit_rate=0.0, num_prefixes=0, prefix_blocks=500)
    assert config.registered_prefix_blocks == 0


def test_scheduler_workload_config_rejects():
    with pytest.raises(ValueError, match="trace must be one of"):
        SchedulerWorkloadConfig(trace="nope")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        SchedulerWorkloadConfig(seed=-1)
    with pytest.raises(TypeError, match="prefix_sharing must be a bool"):
        SchedulerWorkloadConfig(prefix_sharing="no")


def test_defaults_and_demo_defaults_are_valid():
    for config in (
        SyntheticWorkloadConfig(),
        IntegratedWorkloadConfig(),
        IntegratedWorkloadConfig.demo_defaults(seed=3),
        SchedulerWorkloadConfig(),
    ):
        assert dataclasses.replace(config) == config


def test_scheduler_config_carries_the_knobs():
    config = SyntheticWorkloadConfig(max_active_requests=5, max_batch_size=3, reserve_blocks=2)
    assert config.scheduler_config() == SchedulerConfig(
        max_active_requests=5, max_batch_size=3, reserve_blocks=2, aging_threshold=8
    )


@pytest.mark.skipif(HAS_CUDA, reason="needs a machine without a CUDA device")
def test_cuda_requested_without_a_gpu():
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        SyntheticWorkloadConfig(device="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="auto resolves to the GPU there")
def test_auto_placement_on_the_cpu():
    place = SyntheticWorkloadConfig().placement()
    assert place.device == torch.device("cpu")
    assert (place.dtype, place.append_backend, place.decode_backend) == (
        torch.float32,
        "torch",
        "torch",
    )


def test_explicit_placement():
    place = SyntheticWorkloadConfig(
        device="cpu", dtype="bfloat16", append_backend="torch", decode_backend="torch"
    ).placement()
    assert (place.device.type, place.dtype, place.element_bytes) == ("cpu", torch.bfloat16, 2)


@pytest.mark.parametrize(
    ("backend", "value"),
    [("append_backend", "triton"), ("append_backend", "fused"), ("decode_backend", "triton")],
)
def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch, backend, value):
    knobs = {"device": "cpu", backend: value}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    SyntheticWorkloadConfig(**knobs)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as exc:
        SyntheticWorkloadConfig(**knobs)
    assert f"{backend} {value!r}" in str(exc.value)


def _cpu(**knobs):
    return {"device": "cpu", "append_backend": "torch", "decode_backend": "torch", **knobs}


def test_kv_cache_estimate_is_the_storage_formula():
    config = IntegratedWorkloadConfig(
        **_cpu(num_layers=3, num_blocks=50, block_size=4, num_kv_heads=2, head_dim=6)
    )
    est = config.memory_estimate()
    assert est.device == torch.device("cpu")
    assert est.kv_cache_bytes == 2 * 3 * 50 * 4 * 2 * 6 * 4
    half = dataclasses.replace(config, dtype="float16").memory_estimate()
    assert half.kv_cache_bytes * 2 == est.kv_cache_bytes
    # on the CPU the device memory is host memory
    assert est.kv_cache_bytes < est.device_bytes < est.host_bytes
    synthetic = SyntheticWorkloadConfig(
        **_cpu(num_blocks=50, block_size=4, num_kv_heads=2, head_dim=6)
    )
    assert synthetic.memory_estimate().kv_cache_bytes == 2 * 1 * 50 * 4 * 2 * 6 * 4


def test_host_estimate_grows_per_request_and_per_step():
    base = SyntheticWorkloadConfig(**_cpu(num_blocks=64, max_steps=10))  # steps capped at 10
    more = dataclasses.replace(base, num_requests=base.num_requests + 100)
    per_request = HOST_BYTES_PER_REQUEST + 4 * 64  # bookkeeping + int32 block-table row
    delta = more.memory_estimate().host_bytes - base.memory_estimate().host_bytes
    assert delta == 100 * per_request
    longer = dataclasses.replace(base, max_steps=20)
    delta = longer.memory_estimate().host_bytes - base.memory_estimate().host_bytes
    assert delta == 10 * HOST_BYTES_PER_STEP
    assert more.memory_estimate().device_bytes == base.memory_estimate().device_bytes


def test_prefix_staging_counts_only_when_prefixes_are_registered():
    hits = IntegratedWorkloadConfig(**_cpu(prefix_hit_rate=0.5))
    none = dataclasses.replace(hits, prefix_hit_rate=0.0)
    staged = 2 * hits.num_layers * hits.prefix_blocks * hits.block_size
    staged *= hits.num_kv_heads * hits.head_dim * (4 + 4)
    assert hits.memory_estimate().device_bytes - none.memory_estimate().device_bytes == staged


# --------------------------------------------------------------------------------------------
# generate / bench-serve configs
# --------------------------------------------------------------------------------------------
def test_kv_spec_the_cache_cannot_store_is_refused_with_the_cache_message():
    """One check (kv_spec.check_storable) for the cache and the workloads, one message."""
    from flashdec.cache import PagedKVCache
    from flashdec.workloads import WindowWorkloadConfig

    for spec in ("(1,48,8,2,32):float32:1", "(2,48,8,2,7):float32:1"):
        with pytest.raises(ValueError) as cache_error:
            PagedKVCache(kv_spec=spec, device="cpu")
        with pytest.raises(ValueError) as config_error:
            SyntheticWorkloadConfig(kv_spec=spec)
        assert str(config_error.value) == str(cache_error.value)
        window = f"{spec};(2,48,8,2,32):float32:1:window=8"
        with pytest.raises(ValueError) as window_error:
            WindowWorkloadConfig(kv_spec=window)
        assert str(window_error.value) == str(cache_error.value)


@pytest.mark.skipif(HAS_CUDA, reason="the tiny shape's CPU placement")
def test_fp8_kv_cache_on_a_float32_model_is_refused_naming_the_flag():
    # auto dtype: the tiny shape is float32; the hint is the CLI flag, not a Python argument
    for overrides in ({}, {"dtype": "float32"}):
        with pytest.raises(ValueError) as exc:
            GenerateConfig(kv_cache_dtype="fp8", **overrides)
        message = str(exc.value)
        assert "needs a float16 or bfloat16 model" in message and "float32" in message
        assert message.endswith("add --dtype bfloat16") and "torch." not in message
        with pytest.raises(ValueError, match="add --dtype bfloat16"):
            ServeConfig(kv_cache_dtype="fp8", **overrides)
    assert GenerateConfig(kv_cache_dtype="fp8", dtype="bfloat16").kv_cache_dtype == "fp8"
    # a built-in shape in bfloat16 needs no flag
    assert GenerateConfig(model="llama3-8b-shape", kv_cache_dtype="fp8").dtype == "auto"


def test_kv_scales_need_fp8_and_an_existing_path(tmp_path):
    fp8 = {"kv_cache_dtype": "fp8", "dtype": "bfloat16"}
    assert GenerateConfig(**fp8).kv_scales == "dynamic"
    assert GenerateConfig(kv_scales="static", **fp8).kv_scales == "static"
    saved = tmp_path / "scales.safetensors"
    saved.write_bytes(b"")
    assert GenerateConfig(kv_scales=str(saved), **fp8).kv_scales == str(saved)
    with pytest.raises(ValueError, match="neither dynamic, static nor an existing"):
        GenerateConfig(kv_scales=str(tmp_path / "missing"), **fp8)
    for scales in ("static", str(saved)):
        with pytest.raises(ValueError, match="--kv-scales needs --kv-cache-dtype fp8"):
            ServeConfig(kv_scales=scales)


def test_fp8_kv_cache_reads_a_directory_checkpoint_dtype(tmp_path):
    from flashdec.models import build_random_model

    build_random_model("tiny-llama", dtype=torch.float16, device="cpu").save_pretrained(tmp_path)
    assert GenerateConfig(model=str(tmp_path), kv_cache_dtype="fp8").model == str(tmp_path)
    with pytest.raises(ValueError, match=r"run in float32 \(--dtype float32\)"):
        GenerateConfig(model=str(tmp_path), kv_cache_dtype="fp8", dtype="float32")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_p": -0.5}, "top_p must be > 0, got -0.5"),
        ({"top_p": 0.0}, "top_p must be > 0, got 0.0"),
        ({"top_p": 1.5}, "top_p must be <= 1.0"),
        ({"top_p": math.inf}, "top_p must be finite"),
        ({"prompt": "hi", "prompt_len": 8}, "a text prompt sets its own length"),
        ({"model": ""}, "neither a built-in shape"),
        ({"speculative": "eagle"}, "speculative must be one of 'off', 'ngram', 'draft'"),
        ({"speculative": "off:3"}, "speculative must be one of"),
        ({"speculative": "ngram:two"}, "K must be a whole number"),
        ({"speculative": "ngram:65"}, "num_tokens must be <= 64"),
        ({"speculative": "draft"}, "--speculative draft needs --draft-model"),
        ({"draft_model": "tiny"}, "--draft-model needs --speculative draft"),
        (
            {"speculative": "draft", "draft_model": "nowhere"},
            "draft_model 'nowhere' is neither a built-in shape",
        ),
        ({"num_speculative_tokens": 2}, "--num-speculative-tokens needs --speculative ngram"),
        ({"ngram_min": 2, "ngram_max": 5}, "--ngram-min, --ngram-max needs --speculative ngram"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "must be >= 1, got 0"),
        ({"speculative": "ngram", "num_speculative_tokens": 65}, "step's width), got 65"),
        ({"speculative": "ngram", "ngram_min": 3, "ngram_max": 2}, "must not exceed ngram_max"),
    ],
)
def test_generate_config_rejects(overrides, message):
    with pytest.raises(ValueError) as exc:
        GenerateConfig(**overrides)
    assert message in str(exc.value)


def test_model_memory_estimate_is_weights_plus_the_longest_request():
    from flashdec.kv_pool import ACTIVATION_RESERVE
    from flashdec.models import build_random_model

    model = build_random_model("tiny", device="cpu")  # float32: 4 bytes
    weights = sum(p.numel() for p in model.parameters()) * 4
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    config = GenerateConfig(device="cpu", prompt_len=20, max_new_tokens=13)  # 33 tokens: 3 blocks
    est = config.memory_estimate()
    assert est.weight_bytes == weights
    assert est.kv_cache_bytes == 3 * 16 * per_token
    assert est.device_bytes == weights + 3 * 16 * per_token + ACTIVATION_RESERVE
    assert est.host_bytes == est.device_bytes  # on the CPU
    half = dataclasses.replace(config, dtype="bfloat16").memory_estimate()
    assert (half.weight_bytes, half.kv_cache_bytes) == (weights // 2, est.kv_cache_bytes // 2)
    fp8 = dataclasses.replace(config, dtype="bfloat16", kv_cache_dtype="fp8").memory_estimate()
    assert fp8.kv_cache_bytes == est.kv_cache_bytes // 4
    serve = ServeConfig(device="cpu", max_prompt_len=40, max_new_tokens=9)  # 49 tokens: 4 blocks
    assert serve.memory_estimate().kv_cache_bytes == 4 * 16 * per_token
    assert "one request of 49 tokens" in serve.kv_description()


def test_speculative_knobs_make_the_llm_config():
    assert GenerateConfig().speculative_config() is None
    config = ServeConfig(
        speculative="ngram", num_speculative_tokens=6, ngram_min=2, ngram_max=3
    ).speculative_config()
    assert (config.method, config.num_tokens, config.min_ngram, config.max_ngram) == (
        "ngram",
        6,
        2,
        3,
    )
    # METHOD:K gives the drafts per step in one flag
    assert GenerateConfig(speculative="ngram:7").speculative_config().num_tokens == 7


def test_a_draft_model_adds_its_weights_and_pool_to_the_memory_estimate():
    plain = GenerateConfig(model="tiny-llama", device="cpu")
    drafted = GenerateConfig(
        model="tiny-llama", device="cpu", speculative="draft", draft_model="tiny-llama"
    )
    a, b = plain.memory_estimate(), drafted.memory_estimate()
    assert b.weight_bytes == 2 * a.weight_bytes and b.kv_cache_bytes == 2 * a.kv_cache_bytes
    assert b.device_bytes > a.device_bytes
