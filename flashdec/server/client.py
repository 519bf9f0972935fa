"""The engine as the HTTP front end sees it: submit, abort and snapshot over the pipes.

Runs on the front end's event loop (:mod:`~flashdec.server.frontend`). Commands go out through
an asyncio pipe transport (a write never blocks the loop; a full pipe buffers in the
transport); the engine thread's messages come in through another and are dispatched to each
request's :class:`RequestStream` (one engine message per step carries every request's tokens).
The counters and histograms of ``/metrics`` are recorded here, as the front end receives the
tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

from flashdec.server.metrics import ServerMetrics
from flashdec.server.wire import EngineError, Frames, frame

log = logging.getLogger("flashdec.server")


@dataclass(frozen=True)
class GenerationRequest:
    """What a handler asks the engine for (the prompt already tokenized)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class StreamUpdate:
    """New tokens of one request; the last update has a ``finish_reason`` or an ``error``."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens), "abort"
    error: EngineError | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class RequestStream:
    """One submitted request as its handler sees it."""

    def __init__(self, sid: int, request: GenerationRequest) -> None:
        self.sid = sid
        self.request = request
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._updates: asyncio.Queue[StreamUpdate] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.sent = 0  # tokens received
        self.first_at: float | None = None
        self.last_at: float | None = None

    async def wait_accepted(self) -> None:
        """Returns once the engine queued the request; raises its EngineError when refused."""
        error = await self.accepted
        if error is not None:
            raise error

    async def updates(self) -> AsyncIterator[StreamUpdate]:
        """Updates as the steps produce them (the ones already waiting merged into one), up to
        and including the final one."""
        while True:
            update = await self._updates.get()
            tokens = list(update.token_ids)
            while not update.final and not self._updates.empty():
                update = self._updates.get_nowait()
                tokens += update.token_ids
            yield StreamUpdate(tuple(tokens), update.finish_reason, update.error)
            if update.final:
                return


class _Incoming(asyncio.Protocol):
    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._frames = Frames()

    def data_received(self, data: bytes) -> None:
        for message in self._frames.feed(data):
            self._client._dispatch(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client._engine_gone()


class EngineClient:
    """The engine thread's side of the pipes, on the front end's event loop.

    Args:
        commands: the write end of the pipe to the engine thread.
        updates: the read end of the engine thread's pipe.
        metrics: where requests and tokens are counted.
    """

    def __init__(
        self,
        commands: Connection,
        updates: Connection,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self._commands = commands
        self._updates = updates
        self.metrics = metrics or ServerMetrics()
        self._out: asyncio.WriteTransport | None = None
        self._ids = itertools.count()
        self._streams: dict[int, RequestStream] = {}  # sid -> stream, until its last update
        self._snapshots: dict[int, asyncio.Future] = {}
        self.alive = False  # the engine thread serves

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        self._out, _ = await loop.connect_write_pipe(asyncio.Protocol, self._commands)
        await loop.connect_read_pipe(lambda: _Incoming(self), self._updates)
        self.alive = True

    def _send(self, message: tuple) -> None:
        if not self.alive:
            raise EngineError(503, "the engine has stopped", "server_error")
        self._out.write(frame(message))

    # ------------------------------------------------------------------ handler side
    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue ``request``; await ``wait_accepted()`` next. EngineError 503 once the engine
        has stopped."""
        stream = RequestStream(next(self._ids), request)
        r = request
        sampling = (r.temperature, r.top_k, r.top_p, r.seed)
        ids = list(r.prompt_ids)
        self._send(("submit", stream.sid, ids, r.max_tokens, *sampling, r.ignore_eos))
        self._streams[stream.sid] = stream
        return stream

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Cancel ``stream``'s request (a no-op once it ended, or after the engine stopped);
        ``reason`` is what the metrics count ("stop": a stop string matched)."""
        if stream.sid in self._streams and self.alive:
            self._send(("abort", stream.sid, reason))

    async def snapshot(self) -> dict:
        """Gauges the engine thread reads between steps: requests running and waiting, KV
        blocks used and in the pool, and the prefix cache's counters when the LLM has one
        (empty once the engine has stopped)."""
        if not self.alive:
            return {}
        token = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._snapshots[token] = future
        self._send(("snapshot", token))
        try:
            return await future
        finally:
            self._snapshots.pop(token, None)

    # ------------------------------------------------------------------ the engine's messages
    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "updates":
            self._updates_of_a_step(message[1])
        elif kind == "snapshot":
            future = self._snapshots.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "stopped":
            self._engine_gone()
        else:
            log.error("unknown message from the engine: %r", kind)

    def _updates_of_a_step(self, items: list) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        for sid, token_ids, finish, error in items:
            stream = self._streams.get(sid)
            if stream is None:
                continue
            if token_ids is None:  # the answer to its submit
                if error is None:
                    metrics.received(len(stream.request.prompt_ids))
                else:
                    del self._streams[sid]
                _resolve(stream.accepted, None if error is None else EngineError.from_wire(error))
                continue
            if token_ids:
                if stream.first_at is None:
                    stream.first_at = now
                    metrics.first_token(now - stream.arrival)
                stream.sent += len(token_ids)
                stream.last_at = now
            if finish is not None:
                del self._streams[sid]
                self._ended(stream, finish)
            failed = None if error is None else EngineError.from_wire(error)
            reason = finish if failed is None else None
            stream._updates.put_nowait(StreamUpdate(tuple(token_ids), reason, failed))

    def _ended(self, stream: RequestStream, reason: str) -> None:
        tpot = None
        if stream.sent > 1:
            tpot = (stream.last_at - stream.first_at) / (stream.sent - 1)
        self.metrics.ended(reason, stream.sent, tpot)

    def _engine_gone(self) -> None:
        """The engine thread ended (or its process): fail whatever is left with a 503."""
        self.alive = False
        error = EngineError(503, "the server stopped before the request finished", "server_error")
        refused = EngineError(503, "the engine has stopped", "server_error")
        for stream in self._streams.values():
            if stream.accepted.done():
                self._ended(stream, "abort")
                stream._updates.put_nowait(StreamUpdate((), error=error))
            else:
                _resolve(stream.accepted, refused)
        self._streams.clear()
        for future in self._snapshots.values():
            _resolve(future, {})


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
