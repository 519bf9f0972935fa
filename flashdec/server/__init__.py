"""``flashdec serve``: an OpenAI-compatible HTTP server over :class:`flashdec.LLM` (SPEC §8.9).

The HTTP stack is FastAPI on uvicorn: the stack vLLM's and SGLang's OpenAI servers use, well
kept, asynchronous, with pydantic models for the request bodies (strict checks and field-named
errors in one place), Starlette's streaming responses that cancel on a client's disconnect, and
uvicorn's graceful shutdown. uvicorn runs on its fast paths, uvloop's event loop and httptools'
HTTP parser (compiled wheels, dependencies of FlashDec; without them: asyncio and pure-Python
h11, about 1 ms more per request). aiohttp would do too, but its request checks would be
written by hand.

Two processes serve, as vLLM's API server and engine core do, so that HTTP work and the model's
steps never wait for each other's GIL:

- the process that built the LLM runs ONE engine thread that owns the model and steps it
  (:mod:`~flashdec.server.engine`); :mod:`~flashdec.server.run` binds the socket there and
  starts and stops both sides;
- a front-end process (multiprocessing's "spawn": CUDA does not survive a fork) runs uvicorn on
  that socket: parsing and checks, tokenization, chat templates, detokenization, stop strings,
  server-sent events and ``/metrics`` (:mod:`~flashdec.server.frontend`,
  :mod:`~flashdec.server.client`, :mod:`~flashdec.server.app`, :mod:`~flashdec.server.text`).

They talk over pipes in small framed tuples (:mod:`~flashdec.server.wire`): commands one way,
one message per engine step the other. The front end imports neither torch nor the model.

Only ``app``, ``protocol`` and the front end's ``main`` import FastAPI, pydantic and uvicorn;
``import flashdec.server`` imports nothing of the server until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineError": "flashdec.server.wire",
    "EngineThread": "flashdec.server.engine",
    "GenerationRequest": "flashdec.server.client",
    "RunningServer": "flashdec.server.run",
    "ServerConfig": "flashdec.server.config",
    "StreamUpdate": "flashdec.server.client",
    "bind_socket": "flashdec.server.run",
    "serve": "flashdec.server.run",
    "start_server": "flashdec.server.run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # lazily: the front-end process imports this package and must not import torch
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashdec.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
