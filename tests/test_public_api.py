"""The SPEC's public names and signatures, exactly (hidden tests rely on them)."""

import inspect

import pytest

import flashdec

SPEC_NAMES = [
    "dense_decode_attention_ref",
    "paged_decode_attention_ref",
    "apply_rope",
    "decode",
    "kv_append",
    "fused_rope_kv_append",
    "PagedKVCache",
    "RequestState",
    "rope_paged_kv_append",
    "DecodeEngine",
    "RequestSpec",
    "SchedulerConfig",
    "SchedulingSnapshot",
    "SchedulerDecision",
    "BlockAwareScheduler",
    "run_synthetic_workload",
    "run_scheduler_workload",
    "run_integrated_workload",
    "KVGroupSpec",
    "parse_kv_spec",
    "format_kv_spec",
    "paged_extend_attention_ref",
    "extend",
    "paged_extend_attention",
]


@pytest.mark.parametrize("name", sorted(set(SPEC_NAMES) | set(flashdec.__all__)))
def test_name_resolves(name):
    assert getattr(flashdec, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        flashdec.no_such_thing  # noqa: B018


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_signatures_follow_the_spec():
    assert _params(flashdec.decode) == [
        "q",
        "k_cache",
        "v_cache",
        "block_tables",
        "seq_lens",
        "sm_scale",
        "block_size",
        "num_warps",
        "kv_layout",
        "num_stages",
        "out",
        "workspace",
        "window",
        "k_scale",
        "v_scale",
    ]
    for fn, names in (
        (flashdec.decode, ("window", "k_scale", "v_scale")),
        (flashdec.kv_append, ("k_scale", "v_scale")),
        (flashdec.fused_rope_kv_append, ("k_scale", "v_scale")),
    ):
        params = inspect.signature(fn).parameters
        for name in names:
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
            assert params[name].default is None
    assert _params(flashdec.paged_decode_attention_ref) == [
        "q",
        "k_cache",
        "v_cache",
        "block_tables",
        "seq_lens",
        "sm_scale",
        "kv_layout",
        "window",
        "k_scale",
        "v_scale",
    ]
    assert _params(flashdec.dense_decode_attention_ref) == [
        "q",
        "k_cache",
        "v_cache",
        "seq_lens",
        "sm_scale",
        "window",
    ]
    assert _params(flashdec.apply_rope) == ["x", "positions", "rotary_dim", "base"]
    assert _params(flashdec.kv_append) == [
        "k_cache",
        "v_cache",
        "k",
        "v",
        "block_ids",
        "offsets",
        "k_scale",
        "v_scale",
    ]
    assert _params(flashdec.fused_rope_kv_append)[:9] == [
        "q",
        "k",
        "v",
        "k_cache",
        "v_cache",
        "block_ids",
        "offsets",
        "positions",
        "rotary_dim",
    ]
    assert _params(flashdec.rope_paged_kv_append)[:8] == [
        "cache",
        "layer_idx",
        "request_ids",
        "q",
        "k",
        "v",
        "rotary_dim",
        "append_backend",
    ]
    assert _params(flashdec.PagedKVCache)[:8] == [
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "max_blocks",
        "dtype",
        "device",
        "prefix_cache_capacity_blocks",
    ]
    assert _params(flashdec.DecodeEngine)[:5] == [
        "cache",
        "append_backend",
        "decode_backend",
        "rotary_dim",
        "rope_base",
    ]
    engine_sig = inspect.signature(flashdec.DecodeEngine)
    assert engine_sig.parameters["append_backend"].default == "fused"
    assert engine_sig.parameters["decode_backend"].default == "triton"
    assert _params(flashdec.RequestSpec) == [
        "request_id",
        "initial_context_tokens",
        "max_new_tokens",
        "submission_order",
        "prefix_id",
    ]
    assert _params(flashdec.SchedulerConfig) == [
        "max_active_requests",
        "max_batch_size",
        "reserve_blocks",
        "aging_threshold",
    ]
    assert flashdec.SchedulerConfig(1, 1).aging_threshold == 8


def test_extend_signatures_follow_the_spec():
    """SPEC §8.6: the extend reference and kernel, exactly."""
    common = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_lens", "sm_scale"]
    assert _params(flashdec.paged_extend_attention_ref) == [
        *common,
        "kv_layout",
        "window",
        "k_scale",
        "v_scale",
    ]
    assert _params(flashdec.extend) == [
        *common,
        "kv_layout",
        "out",
        "workspace",
        "window",
        "k_scale",
        "v_scale",
    ]
    params = inspect.signature(flashdec.extend).parameters
    for name in ("out", "workspace", "window", "k_scale", "v_scale"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default is None
    assert params["kv_layout"].default == "token_major" and params["sm_scale"].default is None
    assert flashdec.paged_extend_attention is flashdec.extend


def test_request_state_values():
    assert {s.value for s in flashdec.RequestState} == {"active", "finished", "cancelled"}
    assert flashdec.RequestState("active") == "active"


def test_llm_signatures_follow_the_spec():
    assert _params(flashdec.LLM)[:8] == [
        "model",
        "dtype",
        "device",
        "block_size",
        "num_blocks",
        "max_batch_size",
        "cuda_graphs",
        "tokenizer",
    ]
    params = inspect.signature(flashdec.LLM).parameters
    assert params["block_size"].default == 16 and params["max_batch_size"].default == 64
    assert all(params[n].default is None for n in ("dtype", "device", "num_blocks", "cuda_graphs"))
    generate = inspect.signature(flashdec.LLM.generate).parameters
    assert list(generate)[:4] == ["self", "prompts", "max_new_tokens", "ignore_eos"]
    assert generate["max_new_tokens"].default == 32 and generate["ignore_eos"].default is False
    assert generate["ignore_eos"].kind is inspect.Parameter.KEYWORD_ONLY


def test_kv_spec_names_follow_the_spec():
    import dataclasses

    fields = [f.name for f in dataclasses.fields(flashdec.KVGroupSpec)]
    assert fields == [
        "kv_size",
        "num_blocks",
        "block_size",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "layer_count",
        "window",
    ]
    example = "(2,1024,16,8,128):bfloat16:30;(2,1024,16,2,64):bfloat16:2:window=4096"
    assert flashdec.format_kv_spec(flashdec.parse_kv_spec(example)) == example
