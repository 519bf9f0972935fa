"""The HTTP routes: OpenAI's completions and chat completions, models, health and metrics.

Handlers run on the front-end process's event loop. They parse and check the body, tokenize
(the chat template for chat), submit to the engine thread
(:class:`~flashdec.server.client.EngineClient`) and turn its token updates into text
(:class:`~flashdec.server.text.IncrementalText`): one JSON response, or server-sent events
ending in ``data: [DONE]``. A client that goes away mid-request cancels it: Starlette cancels a
streaming response when the client disconnects, and a plain response races its collection
against the connection's disconnect message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from flashdec import __version__
from flashdec.server.client import EngineClient, GenerationRequest, RequestStream
from flashdec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_body,
)
from flashdec.server.text import IncrementalText
from flashdec.server.wire import EngineError

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class _Job:
    """One checked request, ready for the engine."""

    kind: str  # "completion" or "chat"
    id: str
    created: int
    request: GenerationRequest
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


class _Output:
    """A request's output so far: the token ids kept (up to a stop string) and their text."""

    def __init__(self, tokenizer, job: _Job) -> None:
        self.text = None
        if tokenizer is not None:
            self.text = IncrementalText(tokenizer, job.request.prompt_ids, job.stop)
        self.token_ids: list[int] = []
        self._reported = 0  # token ids already in a chunk

    def add(self, token_ids, engine_finish: str | None) -> tuple[str, str | None, list[int]]:
        """Take new tokens; returns (new text, finish reason or None, new kept ids)."""
        self.token_ids += token_ids
        finish = engine_finish
        piece = ""
        if self.text is not None:
            piece = self.text.add(token_ids)
            if self.text.stopped:
                finish = "stop"
                del self.token_ids[self.text.num_tokens :]
            if finish is not None:
                piece += self.text.finish()
        new_ids = self.token_ids[self._reported :]
        self._reported = len(self.token_ids)
        return piece, finish, new_ids

    @property
    def full_text(self) -> str:
        return "" if self.text is None else self.text.text


