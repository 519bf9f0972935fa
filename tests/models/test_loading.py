"""Built-in shapes and local model directories (written here; nothing is downloaded)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast

from flashdec.models import (
    BUILTIN_SHAPES,
    DecoderAdapter,
    build_random_model,
    config_problems,
    load_model,
    resolve_model,
)
from flashdec.models.loading import check_model_dir
from tests.models.greedy import flashdec_greedy, hf_greedy

WORDS = ["[UNK]", "<s>", "</s>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far"]


def _save_tokenizer(directory) -> None:
    """A WordLevel tokenizer built locally, wrapped and saved as transformers would ship it."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    build_random_model("tiny-llama", device="cpu", seed=3).save_pretrained(directory)
    _save_tokenizer(directory)
    return directory


class TestBuiltinShapes:
    def test_seeded_and_leaves_the_global_rng_alone(self):
        state = torch.random.get_rng_state()
        a = build_random_model("tiny-qwen3", device="cpu", seed=5)
        b = build_random_model("tiny-qwen3", device="cpu", seed=5)
        c = build_random_model("tiny-qwen3", device="cpu", seed=6)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert torch.equal(a.lm_head.weight, b.lm_head.weight)
        assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
        assert not a.training

    def test_dtype(self):
        model = build_random_model("tiny", dtype=torch.bfloat16, device="cpu")
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32

    def test_tiny_is_the_cli_default(self):
        model = build_random_model(device="cpu")
        assert model.config.num_hidden_layers == 4 and model.config.vocab_size == 512
        assert model.config.rope_parameters["rope_type"] == "llama3"

    def test_llama3_8b_shape_is_created_on_the_requested_device(self):
        """On the meta device nothing is materialised anywhere: the device context reaches
        every parameter (on a GPU the same path initialises directly there)."""
        model = build_random_model("llama3-8b-shape", device="meta")
        config = model.config
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert _geometry(config) == (4096, 32, 32, 8, 128, 14336, 128256)
        assert config.rope_parameters["rope_type"] == "llama3"
        assert config.rope_parameters["factor"] == 8.0
        assert sum(p.numel() for p in model.parameters()) == 8_030_261_248

    def test_mistral_7b_window_shape(self):
        """The window model of bench_prefix (issue 22): Mistral-7B-v0.1's geometry, a 4096-token
        window in every layer (vllm_prefix.py gives vLLM the same numbers)."""
        model = build_random_model("mistral-7b-window-shape", device="meta")
        config = model.config
        assert type(model).__name__ == "MistralForCausalLM"
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert (*_geometry(config), config.sliding_window) == (
            4096,
            32,
            32,
            8,
            128,
            14336,
            32000,
            4096,
        )
        assert sum(p.numel() for p in model.parameters()) == 7_241_732_096

    def test_every_builtin_shape_is_supported(self):
        for name, shape in BUILTIN_SHAPES.items():
            config = shape.make_config()
            assert config.model_type == shape.family, name
            assert config_problems(config) == [], name

    def test_errors(self):
        with pytest.raises(
            ValueError, match="unknown built-in model shape 'llama-9b'; known: tiny"
        ):
            build_random_model("llama-9b")
        with pytest.raises(TypeError, match="dtype must be one of"):
            build_random_model("tiny", dtype=torch.int8, device="cpu")
        with pytest.raises(TypeError, match="seed must be an int"):
            build_random_model("tiny", device="cpu", seed=1.5)


