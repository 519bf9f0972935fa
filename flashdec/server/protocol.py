"""The OpenAI request bodies the server accepts, checked with pydantic in strict mode.

Strict: a JSON string is not a number and ``true`` is not ``1``, so a wrong type is a 400 naming
the field, never a coerced value. Fields FlashDec does not implement (``n`` other than 1,
``logprobs``, ``echo``, penalties, ``logit_bias``, tools) are refused when set to anything but
their neutral value; fields nobody needs to act on (``user``) and unknown ones are ignored.
Two extensions follow vLLM's names: ``top_k``, ``ignore_eos`` and ``return_token_ids`` (each
choice then carries the generated ``token_ids``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flashdec.server.wire import EngineError

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: every token
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: Any = Field(None, validate_default=True)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return tuple(stops)

    @model_validator(mode="after")
    def _supported(self):
        if self.n not in (None, 1):
            raise ValueError(f"n: only n=1 is supported, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name}: penalties are not supported (send 0 or leave it out)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported (send {} or leave it out)")
        return self


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: Any
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string or a non-empty list of token ids")
        if all(_is_int(t) for t in value):
            return value
        if len(value) == 1 and (isinstance(value[0], str) or _is_token_list(value[0])):
            return value[0]  # a batch of one
        if all(isinstance(p, str) or _is_token_list(p) for p in value):
            raise ValueError(f"one prompt per request is supported, got {len(value)}")
        raise ValueError("must be a string or a non-empty list of token ids")

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo:
            raise ValueError("echo: not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of: only 1 is supported, got {self.best_of}")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs: not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str:
        if value is None or isinstance(value, str):
            return value or ""
        if isinstance(value, list):
            parts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError("only text content parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text part needs a string 'text'")
                parts.append(part["text"])
            return "".join(parts)
        raise ValueError("must be a string or a list of text parts")

    def as_template_input(self) -> dict[str, str]:
        # "developer" is OpenAI's newer name for "system"; chat templates know the latter
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    tools: list | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.logprobs:
            raise ValueError("logprobs: not supported")
        if self.tools:
            raise ValueError("tools: not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only text is supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(body: bytes, model: type[BaseModel]) -> Any:
    """The request ``body`` as ``model``; EngineError 400 naming the first problem."""
    try:
        payload = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise EngineError(400, f"the request body must be a JSON object, got {_json_type(payload)}")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "missing":
            message = "this field is required"
        raise EngineError(400, f"{where}: {message}" if where else message) from None


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def error_body(error: EngineError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "code": error.code}}
