"""The engine thread: the one owner of a :class:`flashdec.LLM` in a server.

HTTP handlers run on an asyncio event loop; the model runs on one thread of its own that steps
the LLM's serving loop whenever a request waits or runs, so the requests of every connection
share one running batch (continuous batching). The two sides meet in two places only:

- an inbox (a thread-safe ``queue.SimpleQueue``) of commands: submit, abort, snapshot, stop. The
  thread drains it between steps and blocks on it when nothing runs;
- each request's :class:`RequestStream`, whose acceptance future and update queue live on the
  handler's event loop. After every step the thread hands the new tokens of all requests to that
  loop in one ``call_soon_threadsafe`` call (one wake-up per step, not one per token).

Cancellation: an abort (a client that went away, a stop string matched) is applied before the
next step, through :meth:`flashdec.LLM.abort_request`: a running request's KV blocks return to
the pool at once. An exception in a step fails the requests that were running with an internal
error and the thread serves on; a bad request is refused by ``add_request``'s own checks (a 400)
and never reaches a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashdec.llm import LLM, SamplingParams
from flashdec.server.metrics import ServerMetrics

log = logging.getLogger("flashdec.server")


class EngineError(Exception):
    """Why a request failed, as an HTTP status and an OpenAI-style error type and code."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code or {400: "invalid_request", 503: "unavailable"}.get(status, "internal")


@dataclass(frozen=True)
class GenerationRequest:
    """What a handler asks the engine for (the prompt already tokenized)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
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
    """One submitted request as its handler sees it; use it on the loop it was made on."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()  # None, or the EngineError
        self._updates: asyncio.Queue[StreamUpdate] = asyncio.Queue()
        self.arrival = time.perf_counter()
        # the engine thread's bookkeeping
        self.rid: int | None = None
        self.sent = 0  # tokens handed to the loop
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


class _Outbox:
    """What one engine iteration hands to the event loops: one call per loop."""

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list] = {}

    def add(self, stream: RequestStream, item: StreamUpdate | EngineError | None) -> None:
        self._items.setdefault(stream.loop, []).append((stream, item))

    def flush(self) -> None:
        for loop, items in self._items.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its handlers are gone
                loop.call_soon_threadsafe(_deliver, items)
        self._items = {}


def _deliver(items: list) -> None:
    """On the event loop: resolve acceptances, queue updates."""
    for stream, item in items:
        if isinstance(item, StreamUpdate):
            stream._updates.put_nowait(item)
        elif not stream.accepted.done():  # the handler may have gone already
            stream.accepted.set_result(item)