class TestLoadModel:
    def test_loads_weights_and_tokenizer(self, model_dir):
        loaded = load_model(model_dir, device="cpu")
        assert loaded.source == str(model_dir)
        reference = build_random_model("tiny-llama", device="cpu", seed=3)
        for (name, a), (_, b) in zip(
            loaded.model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name
        tokenizer = loaded.tokenizer
        assert tokenizer is not None
        ids = tokenizer("the cat sat on a mat").input_ids
        assert ids == [3, 4, 5, 6, 7, 8]
        assert tokenizer.eos_token_id == 2
        assert tokenizer.decode([9, 10, 11]) == "dog ran far"

    def test_loaded_model_generates_like_transformers(self, model_dir):
        loaded = load_model(model_dir, device="cpu")
        prompts = [loaded.tokenizer(text).input_ids for text in ("the cat sat", "a dog ran far")]
        ours = flashdec_greedy(DecoderAdapter(loaded.model), prompts, 12)
        assert ours == hf_greedy(loaded.model, prompts, 12)

    def test_dtype_override(self, model_dir):
        loaded = load_model(model_dir, dtype=torch.bfloat16, device="cpu")
        assert loaded.model.dtype == torch.bfloat16
        assert DecoderAdapter(loaded.model).spec.dtype == torch.bfloat16

    def test_without_tokenizer(self, tmp_path):
        build_random_model("tiny-qwen2", device="cpu").save_pretrained(tmp_path)
        loaded = load_model(tmp_path, device="cpu")
        assert loaded.tokenizer is None
        assert loaded.model.config.model_type == "qwen2"

    def test_missing_directory(self, tmp_path):
        missing = tmp_path / "nope"
        with pytest.raises(ValueError, match=re.escape(f"model directory '{missing}' does not")):
            load_model(missing)

    def test_directory_without_config(self, tmp_path):
        with pytest.raises(ValueError, match=r"has no config\.json"):
            load_model(tmp_path)

    def test_directory_without_weights(self, tmp_path):
        build_random_model("tiny-llama", device="cpu").config.save_pretrained(tmp_path)
        with pytest.raises(ValueError, match="holds no weights"):
            load_model(tmp_path, device="cpu")

    def test_unsupported_config_fails_before_reading_weights(self, tmp_path):
        """Only a config.json: the error names the feature, not the missing weights."""
        config = AutoConfig.for_model(
            "mistral",
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            hidden_act="gelu",
        )
        config.save_pretrained(tmp_path)
        with pytest.raises(ValueError, match="MLP activation 'gelu'") as info:
            load_model(tmp_path)
        assert str(tmp_path) in str(info.value)

    def test_argument_types(self, model_dir):
        with pytest.raises(TypeError, match="path must be a str"):
            load_model(3)
        with pytest.raises(TypeError, match="dtype must be None or one of"):
            load_model(model_dir, dtype="bfloat16")


class TestResolveModel:
    def test_builtin_name(self):
        loaded = resolve_model("tiny-mistral", device="cpu", seed=1)
        assert loaded.source == "tiny-mistral" and loaded.tokenizer is None
        assert loaded.model.config.model_type == "mistral"

    def test_directory(self, model_dir):
        loaded = resolve_model(str(model_dir), device="cpu")
        assert loaded.tokenizer is not None

    def test_neither(self, tmp_path):
        with pytest.raises(ValueError, match="neither a local model directory nor a built-in"):
            resolve_model(str(tmp_path / "missing"))

    def test_saved_config_keeps_dtype(self, tmp_path):
        build_random_model("tiny-qwen3", dtype=torch.float16, device="cpu").save_pretrained(
            tmp_path
        )
        assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"
        assert resolve_model(str(tmp_path), device="cpu").model.dtype == torch.float16


# A config that asks transformers to import the directory's own Python file: the file writes a
# marker when imported, so whether it ran is a file on disk.
EVIL_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast


class EvilConfig(PretrainedConfig):
    model_type = "evil"


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def write_remote_code_model(directory, marker, model_type: str = "evil") -> None:
    """A model directory whose config.json names code in the directory (``auto_map``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
    config = {
        "model_type": model_type,
        "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    }
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def says_yes(monkeypatch, tmp_path):
    """Whoever asks on stdin gets "y"; transformers' dynamic modules go to a scratch folder."""
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))


class TestNoCodeFromTheDirectory:
    @pytest.mark.parametrize("model_type", ["evil", "llama"])
    def test_a_config_asking_for_its_own_code_is_refused(self, tmp_path, says_yes, model_type):
        marker = tmp_path / "RAN"
        write_remote_code_model(tmp_path / "model", marker, model_type)
        with pytest.raises(ValueError) as info:
            load_model(tmp_path / "model", device="cpu")
        message = str(info.value)
        assert "asks to run code from the directory (auto_map: evil.EvilConfig" in message
        assert "FlashDec never does; supported architectures: llama, qwen2" in message
        assert not marker.exists()

    def test_a_tokenizer_asking_for_its_own_code_is_refused(self, tmp_path, says_yes):
        directory = tmp_path / "model"
        build_random_model("tiny-llama", device="cpu", seed=3).save_pretrained(directory)
        marker = tmp_path / "RAN"
        (directory / "evil.py").write_text(EVIL_CODE.format(marker=str(marker)))
        tokenizer_config = {
            "tokenizer_class": "EvilTokenizer",
            "auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]},
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        with pytest.raises(ValueError, match="could not load the tokenizer in"):
            load_model(directory, device="cpu")
        assert not marker.exists()


class TestBrokenDirectories:
    def test_config_that_is_not_json(self, tmp_path):
        (tmp_path / "config.json").write_text('{"model_type": "llama",')
        with pytest.raises(ValueError, match=r"config\.json in .* is not valid JSON: Expecting"):
            load_model(tmp_path)

    def test_config_that_is_not_an_object(self, tmp_path):
        (tmp_path / "config.json").write_text("[1, 2]")
        with pytest.raises(ValueError, match="must hold a JSON object"):
            load_model(tmp_path)

    @pytest.mark.parametrize("model_type", ["gpt_oss_99", None])
    def test_unknown_model_type_names_the_supported_architectures(self, tmp_path, model_type):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        with pytest.raises(ValueError) as info:
            load_model(tmp_path)
        message = str(info.value)
        assert message == (
            f"FlashDec cannot run the model in '{tmp_path}': model_type={model_type!r}; "
            "supported architectures: llama, qwen2, mistral, qwen3"
        )
        assert "pip" not in message

    def test_a_config_transformers_cannot_read(self, tmp_path):
        config = build_random_model("tiny-llama", device="cpu").config.to_dict()
        config["rope_parameters"] = "fast"
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(
            ValueError, match=r"could not read the config\.json in .*rope_parameters"
        ):
            load_model(tmp_path)

    def test_no_weights_is_found_before_loading(self, tmp_path):
        build_random_model("tiny-llama", device="cpu").config.save_pretrained(tmp_path)
        with pytest.raises(ValueError, match=r"holds no weights: none of model\.safetensors"):
            check_model_dir(tmp_path)


def _geometry(config) -> tuple[int, ...]:
    """Hidden size, layers, query / KV heads, head_dim, MLP width, vocabulary."""
    return (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    )
