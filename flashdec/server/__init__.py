"""``flashdec serve``: an OpenAI-compatible HTTP server over :class:`flashdec.LLM` (SPEC §8.9).

The HTTP stack is FastAPI on uvicorn: the stack vLLM's and SGLang's OpenAI servers use, well
kept, asynchronous, with pydantic models for the request bodies (strict checks and field-named
errors in one place), Starlette's streaming responses that cancel on a client's disconnect, and
uvicorn's graceful shutdown; uvicorn runs on pure-Python h11 here, so nothing needs compiling.
aiohttp would do too, but its request checks would be written by hand.

One engine thread owns the model (:mod:`~flashdec.server.engine`); the event loop parses,
tokenizes and streams (:mod:`~flashdec.server.app`, :mod:`~flashdec.server.text`);
:mod:`~flashdec.server.run` binds the socket and starts and stops both.

Only ``app``, ``protocol`` and the functions of ``run`` import FastAPI, pydantic and uvicorn, and
only when called: ``import flashdec`` and ``import flashdec.server`` work without them.
"""

from flashdec.server.config import ServerConfig
from flashdec.server.engine import EngineError, EngineThread, GenerationRequest, StreamUpdate
from flashdec.server.run import RunningServer, bind_socket, serve, start_server

__all__ = [
    "EngineError",
    "EngineThread",
    "GenerationRequest",
    "RunningServer",
    "ServerConfig",
    "StreamUpdate",
    "bind_socket",
    "serve",
    "start_server",
]
