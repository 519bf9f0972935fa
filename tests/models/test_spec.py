"""ModelSpec values and the support checks: every unsupported feature is named."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, LlamaModel

from flashdec.models import (
    DecoderAdapter,
    build_random_model,
    check_supported,
    config_problems,
    layer_windows,
    model_spec,
    random_model,
)

BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
}


def _config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**BASE, **overrides})


def _llama(**overrides) -> LlamaForCausalLM:
    return random_model(_config("llama", **overrides), dtype=torch.float32, device="cpu")


class TestSpec:
    @pytest.mark.parametrize(
        ("name", "family", "heads", "head_dim", "qk_norm", "eos"),
        [
            ("tiny-llama", "llama", (4, 2), 16, False, (2,)),
            ("tiny-qwen2", "qwen2", (4, 1), 16, False, (3,)),
            ("tiny-mistral", "mistral", (6, 2), 16, False, (2,)),
            ("tiny-qwen3", "qwen3", (4, 2), 32, True, (4,)),
        ],
    )
    def test_geometry(self, name, family, heads, head_dim, qk_norm, eos):
        model = build_random_model(name, device="cpu")
        spec = model_spec(model)
        assert spec.family == family
        assert (spec.num_q_heads, spec.num_kv_heads) == heads
        assert spec.head_dim == spec.rotary_dim == head_dim
        assert spec.num_layers == len(model.model.layers) == 2
        assert spec.hidden_size == model.config.hidden_size
        assert spec.intermediate_size == model.config.intermediate_size
        assert spec.vocab_size == 256
        assert spec.qk_norm is qk_norm
        assert spec.eos_token_ids == eos
        assert spec.dtype == torch.float32 and spec.device == torch.device("cpu")
        assert spec.sm_scale == model.model.layers[0].self_attn.scaling == head_dim**-0.5
        assert spec.max_position_embeddings == 512
        assert spec.group_size == heads[0] // heads[1]
        assert spec.kv_bytes_per_token == 2 * 2 * heads[1] * head_dim * 4

    def test_inv_freq_is_the_rotary_modules_own(self):
        """llama3 scaling is taken from the model, not re-derived from rope_theta."""
        model = build_random_model("tiny-llama", device="cpu")
        spec = model_spec(model)
        assert torch.equal(spec.inv_freq, model.model.rotary_emb.inv_freq)
        unscaled = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        assert spec.inv_freq.dtype == torch.float32 and spec.inv_freq.shape == (8,)
        assert not torch.equal(spec.inv_freq, unscaled)
        assert torch.equal(spec.inv_freq[:1], unscaled[:1])  # wavelength < 64 / 4: kept
        assert torch.equal(spec.inv_freq[-3:], unscaled[-3:] / 8)  # wavelength > 64: / factor

    def test_bf16_model_inv_freq_as_transformers_uses_it(self):
        """model.to(bf16) casts the buffer; transformers upcasts it to float32 in forward."""
        model = build_random_model("tiny-llama", device="cpu").to(torch.bfloat16)
        spec = model_spec(model)
        assert spec.dtype == torch.bfloat16
        assert spec.inv_freq.dtype == torch.float32
        assert torch.equal(spec.inv_freq, model.model.rotary_emb.inv_freq.float())

    def test_weight_bytes_count_tied_embeddings_once(self):
        model = build_random_model("tiny-qwen2", device="cpu")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        params = sum(p.numel() for p in model.parameters())
        assert model_spec(model).weight_bytes == params * 4
        untied = build_random_model("tiny-llama", device="cpu")
        assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()

    def test_eos_from_generation_config_first(self):
        model = _llama(eos_token_id=5)
        model.generation_config.eos_token_id = [7, 9]
        assert model_spec(model).eos_token_ids == (7, 9)
        model.generation_config.eos_token_id = None
        assert model_spec(model).eos_token_ids == (5,)
        model.config.eos_token_id = None
        assert model_spec(model).eos_token_ids == ()

    @pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
    def test_llama_biases_are_supported(self, bias):
        """The adapter applies each projection's own bias, so these configs are fine."""
        assert model_spec(_llama(**{bias: True})).family == "llama"

    def test_linear_rope_scaling_supported(self):
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        spec = model_spec(_llama(rope_parameters=rope))
        assert torch.equal(spec.inv_freq[:1], torch.tensor([0.25]))


