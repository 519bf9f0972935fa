"""Whatever a client sends, the answer is a 200 or a 4xx with an OpenAI-style error body, never
a 500; the engine thread serves on, and a refused request leaves nothing behind."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL_NAME, make_llm, metric

httpx = pytest.importorskip("httpx")

OK = {"prompt": [7, 8, 9], "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}

# (path, body: dict merged into a valid one / raw str, status, words the message must contain)
CASES = [
    ("/v1/completions", "{", 400, "not valid JSON"),
    ("/v1/completions", "", 400, "not valid JSON"),
    ("/v1/completions", '{"prompt": [1], "temperature": NaN}', 400, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, "JSON object, got an array"),
    ("/v1/completions", '"text"', 400, "JSON object, got a string"),
    ("/v1/completions", "{}", 400, "prompt: this field is required"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1.5, 2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True, 2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1], [2]]}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {"prompt": [512]}, 400, "token ids must lie in [0, 512)"),
    ("/v1/completions", {"prompt": [-1]}, 400, "token ids must lie in"),
    ("/v1/completions", {"max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 10**6}, 400, "exceeds max_model_len"),
    ("/v1/completions", {"prompt": [7] * 250, "max_tokens": 10}, 400, "max_model_len"),
    ("/v1/completions", {"temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"top_k": 1.5}, 400, "top_k"),
    ("/v1/completions", {"seed": -1}, 400, "seed"),
    ("/v1/completions", {"seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"seed": "x"}, 400, "seed"),
    ("/v1/completions", {"stop": 5}, 400, "stop"),
    ("/v1/completions", {"stop": [1]}, 400, "stop"),
    ("/v1/completions", {"stop": [""]}, 400, "must not be empty"),
    ("/v1/completions", {"stop": ["x"] * 17}, 400, "at most 16"),
    ("/v1/completions", {"n": 2}, 400, "only n=1"),
    ("/v1/completions", {"n": 0}, 400, "only n=1"),
    ("/v1/completions", {"stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"stream_options": {"include_usage": 1}}, 400, "include_usage"),
    ("/v1/completions", {"echo": True}, 400, "echo"),
    ("/v1/completions", {"logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"model": 3}, 400, "model"),
    ("/v1/chat/completions", "{}", 400, "messages: this field is required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "only text content parts",
    ),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": "nope"}, 404, "does not exist"),
]


def _body(path: str, body) -> str:
    if isinstance(body, str):
        return body
    base = CHAT if "chat" in path else OK
    return json.dumps({**base, **body})


def _check_error(response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"}
    assert words in error["message"], error["message"]
    assert error["type"] == "invalid_request_error" and error["code"]


def test_malformed_requests_get_400s_and_change_nothing(server_for):
    llm = make_llm()
    server = server_for(llm)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body, status, words in CASES:
            _check_error(client.post(path, content=_body(path, body)), status, words)
            if isinstance(body, dict) and "stream" not in body:  # refused before any event
                streamed = _body(path, {**body, "stream": True})
                _check_error(client.post(path, content=streamed), status, words)
        text = client.get("/metrics").text
        refused = sum(2 if isinstance(b, dict) and "stream" not in b else 1 for _, b, _, _ in CASES)
        assert metric(text, "flashdec_requests_rejected_total") == refused
        assert metric(text, "flashdec_requests_received_total") == 0
        assert llm._next_id == 0 and llm._runner.requests == {}  # nothing was ever queued
        # the engine serves on; the content type is not insisted on (curl -d sends a form's)
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        good = client.post("/v1/completions", content=json.dumps(OK), headers=form)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
        assert client.get("/health").json() == {"status": "ok"}


def test_unknown_routes_and_methods(server_for):
    server = server_for(make_llm(tokenizer=False))  # no tokenizer: a faster front-end start
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.get("/v1/nothing")
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
        response = client.get("/v1/completions")
        assert response.status_code == 405
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_a_model_without_tokenizer_takes_token_ids_only(server_for):
    server = server_for(make_llm(tokenizer=False))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body in (
            ("/v1/completions", {**OK, "prompt": "hello"}),
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {**OK, "stop": ["x"]}),
        ):
            _check_error(client.post(path, json=body), 400, "needs a tokenizer")
        response = client.post(
            "/v1/completions", json={**OK, "return_token_ids": True, "model": MODEL_NAME}
        )
        choice = response.json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 2


def test_a_prompt_the_pool_can_never_hold(server_for):
    """Within max_model_len but beyond the KV pool: the LLM's own up-front check, a 400."""
    server = server_for(make_llm(tokenizer=False, num_blocks=4, block_size=16))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/completions", json={"prompt": [7] * 100, "max_tokens": 8})
        _check_error(response, 400, "can never fit the KV cache")
        assert client.post("/v1/completions", json=OK).status_code == 200
