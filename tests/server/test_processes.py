"""The two processes of a server: the HTTP front end runs apart from the engine thread (and
without torch); the engine sends one pipe message per step, not one per token; a front end
that dies or never starts cancels everything and is one clear error; ``flashdec serve`` ends
on a terminal's Ctrl-C with exit status 0, no traceback and no process left behind."""

from __future__ import annotations

import json
import multiprocessing
import operator
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flashdec.server import EngineThread, start_server
from flashdec.server.wire import Frames, frame
from tests.server.conftest import make_llm, wait_for

httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[2]
LONG = {"prompt": [7, 8, 9, 10], "max_tokens": 200, "ignore_eos": True, "stream": True}


def _clean(llm) -> None:
    assert llm.loop.idle and llm._runner.requests == {}
    assert llm.engine.cache.metrics()["num_used_blocks"] == 0
    llm.engine.cache.validate_invariants()


def test_the_front_end_is_another_process_without_torch(server_for):
    server = server_for(make_llm())
    assert server.process.pid != os.getpid() and server.process.poll() is None
    engines = [t for t in threading.enumerate() if t.name == "flashdec-engine"]
    assert engines and server.engine.alive  # the engine thread runs here
    body = {"messages": [{"role": "user", "content": "hello cat"}], "max_tokens": 3}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200  # the chat template and the tokenizer ran there
    maps = Path(f"/proc/{server.process.pid}/maps")
    if maps.exists():
        assert "libtorch" not in maps.read_text()


def test_the_front_end_runs_on_uvloop_and_httptools(server_for, capfd):
    # uvicorn picks them (loop="auto", http="auto") only when installed, and its loop choice only
    # in Server.run: the front end, which runs Server.serve on a loop of its own, must pick it
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    server = server_for(make_llm(tokenizer=False), log_level="info")
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    err = capfd.readouterr().err  # the front end's log, on the stderr it inherited
    assert "HTTP front end: event loop uvloop, HTTP parser httptools" in err


def test_health_is_503_once_the_engine_thread_stopped(server_for):
    server = server_for(make_llm(tokenizer=False))
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    server.engine.stop(30)
    assert wait_for(lambda: httpx.get(server.url + "/health", timeout=30).status_code == 503)
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [7]}, timeout=30)
    assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"


def _engine_with_pipes(llm):
    commands_r, commands_w = multiprocessing.Pipe(duplex=False)
    updates_r, updates_w = multiprocessing.Pipe(duplex=False)
    return EngineThread(llm, commands_r, updates_w), commands_w, updates_r


def _submit(sid: int, prompt: list[int], n: int) -> bytes:
    return frame(("submit", sid, prompt, n, 0.0, 0, 1.0, None, True))


def test_one_pipe_message_per_step_not_per_token():
    """Two requests of 8 tokens each: every step's tokens of both travel in one message."""
    llm = make_llm(tokenizer=False)
    steps = []
    step = llm.step
    llm.step = lambda: steps.append(1) or step()
    engine, commands, updates = _engine_with_pipes(llm)
    os.write(commands.fileno(), _submit(0, [7, 8, 9], 8) + _submit(1, [10, 11, 12, 13], 8))
    engine.start()
    frames, messages, tokens, finished = Frames(), [], {0: [], 1: []}, set()
    while len(finished) < 2:
        assert updates.poll(30)
        for message in frames.feed(os.read(updates.fileno(), 1 << 16)):
            assert message[0] == "updates"
            messages.append(message[1])
            for sid, ids, finish, error in message[1]:
                assert error is None
                tokens[sid] += ids or []
                if finish is not None:
                    finished.add(sid)
    assert [len(t) for t in tokens.values()] == [8, 8]
    assert messages[0][:2] == [(0, None, None, None), (1, None, None, None)]  # both queued
    # at most one message per step, each token message with one new token of both requests:
    # 8, not 16 (the acceptances may travel alone, before the prompt step's tokens reach the
    # host with the next step)
    engine.stop(30)  # its count is then final (it is bumped after the write we read)
    with_tokens = [items for items in messages if any(ids for _, ids, *_ in items)]
    assert len(with_tokens) == 8 and engine.messages_sent == len(messages) <= 9
    assert len(messages) <= len(steps)
    for items in with_tokens:
        assert sorted((sid, len(ids)) for sid, ids, *_ in items if ids) == [(0, 1), (1, 1)]
    _clean(llm)


def test_the_front_ends_pipe_closing_cancels_everything():
    llm = make_llm(tokenizer=False)
    engine, commands, _updates = _engine_with_pipes(llm)
    os.write(commands.fileno(), _submit(0, [7, 8, 9], 200))
    engine.start()
    assert wait_for(lambda: llm.engine.cache.metrics()["num_used_blocks"] > 0)
    commands.close()  # the front end died
    engine.stop(0)  # only waits
    assert wait_for(lambda: not engine.alive)
    _clean(llm)


def test_a_front_end_that_dies_fails_its_requests_and_the_pool_ends_empty(server_for):
    server = server_for(make_llm(tokenizer=False))
    llm = server.llm
    got = []

    def client():
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=30) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError as exc:
            got.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    assert wait_for(lambda: any(str(g).startswith("data: {") for g in got))
    server.process.kill()
    thread.join(30)
    assert isinstance(got[-1], httpx.HTTPError)  # the connection went with the process
    assert wait_for(lambda: not server.engine.alive)  # every request cancelled
    _clean(llm)


class _FailsToUnpickle:
    def __reduce__(self):
        return operator.truediv, (1, 0)  # fine to pickle here, ZeroDivisionError there


def test_a_front_end_that_cannot_start_is_one_clear_error():
    llm = make_llm(tokenizer=False)
    llm.tokenizer = _FailsToUnpickle()
    with pytest.raises(RuntimeError, match="did not start: ZeroDivisionError: division by zero"):
        start_server(llm)
    llm.tokenizer = lambda text: text  # not picklable: refused before anything starts
    with pytest.raises(TypeError, match="tokenizer cannot be pickled"):
        start_server(llm)
    _clean(llm)
    assert not [t for t in threading.enumerate() if t.name == "flashdec-engine" and t.is_alive()]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_ctrl_c_on_flashdec_serve_drains_and_exits_zero_without_traceback():
    """A terminal's Ctrl-C (SIGINT to the whole process group) during a streamed request: it
    finishes, ``flashdec serve`` exits 0, nothing prints a traceback, the front end is gone."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "flashdec", "serve", "--model", "tiny", "--device", "cpu"]
    argv += ["--dtype", "float32", "--port", str(port), "--drain-timeout", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _status(url) == 200, timeout=120), proc.poll()
        children = _children(proc.pid)
        assert len(children) == 1  # the front end
        body = {**LONG, "max_tokens": 30, "return_token_ids": True}
        tokens = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if not tokens:
                        os.killpg(proc.pid, signal.SIGINT)
                    tokens += json.loads(line[6:])["choices"][0]["token_ids"]
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(tokens) == 30  # drained: it finished
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "serve: stopped" in out
    assert wait_for(lambda: not Path(f"/proc/{children[0]}").exists(), timeout=5)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None
