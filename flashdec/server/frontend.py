"""The HTTP front-end process: uvicorn and the FastAPI app, apart from the model's process.

Request parsing and checks, tokenization and chat templates, detokenization, stop strings,
server-sent events and ``/metrics`` all run here, so none of it takes the GIL from the engine
thread that steps the model (:mod:`~flashdec.server.engine`), and the engine's steps do not
delay the event loop. :class:`flashdec.server.run.Frontend` starts it (a fresh interpreter: CUDA
does not survive a fork) with the listening socket, the three pipes and :class:`FrontendSettings`.

This module imports only the standard library at the top; :func:`main` imports FastAPI,
uvicorn and transformers' tokenizer (when the LLM has one), never torch.

Signals: the front end runs in a session of its own and ignores SIGINT (the parent decides
between draining and cancelling); SIGTERM ends it at once. It ends when the parent's control
pipe closes, so it never outlives the parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

log = logging.getLogger("flashdec.server")


@dataclass(frozen=True)
class FrontendSettings:
    """What the front end needs of the LLM and the server's knobs, as plain values."""

    model_name: str
    max_model_len: int
    default_max_tokens: int
    drain_timeout: float
    log_level: str
    tokenizer: bytes | None  # the LLM's tokenizer, pickled (None: token-id prompts only)


def main() -> None:
    """The front-end process's entry (``python -c``; see :class:`~flashdec.server.run.Frontend`):
    its arguments are the inherited descriptors of the listening socket, the command pipe's
    write end, the update pipe's read end and the control pipe; serves until told to stop."""
    # the parent's to decide, SIGTERM too: a service manager or pkill that signals every
    # process of the server must drain it, not drop its connections; this process ends when
    # the parent tells it to, or goes away (EOF on the control pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock_fd, commands_fd, updates_fd, control_fd = map(int, sys.argv[1:5])
    control = Connection(control_fd)
    try:
        settings: FrontendSettings = control.recv()
    except EOFError:  # the parent went away before sending them
        sys.exit(1)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    server = None
    try:
        sock = socket.socket(fileno=sock_fd)
        server, client = _build(settings, Connection(commands_fd), Connection(updates_fd))
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(server, client, sock, control))
    except BaseException as exc:  # before it served: one line to the parent, whatever it was
        if server is not None and server.started:
            raise
        with contextlib.suppress(OSError):
            control.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # served and shut down: the interpreter's teardown of its modules can go


def _loop_factory():
    """uvloop's event loop when it is installed, else asyncio's: uvicorn's loop="auto" choice,
    which it makes only in ``uvicorn.run``/``Server.run``, not for ``Server.serve`` on a loop of
    ours. (http="auto", httptools' parser when installed, applies in ``serve`` itself.)"""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _build(settings: FrontendSettings, commands: Connection, updates: Connection):
    import uvicorn

    from flashdec.server.app import build_app
    from flashdec.server.client import EngineClient

    # transformers' tokenizers need no torch, but transformers imports it when it can: hidden,
    # transformers runs as in a tokenizer-only install (no torch here, a second faster start)
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch not found"
    tokenizer = None if settings.tokenizer is None else pickle.loads(settings.tokenizer)
    client = EngineClient(commands, updates)
    app = build_app(
        client,
        tokenizer=tokenizer,
        model_name=settings.model_name,
        max_model_len=settings.max_model_len,
        default_max_tokens=settings.default_max_tokens,
    )

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield  # the parent's signals decide; see the module's docstring

    config = uvicorn.Config(
        app,
        log_config=None,  # the root logger's configuration applies
        log_level=settings.log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=settings.drain_timeout,
    )
    return Server(config), client


async def _serve(server, client, sock: socket.socket, control: Connection) -> None:
    loop = asyncio.get_running_loop()
    await client.connect()

    def on_control() -> None:
        try:
            message = control.recv()
        except (EOFError, OSError):  # the parent went away
            loop.remove_reader(control.fileno())
            message = ("exit",)
        server.should_exit = True  # "drain": uvicorn's graceful shutdown (the drain timeout)
        if message[0] == "exit":
            server.force_exit = True  # what is left is cancelled

    loop.add_reader(control.fileno(), on_control)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.005)
    if server.started:
        parser = server.config.http_protocol_class.__module__.rsplit(".", 1)[-1]
        log.info(
            "HTTP front end: event loop %s, HTTP parser %s",
            type(loop).__module__.split(".")[0],
            parser.removesuffix("_impl"),
        )
        control.send(("ready",))
    await serving
