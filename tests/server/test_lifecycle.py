"""A server's lifecycle: a client that goes away cancels its request (waiting or running,
streamed or not) and its blocks go back; stopping drains or cancels what is in flight; a failed
engine step fails only the requests it was running, and the engine serves on; Ctrl-C and
SIGTERM end ``flashdec serve`` with exit status 0 after the requests in flight finish."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
from pathlib import Path

import pytest

from tests.server.conftest import make_llm, metric, wait_for

httpx = pytest.importorskip("httpx")

LONG = {"prompt": [7, 8, 9, 10], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
ABORTED = 'flashdec_requests_finished_total{finish_reason="abort"}'


def _metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def _metrics_when(server, name: str, value: float) -> str:
    """The metrics text once ``name`` reads ``value`` (bounded wait)."""

    def read():
        text = _metrics(server)
        return text if metric(text, name) == value else None

    text = wait_for(read)
    assert text is not None, f"{name} never reached {value}"
    return text


def _events(response):
    """The JSON payloads of a server-sent event stream (``[DONE]`` as the string)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def test_streaming_clients_that_go_away_cancel_their_requests(server_for):
    """One request runs (max_batch_size 1), one waits; the waiting one's client leaves, then
    the running one's: each is cancelled, the other unaffected, and every block comes back."""
    server = server_for(make_llm(max_batch_size=1))
    body = {**LONG, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=30) as a,
        httpx.Client(base_url=server.url, timeout=30) as b,
    ):
        with a.stream("POST", "/v1/completions", json=body) as running:
            events = _events(running)
            next(events)  # A runs
            with b.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # queued behind A
                assert wait_for(lambda: metric(_metrics(server), "flashdec_requests_waiting") == 1)
            # B left while waiting
            assert wait_for(lambda: metric(_metrics(server), ABORTED) == 1)
            for _ in range(3):  # A still streams
                assert "choices" in next(events)
        text = _metrics_when(server, ABORTED, 2)
    assert metric(text, "flashdec_kv_blocks_used") == 0
    assert metric(text, "flashdec_requests_running") == 0
    assert metric(text, "flashdec_generation_tokens_total") < 200  # A was cut short
    assert metric(text, "flashdec_requests_received_total") == 2


def test_a_plain_request_whose_client_goes_away_is_cancelled(server_for):
    server = server_for(make_llm())
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(LONG).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(request)
        assert wait_for(lambda: metric(_metrics(server), "flashdec_kv_blocks_used") > 0)
    text = _metrics_when(server, ABORTED, 1)
    assert metric(text, "flashdec_kv_blocks_used") == 0
    assert metric(text, "flashdec_generation_tokens_total") < 200


@pytest.mark.parametrize("drain", [True, False])
def test_stop_drains_or_cancels_requests_in_flight(server_for, drain):
    server = server_for(make_llm(), drain_timeout=30.0)
    body = {**LONG, "max_tokens": 40, "stream": True, "return_token_ids": True}
    started = threading.Event()
    got: list = []

    def client():
        with (
            httpx.Client(base_url=server.url, timeout=30) as c,
            c.stream("POST", "/v1/completions", json=body) as response,
        ):
            try:
                for event in _events(response):
                    got.append(event)
                    started.set()
            except httpx.HTTPError as exc:  # the connection closed under the stream
                got.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    assert started.wait(30)
    server.stop(drain=drain)
    thread.join(30)
    assert not thread.is_alive()
    tokens = [
        t
        for e in got
        if isinstance(e, dict) and "choices" in e
        for t in e["choices"][0]["token_ids"]
    ]
    if drain:  # it finished: every token, then [DONE]
        assert len(tokens) == 40 and got[-1] == "[DONE]"
    else:  # cut short with the 503 error event, or the connection closed
        assert len(tokens) < 40
        last = got[-2] if got[-1] == "[DONE]" else got[-1]
        assert isinstance(last, httpx.HTTPError) or last["error"]["code"] == "unavailable"
    # the fixture checks the LLM is clean: idle, no record left, every block back


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(server_for):
    llm = make_llm()
    server = server_for(llm)
    decode = llm._runner.decode
    armed = {"left": 0}

    def failing_decode(batch):
        if armed["left"] == 1:
            armed["left"] = 0
            raise RuntimeError("injected decode failure")
        armed["left"] = max(0, armed["left"] - 1)
        return decode(batch)

    llm._runner.decode = failing_decode
    with httpx.Client(base_url=server.url, timeout=30) as client:
        armed["left"] = 3
        response = client.post("/v1/completions", json=LONG)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and "injected decode failure" in error["message"]
        armed["left"] = 3
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as streamed:
            events = list(_events(streamed))
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        ok = client.post("/v1/completions", json={**LONG, "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        text = client.get("/metrics").text
    assert metric(text, 'flashdec_requests_finished_total{finish_reason="error"}') == 2
    assert metric(text, "flashdec_kv_blocks_used") == 0
    assert client is not None and server.engine.alive


@pytest.mark.parametrize(
    ("sig", "everyone"), [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)]
)
def test_signal_drains_and_exits_zero(sig, everyone, capsys):
    """``flashdec serve`` (the CLI's ``main``, on this process's main thread, where signals are
    delivered): a signal during a streamed request lets it finish, then ``main`` returns 0 —
    also when the front-end process gets the SIGTERM too (``everyone``: a service manager
    stopping every process of the service, or pkill)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    if everyone and not Path("/proc/self/task").is_dir():
        pytest.skip("finding the front-end process needs Linux's /proc")
    from flashdec import cli

    with socket.socket() as probe:  # a free port (the server binds it again at once)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    body = {**LONG, "max_tokens": 30, "stream": True, "return_token_ids": True}
    result: dict = {}

    def client():
        try:
            assert wait_for(lambda: _accepts(port), timeout=60)
            with (
                httpx.Client(base_url=url, timeout=30) as c,
                c.stream("POST", "/v1/completions", json=body) as response,
            ):
                events = _events(response)
                first = next(events)
                for pid in _frontend_pids() if everyone else ():
                    os.kill(pid, sig)
                os.kill(os.getpid(), sig)  # the server's handler is installed: it is serving
                result["events"] = [first, *events]
        except BaseException as exc:
            result["error"] = exc
            os.kill(os.getpid(), signal.SIGINT)  # never leave main() serving

    thread = threading.Thread(target=client)
    thread.start()
    argv = ["serve", "--model", "tiny", "--port", str(port), "--device", "cpu"]
    status = cli.main([*argv, "--dtype", "float32", "--drain-timeout", "30"])
    thread.join(30)
    assert "error" not in result, result.get("error")
    events = result["events"]
    tokens = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert len(tokens) == 30 and events[-1] == "[DONE]"  # drained: it finished
    assert status == 0 and "serve: stopped" in capsys.readouterr().out


def _frontend_pids() -> list[int]:
    """This process's front-end children (Linux: /proc's children lists)."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += map(int, (task / "children").read_text().split())
    frontends = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"flashdec.server.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                frontends.append(pid)
    assert frontends, "no front-end process found"
    return frontends


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
