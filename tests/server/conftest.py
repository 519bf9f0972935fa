"""Shared pieces of the server tests: the tiny random model (float32, CPU) with a word-level
tokenizer and chat template built here, a server on a free loopback port, and the reference
outputs of ``LLM.generate`` on its own."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import flashdec
from flashdec.models import build_random_model

SPECIALS = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "hello", "world"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL_NAME = "tiny"


@functools.cache
def tiny_model():
    return build_random_model("tiny", dtype=torch.float32, device="cpu", seed=0)


@functools.cache
def word_tokenizer():
    """A word-level tokenizer covering the tiny model's 512 ids (every id decodes to a word),
    with a chat template; built locally, as transformers would ship it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = tiny_model().config.vocab_size
    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_llm(tokenizer=True, **kw) -> flashdec.LLM:
    kw.setdefault("max_batch_size", 32)
    kw.setdefault("max_model_len", 256)
    return flashdec.LLM(tiny_model(), tokenizer=word_tokenizer() if tokenizer else None, **kw)


def in_context_text(prompt_ids, output_ids, tokenizer=None) -> str:
    """The output's text as it reads after the prompt (what a server streams)."""
    tok = tokenizer or word_tokenizer()
    before = tok.decode(list(prompt_ids), skip_special_tokens=True)
    after = tok.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=True)
    assert after.startswith(before)
    return after[len(before) :]


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    # ids from 6 on: no special token inside a prompt
    return [torch.randint(6, vocab, (k,), generator=gen).tolist() for k in lens]


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``condition()`` until truthy (bounded); returns its last value."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def metric(text: str, name: str) -> float:
    """One sample's value from a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def start(llm, **kw):
    """A server for ``llm`` on a free loopback port (the front-end process started)."""
    from flashdec.server import start_server

    kw.setdefault("model_name", MODEL_NAME)
    return start_server(llm, host="127.0.0.1", port=0, **kw)


def stopped_clean(started) -> None:
    """Stop every server (requests in flight cancelled); check both processes ended and each
    LLM is clean: idle, no record left, every block back."""
    for running in started:
        running.stop()
    for running in started:
        llm = running.llm
        assert not running.engine.alive and running.process.poll() is not None
        assert llm.loop.idle and llm._runner.requests == {}
        assert llm.engine.cache.metrics()["num_used_blocks"] == 0
        llm.engine.cache.validate_invariants()


@pytest.fixture
def server_for():
    """``server_for(llm, **kw)`` starts a server on a free loopback port; every one is stopped
    when the test ends, and its LLM checked clean. A server costs a process start (about a
    second: the front end imports FastAPI and transformers): share one where tests allow."""
    started = []

    def server(llm, **kw):
        running = start(llm, **kw)
        started.append(running)
        return running

    yield server
    stopped_clean(started)
