"""The real SmolLM2-135M-Instruct behind ``flashdec serve``: a chat through the ``openai``
client, streamed and not, is the chat template's prompt generated greedily, token for token what
``LLM.generate`` gives it alone, and its text is those tokens decoded. Skips until
``flashdec.models`` has the built-in real model and its package is installed."""

from __future__ import annotations

import pytest
import torch

import flashdec
import flashdec.models as models
from tests.server.conftest import in_context_text

openai = pytest.importorskip("openai")


def _missing() -> str | None:
    if "smollm2" not in getattr(models, "REAL_MODELS", {}):
        return "flashdec.models has no built-in real model 'smollm2'"
    return models.real_model_problem("smollm2")


MISSING = _missing()
NEW = 16
QUESTION = "What is the capital of Japan?"


@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_chat_with_smollm2(server_for):
    llm = flashdec.LLM("smollm2", dtype=torch.float32, device="cpu", max_model_len=256)
    tok = llm.tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    want = llm.generate([ids], NEW)[0]
    server = server_for(llm, model_name="smollm2")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args = dict(model="smollm2", messages=messages, max_tokens=NEW, temperature=0)
    extra = {"return_token_ids": True}
    out = client.chat.completions.create(extra_body=extra, **args)
    assert out.choices[0].token_ids == want
    answer = out.choices[0].message.content
    assert answer == in_context_text(ids, want, tok) and "Tokyo" in answer
    chunks = list(client.chat.completions.create(stream=True, extra_body=extra, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
