"""Starting and stopping a server: in the foreground (``flashdec serve``) or in the background.

Two processes serve. This one, which built the LLM, binds the socket (so a busy port fails
before the model loads, and port 0 picks a free one) and runs the engine thread
(:mod:`~flashdec.server.engine`); a front-end process spawned here runs uvicorn on that socket
(:mod:`~flashdec.server.frontend`). :func:`start_server` and :func:`serve` return or serve once
the front end accepts connections; a front end that fails to start is one RuntimeError here.

Stopping drains: the front end closes the listening socket, requests in flight may finish for
``drain_timeout`` seconds, then the rest are cancelled. The first Ctrl-C or SIGTERM drains, a
second Ctrl-C cancels at once, and ``flashdec serve`` returns (exit status 0). A front end that
dies cancels every request (the KV pool ends empty) and :func:`serve` raises.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import wait
from pathlib import Path

import flashdec
from flashdec.llm import LLM
from flashdec.server.engine import EngineThread
from flashdec.server.frontend import FrontendSettings

log = logging.getLogger("flashdec.server")

STARTUP_TIMEOUT_S = 60.0  # the front end's imports (FastAPI, transformers) take seconds
EXIT_GRACE_S = 10.0  # past the drain timeout, before a front end that hangs is killed
BACKLOG = 2048  # uvicorn's default
_ENTRY = "from flashdec.server.frontend import main; main()"


def require_http_stack() -> None:
    """ImportError naming what to install when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"flashdec serve needs FastAPI and uvicorn ({exc}); install them with "
            "pip install -c constraints.txt fastapi uvicorn"
        ) from None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: a free one); OSError when it cannot."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)  # connections wait in the backlog until uvicorn accepts them
    except OSError:
        sock.close()
        raise
    return sock


class Frontend:
    """The front-end process, from the parent's side: start, wait until it serves, stop.

    A fresh interpreter (``python -c``, the way multiprocessing's "spawn" starts one, but
    without re-running the caller's ``__main__``: a script that builds an LLM at its top level
    would build it again there) in a session of its own, so a terminal's Ctrl-C reaches only
    this process, which decides between draining and cancelling. It inherits the listening
    socket and its three pipe ends (``pass_fds``) and gets :class:`FrontendSettings` over the
    control pipe.
    """

    def __init__(self, llm: LLM, sock: socket.socket, settings: dict) -> None:
        try:
            tokenizer = None if llm.tokenizer is None else pickle.dumps(llm.tokenizer)
        except Exception as exc:
            raise TypeError(
                f"the LLM's tokenizer cannot be pickled for the HTTP process: {exc}"
            ) from None
        commands_r, commands_w = multiprocessing.Pipe(duplex=False)
        updates_r, updates_w = multiprocessing.Pipe(duplex=False)
        self.engine = EngineThread(llm, commands_r, updates_w)  # checks llm before the start
        self.control, control_child = multiprocessing.Pipe()
        fds = (sock.fileno(), commands_w.fileno(), updates_r.fileno(), control_child.fileno())
        root = str(Path(flashdec.__file__).resolve().parents[1])  # this flashdec, not another
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, *map(str, fds)],
                stdin=subprocess.DEVNULL,
                pass_fds=fds,
                start_new_session=True,
                env=env,
            )
        finally:
            for end in (commands_w, updates_r, control_child):
                end.close()  # the child's: its death must read as EOF here
        self.engine.start()
        self.drain_timeout = settings["drain_timeout"]
        frontend = FrontendSettings(
            max_model_len=llm.max_model_len, tokenizer=tokenizer, **settings
        )
        self.tell(frontend)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Returns once the front end accepts connections; RuntimeError (one line) when it
        failed, died or took longer than ``timeout`` seconds."""
        message = None
        if self.control.poll(timeout):
            with contextlib.suppress(EOFError, OSError):  # EOF: it died
                message = self.control.recv()
        else:
            message = ("timeout",)
        if message == ("ready",):
            return
        self.stop(drain=False, timeout=5.0)
        if message is not None and message[0] == "failed":
            raise RuntimeError(f"the HTTP front end did not start: {message[1]}")
        if message is not None:
            raise RuntimeError(f"the HTTP front end did not start within {timeout:.0f} s")
        raise RuntimeError(
            f"the HTTP front end died while starting (exit status {self.process.returncode})"
        )

    def tell(self, message) -> None:
        """Settings, ``("drain",)`` or ``("exit",)`` (a no-op once the front end is gone)."""
        with contextlib.suppress(OSError):
            self.control.send(message)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float | None) -> None:
        """Wait for the front end to end; kill it past ``timeout``."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the HTTP front end did not stop; killing it")
            self.process.kill()
            self.process.wait()

    def stop(self, *, drain: bool, timeout: float) -> None:
        """Drain (requests in flight may finish for the drain timeout) or cancel, then wait
        for both sides to end (idempotent)."""
        if not drain:
            self.engine.stop(timeout)  # every request ends now with a 503
        self.tell(("drain",))  # nothing left to wait for when cancelled
        self.join(timeout + (self.drain_timeout if drain else 0.0))
        self.engine.stop(timeout)  # the front end's EOF stopped it already
        self.control.close()


