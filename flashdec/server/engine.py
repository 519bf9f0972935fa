"""The engine thread: the one owner of a :class:`flashdec.LLM` in a server.

The HTTP front end runs in a process of its own (:mod:`~flashdec.server.frontend`); the model
runs here, on one thread of the process that built the LLM, which steps the LLM's serving loop
whenever a request waits or runs, so the requests of every connection share one running batch
(continuous batching). The two meet through two pipes (:mod:`~flashdec.server.wire`):

- commands (submit, abort, snapshot) arrive on one: the thread reads them itself, between steps
  (a ``poll`` with no timeout: one system call when none came) and blocks on it when nothing
  runs. No reader thread: a second Python thread here would contend for the GIL with every
  step, and the wake-up of a thread waiting for the GIL costs up to the switch interval (5 ms);
- after every step ONE message carries the new tokens, finish reasons and errors of all
  requests (not one per token).

Cancellation: an abort (a client that went away, a stop string matched) is applied before the
next step, through :meth:`flashdec.LLM.abort_request`: a running request's KV blocks return to
the pool at once. An exception in a step fails the requests that were running with an internal
error and the thread serves on; a bad request is refused by ``add_request``'s own checks (a 400)
and never reaches a step. When the front end goes away (its pipe closes) every request is
cancelled and the thread ends; so does :meth:`EngineThread.stop`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from multiprocessing.connection import Connection

from flashdec.llm import LLM, SamplingParams
from flashdec.server.wire import EngineError, Frames, frame

log = logging.getLogger("flashdec.server")

_READ_SIZE = 1 << 20
_INPUT = select.POLLIN | select.POLLHUP | select.POLLERR


class _FrontendGone(Exception):
    """The front end's pipe closed: nobody is left to serve."""


class _Request:
    __slots__ = ("ignore_eos", "sent", "sid")

    def __init__(self, sid: int, ignore_eos: bool) -> None:
        self.sid = sid
        self.ignore_eos = ignore_eos
        self.sent = 0  # tokens sent to the front end


