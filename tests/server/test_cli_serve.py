"""``flashdec serve`` on the command line: its help, and exit status 2 with one error line before
the model loads for a bad knob, a port in use, or a missing HTTP stack."""

from __future__ import annotations

import socket
import sys

import pytest

from flashdec import cli


def _fails(argv, capsys, words: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdec: error:") and "\n" not in err and words in err, err


def test_help_names_the_knobs(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--model", "--max-batch-size", "--drain-timeout"):
        assert flag in out
    assert "127.0.0.1" in out and "8000" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "70000"], "port must be <= 65535"),
        (["--port", "-1"], "port must be >= 0"),
        (["--host", ""], "host must not be empty"),
        (["--default-max-tokens", "0"], "default_max_tokens"),
        (["--model", "/no/such/dir"], "/no/such/dir"),
    ],
)
def test_bad_knobs(argv, words, capsys):
    _fails(["serve", *argv], capsys, words)


def test_a_port_in_use(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _fails(["serve", "--port", str(port)], capsys, "serve:")


def test_without_fastapi(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    _fails(["serve", "--port", "0"], capsys, "needs FastAPI and uvicorn")