# (model_type, config overrides, phrases the error must contain)
CONFIG_CASES = [
    ("gpt2", {"n_embd": 32, "n_layer": 1, "n_head": 2}, ["architecture model_type='gpt2'"]),
    (
        "mixtral",
        {"num_local_experts": 4},
        ["architecture model_type='mixtral'", "mixture-of-experts (", "num_local_experts=4"],
    ),
    (
        "qwen2_moe",
        {"num_experts": 4, "moe_intermediate_size": 16},
        ["mixture-of-experts (", "num_experts=4"],
    ),
    (
        "mistral",
        {"sliding_window": 0},
        ["sliding_window=0 (must be a positive int or None)"],
    ),
    (
        "qwen3",
        {"layer_types": ["full_attention", "chunked_attention"]},
        ["layer_types ['chunked_attention'] (supported: full_attention, sliding_attention)"],
    ),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "attention_factor": 1.5,
            }
        },
        ["rope_type 'yarn' (cos/sin need more than inv_freq", "RoPE attention_factor=1.5"],
    ),
    (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
        ["rope_type 'dynamic'"],
    ),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 64,
            }
        },
        ["rope_type 'longrope'"],
    ),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            }
        },
        ["partial_rotary_factor=0.5 (only full-head RoPE)"],
    ),
    ("llama", {"attn_logit_softcapping": 30.0}, ["soft-capping attn_logit_softcapping=30.0"]),
    ("llama", {"final_logit_softcapping": 15.0}, ["soft-capping final_logit_softcapping=15.0"]),
    ("llama", {"hidden_act": "gelu"}, ["MLP activation 'gelu' (only silu)"]),
    ("llama", {"head_dim": 15}, ["head_dim=15 (must be even and <= 256)"]),
    ("llama", {"head_dim": 320}, ["head_dim=320 (must be even and <= 256)"]),
    (
        "llama",
        {"quantization_config": {"quant_method": "fp8"}},
        ["quantized weights (quantization_config quant_method='fp8'", "GGUF checkpoints"],
    ),
    ("qwen2", {"quantization_config": {"quant_method": "bitsandbytes"}}, ["'bitsandbytes'"]),
    (
        "llama",
        {"architectures": ["LlamaForSequenceClassification"]},
        ["architectures ['LlamaForSequenceClassification'] (supported: LlamaForCausalLM)"],
    ),
]


