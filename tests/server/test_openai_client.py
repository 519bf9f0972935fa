"""The official ``openai`` client against ``flashdec serve`` (the tiny model, float32 CPU, on a
loopback port): completions and chat, streaming and not, usage counts, stop strings, seeds, and
concurrent streaming clients that each get exactly what ``LLM.generate`` gives them alone."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import (
    MODEL_NAME,
    in_context_text,
    make_llm,
    prompts,
    start,
    stopped_clean,
    word_tokenizer,
)

openai = pytest.importorskip("openai")

NEW = 12


@pytest.fixture(scope="module")
def expected():
    """Greedy outputs of ``LLM.generate``, each prompt alone (EOS ignored)."""
    llm = make_llm()
    return {tuple(p): llm.generate([p], NEW, ignore_eos=True)[0] for p in prompts(8, seed=1)}


@pytest.fixture(scope="module")
def server():
    """One server for the module's tests (each asks only for its own requests' outputs)."""
    running = start(make_llm())
    yield running
    stopped_clean([running])


def _client(server, cls=None):
    cls = cls or openai.OpenAI
    return cls(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0, "max_tokens": NEW}
EXTRA = {"return_token_ids": True, "ignore_eos": True}


def test_completion_with_token_ids(server, expected):
    client = _client(server)
    prompt, want = next(iter(expected.items()))
    out = client.completions.create(
        model=MODEL_NAME, prompt=list(prompt), extra_body=EXTRA, **GREEDY
    )
    choice = out.choices[0]
    assert choice.token_ids == want and choice.finish_reason == "length"
    assert choice.text == in_context_text(prompt, want)
    assert out.object == "text_completion" and out.model == MODEL_NAME
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), NEW)
    assert usage.total_tokens == len(prompt) + NEW


def test_completion_with_text_streamed(server):
    client = _client(server)
    tok = word_tokenizer()
    ids = tok("hello world the cat")["input_ids"]
    want = make_llm().generate([ids], NEW, ignore_eos=True)[0]
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="hello world the cat",
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
            **GREEDY,
        )
    )
    pieces = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in pieces) == in_context_text(ids, want)
    assert [t for c in pieces for t in c.choices[0].token_ids] == want
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert chunks[-1].usage.completion_tokens == NEW and chunks[-1].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat(server, stream):
    client = _client(server)
    tok = word_tokenizer()
    messages = [
        {"role": "system", "content": "the dog"},
        {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
    ]
    as_text = [messages[0], {"role": "user", "content": "hello world"}]  # parts joined
    templated = tok.apply_chat_template(as_text, add_generation_prompt=True, tokenize=False)
    ids = tok(templated, add_special_tokens=False)["input_ids"]
    want = make_llm().generate([ids], NEW, ignore_eos=True)[0]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, stream=stream, extra_body=EXTRA, **GREEDY
    )
    if stream:
        chunks = list(out)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        tokens = [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])]
        finish = chunks[-1].choices[0].finish_reason
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    else:
        message = out.choices[0].message
        assert message.role == "assistant" and out.object == "chat.completion"
        text, tokens, finish = (
            message.content,
            out.choices[0].token_ids,
            out.choices[0].finish_reason,
        )
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == NEW
    assert tokens == want and finish == "length"
    assert text == in_context_text(ids, want)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_output_before_it(server, expected, stream):
    client = _client(server)
    prompt, want = list(expected.items())[1]
    full = in_context_text(prompt, want)
    stop = full.split()[3]  # the 4th generated word
    cut = full.find(stop)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=list(prompt),
        stop=[stop, "never-there"],
        stream=stream,
        extra_body=EXTRA,
        **GREEDY,
    )
    if stream:
        chunks = list(out)
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].token_ids]
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, tokens = out.choices[0].text, out.choices[0].token_ids
        finish = out.choices[0].finish_reason
        assert out.usage.completion_tokens == len(tokens)
    assert text == full[:cut] and finish == "stop"
    assert tokens == want[: len(tokens)] and len(tokens) < NEW
    assert stop in in_context_text(prompt, tokens)  # it ended on the token completing the stop


def test_seeded_sampling_is_reproducible_and_not_greedy(server, expected):
    client = _client(server)
    prompt, greedy = next(iter(expected.items()))
    args = dict(model=MODEL_NAME, prompt=list(prompt), max_tokens=NEW, temperature=1.5, top_p=0.95)
    extra = {**EXTRA, "top_k": 50}
    a = client.completions.create(seed=7, extra_body=extra, **args)
    b = client.completions.create(seed=7, extra_body=extra, **args)
    c = client.completions.create(seed=8, extra_body=extra, **args)
    a, b, c = (x.choices[0].token_ids for x in (a, b, c))
    assert a == b and a != greedy and a != c


def test_models_and_health(server):
    client = _client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    import httpx

    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_concurrent_streaming_clients_get_their_own_tokens(server, expected):
    """8 clients stream at once: each gets exactly ``LLM.generate``'s greedy tokens for its
    prompt alone, and they shared decode steps (continuous batching)."""
    client = _client(server, openai.AsyncOpenAI)

    async def one(prompt):
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=list(prompt), stream=True, extra_body=EXTRA, **GREEDY
        )
        tokens = []
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids
        return tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p) for p in expected))
        finally:
            await client.close()

    before = server.llm.loop.step_index  # read-only; enough to see the batching
    got = asyncio.run(all_of_them())
    assert got == list(expected.values())
    steps = server.llm.loop.step_index - before
    assert steps < len(expected) * NEW / 2