class EngineThread:
    """Runs ``llm`` on a thread of its own for the requests a front end sends.

    Args:
        llm: the model; nothing else may use it while the thread runs.
        commands: the read end of the front end's command pipe.
        updates: the write end of the pipe to the front end.
    """

    def __init__(self, llm: LLM, commands: Connection, updates: Connection) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"llm must be a flashdec.LLM, got {type(llm).__name__}")
        self.llm = llm
        self.eos = frozenset(llm.adapter.spec.eos_token_ids)
        self._commands = commands
        self._updates = updates
        self._frames = Frames()
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes a thread blocked in poll
        self._wake_lock = threading.Lock()  # orders stop()'s wake-up against closing the pipe
        self._stopping = False
        self._requests: dict[int, _Request] = {}  # request id -> request
        self._by_sid: dict[int, int] = {}  # front end's sid -> request id
        self.messages_sent = 0  # update messages (one per step that had news)
        self._thread = threading.Thread(target=self._run, name="flashdec-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel every request and end the thread (idempotent); waits ``timeout`` seconds at
        most (0: not at all, e.g. in a signal handler)."""
        with self._wake_lock:
            if not self._stopping:
                self._stopping = True
                os.write(self._wake_w, b"x")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._serve()
        except _FrontendGone:
            log.info("the HTTP front end went away; cancelling its requests")
        except BaseException:
            log.exception("the engine thread failed")
        finally:
            with self._wake_lock:
                self._stopping = True
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
            items: list = []
            message = "the server stopped before the request finished"
            self._fail_all(items, EngineError(503, message, "server_error"), "abort")
            with contextlib.suppress(_FrontendGone, OSError):  # it may be gone
                if items:
                    self._send(("updates", items))
                self._send(("stopped",))

    def _serve(self) -> None:
        llm = self.llm
        commands = self._commands.fileno()
        os.set_blocking(commands, False)
        poller = select.poll()
        poller.register(commands, _INPUT)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            events = poller.poll(0 if llm.has_unfinished() else None)
            if self._stopping:
                return
            items: list = []
            if any(fd == commands for fd, _ in events):
                for message in self._read():
                    self._command(message, items)
            try:
                if llm.has_unfinished():
                    llm.step()
                    self._publish(items)
            except Exception as exc:  # a failed step changed nothing: fail its requests
                log.exception("engine step failed; failing the running requests")
                error = EngineError(
                    500, f"internal error: {type(exc).__name__}: {exc}", "server_error"
                )
                self._fail_all(items, error, "error")
            if items:
                self._send(("updates", items))

    def _read(self) -> list[tuple]:
        """The commands that arrived."""
        try:
            data = os.read(self._commands.fileno(), _READ_SIZE)
        except BlockingIOError:  # woken, but nothing complete to read yet
            return []
        if not data:
            raise _FrontendGone
        return self._frames.feed(data)

    def _send(self, message: tuple) -> None:
        data = memoryview(frame(message))
        fd = self._updates.fileno()
        while data:
            try:
                data = data[os.write(fd, data) :]
            except BrokenPipeError:
                raise _FrontendGone from None
        if message[0] == "updates":
            self.messages_sent += 1

    def _command(self, message: tuple, items: list) -> None:
        """One command; an unexpected error fails only the request it is about."""
        kind = message[0]
        try:
            if kind == "submit":
                self._submit(*message[1:], items=items)
            elif kind == "abort":
                self._abort(*message[1:], items=items)
            elif kind == "snapshot":
                self._send(("snapshot", message[1], self._snapshot()))
            else:
                raise ValueError(f"unknown command {kind!r}")
        except _FrontendGone:
            raise
        except Exception as exc:
            log.exception("engine command %r failed", kind)
            if kind == "snapshot":
                self._send(("snapshot", message[1], {}))
                return
            if kind not in ("submit", "abort"):
                return
            error = EngineError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
            sid = message[1]
            rid = self._by_sid.get(sid)
            if rid is None:  # never queued
                if kind == "submit":
                    items.append((sid, None, None, error.to_wire()))
                return
            self._forget(rid)
            items.append((sid, [], "error", error.to_wire()))

    def _submit(
        self,
        sid: int,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        ignore_eos: bool,
        *,
        items: list,
    ) -> None:
        try:
            sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            rid = self.llm.add_request(
                prompt_ids, max_tokens, ignore_eos=ignore_eos, sampling=sampling
            )
        except (TypeError, ValueError) as exc:  # the LLM's own checks: nothing was queued
            items.append((sid, None, None, EngineError(400, str(exc)).to_wire()))
            return
        self._requests[rid] = _Request(sid, ignore_eos)
        self._by_sid[sid] = rid
        items.append((sid, None, None, None))

    def _abort(self, sid: int, reason: str, *, items: list) -> None:
        rid = self._by_sid.get(sid)
        if rid is None:
            return  # refused, or already ended
        self.llm.abort_request(rid)  # its blocks go back now, before the next step
        self._forget(rid)
        items.append((sid, [], reason, None))

    def _forget(self, rid: int) -> None:
        request = self._requests.pop(rid)
        del self._by_sid[request.sid]

    def _snapshot(self) -> dict:
        """Gauges read between steps: requests running and waiting, KV blocks used and in the
        pool, the prefix cache's counters when it is on (with its host tier's), and
        speculation's when it is on."""
        llm = self.llm
        view = llm.engine.scheduling_snapshot(llm.loop.step_index)
        cache = llm.engine.cache.metrics()
        gauges = {
            "requests_running": len(view.active),
            "requests_waiting": len(view.waiting),
            "kv_blocks_used": cache["num_used_blocks"],
            "kv_blocks_total": cache["num_blocks"],
        }
        if llm.enable_prefix_caching:
            stats = llm.prefix_cache_stats()
            gauges["prefix_cache_queried_tokens_total"] = stats["queried_tokens"]
            gauges["prefix_cache_hit_tokens_total"] = stats["hit_tokens"]
            host = stats.get("host")
            if host is not None:
                gauges["prefix_cache_host_hit_tokens_total"] = stats["host_hit_tokens"]
                gauges["host_kv_blocks_cached"] = host["cached_blocks"]
                gauges["host_kv_blocks_total"] = host["capacity_blocks"]
                for way in ("down", "up"):
                    gauges[f"host_kv_copy_{way}_blocks_total"] = host[f"blocks_{way}"]
                    gauges[f"host_kv_copy_{way}_bytes_total"] = host[f"bytes_{way}"]
                    gauges[f"host_kv_copy_{way}_seconds_total"] = host[f"copy_{way}_s"]
                    gauges[f"host_kv_copy_{way}_failures_total"] = host[f"failed_{way}"]
        if llm.loop.preemption is not None:
            gauges["requests_swapped_total"] = llm.num_swaps
        if llm.speculative is not None:
            counts = llm.speculative_counters()
            gauges["speculative_draft_tokens_total"] = counts["draft_tokens"]
            gauges["speculative_accepted_tokens_total"] = counts["accepted_tokens"]
        return gauges

    def _publish(self, items: list) -> None:
        """Every request's new tokens; forget the requests that finished."""
        llm = self.llm
        for rid, request in list(self._requests.items()):
            try:
                tokens, finished = llm.poll(rid, request.sent)
            except RuntimeError as exc:  # the scheduler rejected it: it can never run
                self._forget(rid)
                llm.abort_request(rid)
                items.append((request.sid, [], "error", EngineError(400, str(exc)).to_wire()))
                continue
            request.sent += len(tokens)
            reason = None
            if finished:
                self._forget(rid)
                last = llm.abort_request(rid)[-1:]  # forgets it (its blocks went back already)
                eos = not request.ignore_eos and bool(last) and last[0] in self.eos
                reason = "stop" if eos else "length"
            if tokens or reason:
                items.append((request.sid, tokens, reason, None))

    def _fail_all(self, items: list, error: EngineError, reason: str) -> None:
        """End every request with ``error`` (a failed step, or the engine stopping)."""
        wire = error.to_wire()
        for rid, request in list(self._requests.items()):
            self._forget(rid)
            try:
                self.llm.abort_request(rid)
            except Exception:  # keep failing the others
                log.exception("could not cancel request %s", rid)
            items.append((request.sid, [], reason, wire))
        if self.llm.has_unfinished() and self.llm.loop.live_ids:
            self.llm.loop.close()  # nothing of ours is left: nothing else may keep running
