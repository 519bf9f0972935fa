"""What crosses the pipes between the HTTP front-end process and the engine thread.

Two one-way pipes join them: commands from the front end to the engine thread, updates back.
Every message is a plain tuple (cheap to pickle: pickling is engine-thread time under the GIL),
framed as a 4-byte big-endian length and a pickle (:func:`frame`, :class:`Frames`), so either
side can write without blocking its loop and read whatever arrived so far.

Commands (front end -> engine), ``sid`` the front end's number for a request:

- ``("submit", sid, prompt_ids, max_tokens, temperature, top_k, top_p, seed, ignore_eos)``
- ``("abort", sid, reason)``: reason is what the metrics count ("abort", or "stop": a stop
  string matched); a no-op once the request ended
- ``("snapshot", token)``: the gauges, answered by ``("snapshot", token, gauges)``

Updates (engine -> front end):

- ``("updates", items)``: ONE message per engine step (or batch of commands), every request's
  news of that step; each item is ``(sid, token_ids, finish, error)``:

  - ``token_ids`` None: the answer to a submit, ``error`` None (queued) or a refusal;
  - else the request's new tokens; ``finish`` (FINISH_REASONS, as the metrics count it) marks
    its last item, with ``error`` set when it failed;

  ``error`` is :meth:`EngineError.to_wire`'s tuple.
- ``("snapshot", token, gauges)``
- ``("stopped",)``: the engine thread ended; the front end fails what is left with a 503.

Life cycle (the control pipe, between the parent's main thread and the front end):
``("ready",)`` or ``("failed", message)`` from the front end once, then ``("drain",)`` (stop
accepting; let requests in flight finish for the drain timeout) or ``("exit",)`` from the parent.
"""

from __future__ import annotations

import pickle
import struct

FINISH_REASONS = ("stop", "length", "abort", "error")

_HEADER = struct.Struct("!I")


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

    def to_wire(self) -> tuple[int, str, str, str]:
        return (self.status, self.message, self.type, self.code)

    @classmethod
    def from_wire(cls, value: tuple[int, str, str, str]) -> EngineError:
        return cls(*value)


def frame(message: tuple) -> bytes:
    """``message`` as bytes to write to a pipe."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class Frames:
    """Reassembles framed messages from the chunks a pipe delivers."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        """Take ``data``; return the messages it completed, in order."""
        buffer = self._buffer
        buffer += data
        out, start = [], 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            out.append(pickle.loads(memoryview(buffer)[start + _HEADER.size : end]))
            start = end
        if start:
            del buffer[:start]
        return out