def _settings(model_name, default_max_tokens, drain_timeout, log_level) -> dict:
    return dict(
        model_name=model_name,
        default_max_tokens=default_max_tokens,
        drain_timeout=drain_timeout,
        log_level=log_level,
    )


def serve(
    llm: LLM,
    sock: socket.socket,
    *,
    model_name: str,
    default_max_tokens: int = 256,
    drain_timeout: float = 30.0,
) -> None:
    """Serve ``llm`` on the bound ``sock`` until Ctrl-C or SIGTERM (call on the main thread).
    RuntimeError when the front end fails to start or dies."""
    require_http_stack()
    frontend = Frontend(llm, sock, _settings(model_name, default_max_tokens, drain_timeout, "info"))
    stopping: list[int] = []

    def on_signal(signum, frame) -> None:
        if not stopping:
            log.info("stopping: requests in flight may finish for %.0f s", drain_timeout)
            frontend.tell(("drain",))
        elif signum == signal.SIGINT:  # a second Ctrl-C: cancel what is left
            log.info("stopping now: cancelling the requests in flight")
            frontend.engine.stop(0)
            frontend.tell(("exit",))
        stopping.append(signum)

    # signals reach only the main thread: elsewhere serve() ends when the front end does
    on_main = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM) if on_main else ()
    previous = {sig: signal.getsignal(sig) for sig in handled}
    try:
        # before the front end is ready: its first request may be served (and a signal sent)
        # before this thread, behind the engine's in the GIL, gets past wait_ready()
        for sig in handled:
            signal.signal(sig, on_signal)
        frontend.wait_ready()
        while frontend.alive:  # blocked in select, not polling: the engine thread keeps the GIL
            ended = wait([frontend.control], 1.0)  # its end of the pipe closed: it is exiting
            if ended or (stopping and not frontend.engine.alive):  # or cancelled: it exits now
                frontend.join(EXIT_GRACE_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        status = frontend.process.poll()
        frontend.stop(drain=False, timeout=EXIT_GRACE_S)
        sock.close()
    if not stopping:
        raise RuntimeError(f"the HTTP front end died (exit status {status})")


class RunningServer:
    """A server in the background (tests, notebooks): the front-end process and the engine
    thread; a context manager that stops them."""

    def __init__(self, frontend: Frontend, sock: socket.socket) -> None:
        self._frontend = frontend
        self.engine = frontend.engine
        self.process = frontend.process  # the front end
        host, port = sock.getsockname()[:2]
        self.port = port
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    @property
    def llm(self) -> LLM:
        return self.engine.llm

    def stop(self, *, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop serving (idempotent). ``drain``: let requests in flight finish (for at most the
        drain timeout) first; otherwise they end at once with a 503 error."""
        self._frontend.stop(drain=drain, timeout=timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    llm: LLM,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    model_name: str = "flashdec",
    default_max_tokens: int = 256,
    drain_timeout: float = 30.0,
    log_level: str = "warning",
) -> RunningServer:
    """Serve ``llm`` in the background; returns once the front end accepts connections (port 0:
    a free port, see ``RunningServer.url``). Nothing else may use ``llm`` until it is stopped.
    RuntimeError when the front end fails to start."""
    require_http_stack()
    with bind_socket(host, port) as sock:  # the front end holds its own copy
        settings = _settings(model_name, default_max_tokens, drain_timeout, log_level)
        frontend = Frontend(llm, sock, settings)
        running = RunningServer(frontend, sock)
        frontend.wait_ready()
    return running
