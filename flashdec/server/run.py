"""Starting and stopping a server: in the foreground (``flashdec serve``) or on a thread.

uvicorn serves the FastAPI app on a socket bound here first (so a busy port fails before the
model loads, and port 0 picks a free one); the engine thread starts before the first request
and stops after the last. Stopping drains: the listening socket closes, requests in flight may
finish for ``drain_timeout`` seconds, then the rest are cancelled. uvicorn re-raises the signal
it caught once it has shut down; FlashDec's server does not, so a drained stop exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

from flashdec.llm import LLM
from flashdec.server.engine import EngineThread

log = logging.getLogger("flashdec.server")

STARTUP_TIMEOUT_S = 30.0
BACKLOG = 2048  # uvicorn's default


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


def _uvicorn_server(app, *, drain_timeout: float, log_level: str):
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the caught signal after shutdown (exit 130 / 143); the
            # first Ctrl-C or SIGTERM drains, a second Ctrl-C cancels, and the process exits 0
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        log_config=None,  # FlashDec's logging configuration applies
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=drain_timeout,
    )
    return Server(config)


def _parts(llm: LLM, model_name: str, default_max_tokens: int, drain_timeout: float, level: str):
    from flashdec.server.app import build_app

    engine = EngineThread(llm)
    app = build_app(engine, model_name=model_name, default_max_tokens=default_max_tokens)
    return engine, _uvicorn_server(app, drain_timeout=drain_timeout, log_level=level)


def serve(
    llm: LLM,
    sock: socket.socket,
    *,
    model_name: str,
    default_max_tokens: int = 256,
    drain_timeout: float = 30.0,
) -> None:
    """Serve ``llm`` on the bound ``sock`` until Ctrl-C or SIGTERM (call on the main thread)."""
    require_http_stack()
    engine, server = _parts(llm, model_name, default_max_tokens, drain_timeout, "info")
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()  # whatever is left is cancelled: the pool ends empty
        sock.close()


class RunningServer:
    """A server on a background thread (tests, notebooks); a context manager that stops it."""

    def __init__(self, engine: EngineThread, server, thread: threading.Thread, sock) -> None:
        self.engine = engine
        self._server = server
        self._thread = thread
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.port = port
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    @property
    def llm(self) -> LLM:
        return self.engine.llm

    def stop(self, *, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop serving (idempotent). ``drain``: let requests in flight finish (for at most the
        drain timeout) first; otherwise they end at once with a 503 error."""
        if not drain:
            self.engine.stop(timeout)
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        self.engine.stop(timeout)
        self._sock.close()

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
    """Serve ``llm`` on a background thread; returns once it accepts connections (port 0: a
    free port, see ``RunningServer.url``). Nothing else may use ``llm`` until it is stopped."""
    require_http_stack()
    sock = bind_socket(host, port)
    try:
        engine, server = _parts(llm, model_name, default_max_tokens, drain_timeout, log_level)
    except BaseException:
        sock.close()
        raise
    engine.start()
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="flashdec-http", daemon=True
    )
    thread.start()
    running = RunningServer(engine, server, thread, sock)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            running.stop()
            raise RuntimeError("the HTTP server did not start (see the log)")
        time.sleep(0.01)
    return running