class EngineThread:
    """Runs ``llm`` on a thread of its own for the requests handlers submit.

    Args:
        llm: the model; nothing else may use it while the thread runs.
        metrics: where requests and tokens are counted.
    """

    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"llm must be a flashdec.LLM, got {type(llm).__name__}")
        self.llm = llm
        self.metrics = metrics or ServerMetrics()
        self.eos = frozenset(llm.adapter.spec.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders puts against closing
        self._closed = False
        self._streams: dict[int, RequestStream] = {}  # request id -> stream, in the LLM
        self._thread = threading.Thread(target=self._run, name="flashdec-engine", daemon=True)

    # ------------------------------------------------------------------ handler side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _put(self, command: tuple) -> None:
        with self._lock:
            if self._closed:
                raise EngineError(503, "the server is shutting down", "server_error")
            self._inbox.put(command)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue ``request`` (call on the handler's event loop); await ``wait_accepted()`` next.
        EngineError 503 once the engine has stopped."""
        stream = RequestStream(request, asyncio.get_running_loop())
        self._put(("submit", stream))
        return stream

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Cancel ``stream``'s request (a no-op once it ended, or after the engine stopped);
        ``reason`` is what the metrics count ("stop": a stop string matched)."""
        with contextlib.suppress(EngineError):  # stopping cancels everything anyway
            self._put(("abort", (stream, reason)))

    async def snapshot(self) -> dict:
        """Gauges read by the engine thread between steps: requests running and waiting, KV
        blocks used and in the pool, and the prefix cache's counters when the LLM has one."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._put(("snapshot", (loop, future)))
        return await future

    def stop(self, timeout: float | None = None) -> None:
        """Cancel every request and end the thread (idempotent)."""
        with contextlib.suppress(EngineError):  # stopped already
            self._put(("stop", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        outbox = _Outbox()
        llm = self.llm
        stopping = False
        while not stopping:
            try:
                commands = [self._inbox.get()] if not llm.has_unfinished() else []
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for kind, arg in commands:
                    if kind == "stop":
                        stopping = True
                    else:
                        self._command(kind, arg, outbox)
                if not stopping and llm.has_unfinished():
                    llm.step()
                    self._publish(outbox)
            except Exception as exc:  # a failed step changed nothing: fail its requests
                log.exception("engine step failed; failing the running requests")
                error = EngineError(
                    500, f"internal error: {type(exc).__name__}: {exc}", "server_error"
                )
                self._fail_all(outbox, error, "error")
            outbox.flush()
        with self._lock:
            self._closed = True
        error = EngineError(503, "the server stopped before the request finished", "server_error")
        self._fail_all(outbox, error, "abort")
        while True:  # commands that came in while stopping
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                outbox.add(arg, EngineError(503, "the server is shutting down", "server_error"))
            elif kind == "snapshot":
                arg[0].call_soon_threadsafe(_resolve, arg[1], {})
        outbox.flush()

    def _command(self, kind: str, arg, outbox: _Outbox) -> None:
        """One handler command; an unexpected error fails only the request it is about."""
        try:
            if kind == "submit":
                self._submit(arg, outbox)
            elif kind == "abort":
                self._abort(*arg, outbox)
            else:
                self._snapshot(*arg)
        except Exception as exc:
            log.exception("engine command %r failed", kind)
            if kind == "snapshot":
                arg[0].call_soon_threadsafe(_resolve, arg[1], {})
                return
            error = EngineError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
            if kind == "submit" and arg.rid is None:
                outbox.add(arg, error)  # never queued
                return
            stream = arg[0] if kind == "abort" else arg
            if self._streams.get(stream.rid) is stream:
                del self._streams[stream.rid]
                self._ended(stream, "error")
                outbox.add(stream, StreamUpdate((), error=error))

    def _submit(self, stream: RequestStream, outbox: _Outbox) -> None:
        request = stream.request
        try:
            rid = self.llm.add_request(
                list(request.prompt_ids),
                request.max_tokens,
                ignore_eos=request.ignore_eos,
                sampling=request.sampling,
            )
        except (TypeError, ValueError) as exc:  # the LLM's own checks: nothing was queued
            outbox.add(stream, EngineError(400, str(exc)))
            return
        stream.rid = rid
        self._streams[rid] = stream
        self.metrics.received(len(request.prompt_ids))
        outbox.add(stream, None)

    def _abort(self, stream: RequestStream, reason: str, outbox: _Outbox) -> None:
        rid = stream.rid
        if rid is None or self._streams.get(rid) is not stream:
            return  # refused, or already ended
        self.llm.abort_request(rid)  # its blocks go back now, before the next step
        del self._streams[rid]
        self._ended(stream, reason)
        outbox.add(stream, StreamUpdate((), reason))

    def _snapshot(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        llm = self.llm
        view = llm.engine.scheduling_snapshot(llm.loop.step_index)
        cache = llm.engine.cache.metrics()
        gauges = {
            "requests_running": len(view.active),
            "requests_waiting": len(view.waiting),
            "kv_blocks_used": cache["num_used_blocks"],
            "kv_blocks_total": cache["num_blocks"],
        }
        prefix_stats = getattr(llm, "prefix_cache_stats", None)  # SPEC §8.7, when it lands
        if prefix_stats is not None:
            stats = prefix_stats()
            gauges["prefix_cache_queried_tokens_total"] = stats["queried_tokens"]
            gauges["prefix_cache_hit_tokens_total"] = stats["hit_tokens"]
        loop.call_soon_threadsafe(_resolve, future, gauges)

    def _publish(self, outbox: _Outbox) -> None:
        """Hand every request's new tokens to its loop; forget the requests that finished."""
        now = time.perf_counter()
        llm = self.llm
        for rid, stream in list(self._streams.items()):
            try:
                tokens, finished = llm.poll(rid, stream.sent)
            except RuntimeError as exc:  # the scheduler rejected it: it can never run
                del self._streams[rid]
                llm.abort_request(rid)
                self._ended(stream, "error")
                outbox.add(stream, StreamUpdate((), error=EngineError(400, str(exc))))
                continue
            if tokens:
                if stream.first_at is None:
                    stream.first_at = now
                    self.metrics.first_token(now - stream.arrival)
                stream.sent += len(tokens)
                stream.last_at = now
            reason = None
            if finished:
                del self._streams[rid]
                last = llm.abort_request(rid)[-1:]  # forgets it (its blocks went back already)
                eos = not stream.request.ignore_eos and bool(last) and last[0] in self.eos
                reason = "stop" if eos else "length"
                self._ended(stream, reason)
            if tokens or reason:
                outbox.add(stream, StreamUpdate(tuple(tokens), reason))

    def _ended(self, stream: RequestStream, reason: str) -> None:
        tpot = None
        if stream.sent > 1:
            tpot = (stream.last_at - stream.first_at) / (stream.sent - 1)
        self.metrics.ended(reason, stream.sent, tpot)

    def _fail_all(self, outbox: _Outbox, error: EngineError, reason: str) -> None:
        """End every request with ``error`` (a failed step, or the engine stopping)."""
        for rid, stream in list(self._streams.items()):
            del self._streams[rid]
            try:
                self.llm.abort_request(rid)
            except Exception:  # keep failing the others
                log.exception("could not cancel request %s", rid)
            self._ended(stream, reason)
            outbox.add(stream, StreamUpdate((), error=error))
        if self.llm.has_unfinished() and self.llm.loop.live_ids:
            self.llm.loop.close()  # nothing of ours is left: nothing else may keep running


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