class TestUnsupported:
    @pytest.mark.filterwarnings("ignore")
    @pytest.mark.parametrize(("model_type", "overrides", "phrases"), CONFIG_CASES)
    def test_config_problem_is_named(self, model_type, overrides, phrases):
        config = _config(model_type, **overrides)
        message = "; ".join(config_problems(config))
        for phrase in phrases:
            assert phrase in message
        with pytest.raises(ValueError, match=re.escape(phrases[0])):
            random_model(config, dtype=torch.float32, device="cpu")

    def test_every_problem_in_one_error(self):
        config = _config(
            "mistral", sliding_window=512, hidden_act="relu", attn_logit_softcapping=5.0
        )
        model = AutoModelForCausalLM.from_config(config)
        with pytest.raises(ValueError) as info:
            check_supported(model)
        message = str(info.value)
        assert message.startswith("FlashDec cannot run this MistralForCausalLM: unsupported")
        for phrase in ("MLP activation 'relu'", "attn_logit_softcapping"):
            assert phrase in message

    def test_supported_configs_have_no_problems(self):
        for model_type in ("llama", "qwen2", "mistral", "qwen3"):
            extra = {"sliding_window": None} if model_type == "mistral" else {}
            assert config_problems(_config(model_type, **extra)) == []
        windowed = _config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
        assert config_problems(windowed) == []
        assert config_problems(_config("mistral", sliding_window=4096)) == []

    @pytest.mark.parametrize(
        ("model_type", "extra", "windows"),
        [
            ("llama", {}, (None, None)),
            ("mistral", {"sliding_window": None}, (None, None)),
            ("mistral", {"sliding_window": 64}, (64, 64)),
            ("qwen2", {"use_sliding_window": False, "sliding_window": 64}, (None, None)),
            (
                "qwen2",
                {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
                (None, 64),
            ),
            (
                "qwen3",
                {
                    "use_sliding_window": True,
                    "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"],
                },
                (8, None),
            ),
        ],
    )
    def test_layer_windows_follow_transformers(self, model_type, extra, windows):
        """The windows FlashDec applies are the ones transformers' attention modules use."""
        config = _config(model_type, num_hidden_layers=2, **extra)
        assert layer_windows(config) == windows
        model = AutoModelForCausalLM.from_config(config)
        assert model_spec(model).layer_windows == windows
        for layer, window in zip(model.model.layers, windows, strict=True):
            assert getattr(layer.self_attn, "sliding_window", window) == window

    def test_not_a_model(self):
        with pytest.raises(TypeError, match="transformers PreTrainedModel"):
            check_supported(nn.Linear(2, 2))
        with pytest.raises(TypeError, match="transformers PreTrainedModel"):
            DecoderAdapter(nn.Linear(2, 2))

    def test_model_without_lm_head(self):
        model = LlamaModel(_config("llama"))
        with pytest.raises(ValueError, match="model class LlamaModel"):
            check_supported(model)

    def test_unimplemented_norm(self):
        model = _llama()
        model.model.layers[1].post_attention_layernorm = nn.LayerNorm(32)
        with pytest.raises(
            ValueError, match=r"norm layers\.1\.post_attention_layernorm of type LayerNorm"
        ):
            DecoderAdapter(model)

    def test_replaced_projection(self):
        model = _llama()
        model.model.layers[0].mlp.up_proj = nn.Sequential(nn.Linear(32, 48))
        with pytest.raises(ValueError, match=r"projection layers\.0\.mlp\.up_proj of type"):
            check_supported(model)

    def test_rotary_attention_scaling(self):
        model = _llama()
        model.model.rotary_emb.attention_scaling = 0.5
        with pytest.raises(ValueError, match=r"rotary attention_scaling=0\.5"):
            check_supported(model)

    def test_mixed_dtypes(self):
        model = _llama()
        model.model.layers[0].mlp.half()
        with pytest.raises(ValueError, match="weight dtypes"):
            check_supported(model)

    def test_meta_weights(self):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config("llama"))
        with pytest.raises(ValueError, match="meta device"):
            check_supported(model)


GGUF = {"quant_method": "gguf", "gguf_file": "model.Q4_1.gguf", "dequantize": False}


class TestGGUF:
    """transformers loads a GGUF checkpoint with ``quantization_config`` method ``gguf`` and, for
    FlashDec's families, every weight dequantized to float: that runs; blocks kept packed do not."""

    def test_dequantized_gguf_checkpoint_is_supported(self):
        config = _config("llama", quantization_config=GGUF)
        assert config_problems(config) == []
        model = random_model(config, dtype=torch.float32, device="cpu")
        assert model_spec(model).family == "llama"

    def test_gguf_config_as_transformers_object(self):
        from transformers import GgufConfig

        config = _config("llama")
        config.quantization_config = GgufConfig(gguf_file="model.gguf")
        assert config_problems(config) == []

    def test_weights_left_in_gguf_blocks_are_refused_naming_why(self):
        # transformers >= 5.17 keeps GGUF blocks packed in GgufLinear where it has a kernel
        packed = pytest.importorskip("transformers.integrations.gguf.utils")
        dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
        if not hasattr(packed, "GgufLinear"):
            pytest.skip("this transformers has no GgufLinear")
        model = random_model(
            _config("llama", quantization_config=GGUF), dtype=torch.float32, device="cpu"
        )
        model.model.layers[0].mlp.up_proj = packed.GgufLinear(32, 48, dequant.GGML_Q8_0)
        with pytest.raises(ValueError) as info:
            check_supported(model)
        message = str(info.value)
        assert "weights left quantized (model.layers.0.mlp.up_proj.weight is uint8)" in message
        assert "FlashDec multiplies float weights only" in message
        assert "GgufConfig(dequantize=True)" in message
        assert "projection layers.0.mlp.up_proj of type GgufLinear" in message
        assert "weight dtypes" not in message  # the float weights all agree

    def test_integer_weights_without_gguf_name_no_gguf_remedy(self):
        model = _llama()
        for name in ("up_proj", "down_proj"):
            linear = getattr(model.model.layers[1].mlp, name)
            linear.weight = nn.Parameter(linear.weight.to(torch.int8), requires_grad=False)
        with pytest.raises(ValueError, match=r"is int8 and 1 more\): FlashDec") as info:
            check_supported(model)
        assert "GgufConfig" not in str(info.value)