class Serving:
    """The state the routes share: the engine, the tokenizer and the served model's name."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer,
        model_name: str,
        max_model_len: int,
        default_max_tokens: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    # ------------------------------------------------------------------ checks
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise EngineError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
            )

    def _needs_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise EngineError(
                400,
                f"{what} needs a tokenizer, and model {self.model_name!r} has none (a built-in "
                "random-weight shape, or a directory without tokenizer files): send the prompt "
                "as token ids to /v1/completions",
            )

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        self._needs_tokenizer("chat")
        messages = [m.as_template_input() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # no template, or the template refused the messages
            raise EngineError(400, f"messages: the chat template failed: {exc}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def job(self, kind: str, raw: bytes) -> _Job:
        """Parse and check a request body; EngineError (400/404) naming the problem."""
        if kind == "chat":
            body = parse_body(raw, ChatCompletionRequest)
            self._check_model(body.model)
            ids = self._chat_ids(body)
            max_tokens = body.requested_max_tokens
            default = self.default_max_tokens
        else:
            body = parse_body(raw, CompletionRequest)
            self._check_model(body.model)
            if isinstance(body.prompt, str):
                self._needs_tokenizer("a text prompt")
                ids = list(self.tokenizer(body.prompt)["input_ids"])
            else:
                ids = list(body.prompt)
            max_tokens = body.max_tokens
            default = COMPLETION_DEFAULT_MAX_TOKENS
        if body.stop:
            self._needs_tokenizer("stop")
        if max_tokens is None:  # the default, capped by what the context has left
            max_tokens = max(1, min(default, self.max_model_len - len(ids)))
        request = GenerationRequest(  # the engine's SamplingParams checks the values again
            prompt_ids=tuple(ids),
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=max(body.top_k or 0, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return _Job(
            kind=kind,
            id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            request=request,
            stop=body.stop,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            return_token_ids=body.return_token_ids,
        )

    # ------------------------------------------------------------------ responses
    def _choice(self, job: _Job, text: str, finish: str | None, ids: list[int], chunk: bool):
        choice: dict = {"index": 0}
        if job.kind == "chat":
            if chunk:
                choice["delta"] = {"content": text} if text or finish is None else {}
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if job.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def _envelope(self, job: _Job, choices: list, chunk: bool) -> dict:
        kind = {"chat": "chat.completion", "completion": "text_completion"}[job.kind]
        if chunk and job.kind == "chat":
            kind += ".chunk"
        return {
            "id": job.id,
            "object": kind,
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
        }

    def _usage(self, job: _Job, output: _Output) -> dict:
        prompt, completion = len(job.request.prompt_ids), len(output.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def start(self, job: _Job) -> RequestStream:
        """Submit ``job``; returns once the engine queued it (EngineError when refused)."""
        stream = self.engine.submit(job.request)
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.engine.abort(stream)  # a no-op when it was refused
            raise
        return stream

    async def collect(self, job: _Job, stream: RequestStream) -> dict:
        """The whole response of a non-streaming request."""
        output = _Output(self.tokenizer, job)
        finish = None
        try:
            async for update in stream.updates():
                if update.error is not None:
                    finish = "error"
                    raise update.error
                _, finish, _ = output.add(update.token_ids, update.finish_reason)
                if finish is not None:
                    break
        finally:
            self._settle(stream, output, finish)
        choice = self._choice(job, output.full_text, finish, output.token_ids, chunk=False)
        body = self._envelope(job, [choice], chunk=False)
        body["usage"] = self._usage(job, output)
        return body

    async def events(self, job: _Job, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events of a streaming request, ending in ``data: [DONE]``."""
        output = _Output(self.tokenizer, job)
        finish = None
        try:
            if job.kind == "chat":  # the role comes first, as OpenAI sends it
                choice = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                choice |= {"logprobs": None, "finish_reason": None}
                yield _event(self._envelope(job, [choice], chunk=True))
            async for update in stream.updates():
                if update.error is not None:
                    finish = "error"
                    yield _event(error_body(update.error))
                    break
                piece, finish, ids = output.add(update.token_ids, update.finish_reason)
                plain_ids = self.tokenizer is None or job.return_token_ids
                if piece or finish is not None or (ids and plain_ids):
                    choice = self._choice(job, piece, finish, ids, chunk=True)
                    yield _event(self._envelope(job, [choice], chunk=True))
                if finish is not None:
                    break
            if job.include_usage and finish != "error":
                usage = self._envelope(job, [], chunk=True)
                usage["usage"] = self._usage(job, output)
                yield _event(usage)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task was cancelled), or the output ended
            self._settle(stream, output, finish)

    def _settle(self, stream: RequestStream, output: _Output, finish: str | None) -> None:
        """Cancel the engine's request unless it ended there: a stop string matched, or the
        client went away (``finish`` None)."""
        stopped_here = output.text is not None and output.text.stopped
        if finish is None or stopped_here:
            self.engine.abort(stream, "stop" if stopped_here else "abort")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    engine: EngineClient,
    *,
    tokenizer,
    model_name: str,
    max_model_len: int,
    default_max_tokens: int = 256,
) -> FastAPI:
    """The FastAPI application serving ``engine``'s model under ``model_name`` (``tokenizer``:
    the LLM's, or None for token-id prompts only)."""
    serving = Serving(engine, tokenizer, model_name, max_model_len, default_max_tokens)
    metrics = engine.metrics
    app = FastAPI(title="FlashDec", version=__version__, openapi_url=None)
    app.state.serving = serving

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        if 400 <= exc.status < 500:
            metrics.rejected()
        return JSONResponse(error_body(exc), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        error = EngineError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error_body(error), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        error = EngineError(500, f"internal error: {type(exc).__name__}", "server_error")
        return JSONResponse(error_body(error), status_code=500)

    async def _generate(kind: str, request: Request) -> Response:
        job = serving.job(kind, await request.body())
        stream = await serving.start(job)
        if job.stream:
            return StreamingResponse(
                serving.events(job, stream),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        collect = asyncio.ensure_future(serving.collect(job, stream))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or this task was cancelled)
                collect.cancel()  # its clean-up aborts the request
        if not collect.done():
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return Response(status_code=499)  # nobody is left to read it
        return JSONResponse(collect.result())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate("chat", request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": serving.created,
            "owned_by": "flashdec",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            error = EngineError(503, "the engine thread has stopped", "server_error")
            return JSONResponse(error_body(error), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        gauges = await engine.snapshot()
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4")

    return app
