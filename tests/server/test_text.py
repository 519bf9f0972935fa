"""``IncrementalText``: streamed pieces add up to the output's text, characters split over
tokens wait until whole, and stop strings end the output before them, also when they span
tokens or could still be starting."""

from __future__ import annotations

import pytest

from flashdec.server.text import IncrementalText


class ByteTokenizer:
    """Token id = one UTF-8 byte (ids 256+ are special and decode to nothing)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _stream(text: str, stop=(), chunk: int = 1, prompt: str = "> ") -> tuple[list[str], object]:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    out = IncrementalText(tok, tok.encode(prompt), stop)
    pieces = [out.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(out.finish())
    return pieces, out


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_pieces_add_up_and_characters_stay_whole(chunk):
    text = "héllo wörld — 你好 🙂!"
    pieces, out = _stream(text, chunk=chunk)
    assert "".join(pieces) == text == out.text
    assert "\ufffd" not in "".join(pieces) and all("\ufffd" not in p for p in pieces)
    assert out.num_tokens == len(text.encode()) and not out.stopped


def test_special_tokens_decode_to_nothing():
    tok = ByteTokenizer()
    out = IncrementalText(tok, [], ())
    assert out.add([104, 300, 105]) + out.finish() == "hi"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello STOP world", ["STOP"], "hello "),
        ("hello world", ["xyz"], "hello world"),
        ("abcabd", ["abd"], "abc"),  # a false start of the stop string first
        ("one. two", [".", "two"], "one"),  # the earliest match wins
        ("STOP at once", ["STOP"], ""),
        ("ends with ST", ["STOP"], "ends with ST"),  # a partial match at the end is output
        ("café☕done", ["☕"], "café"),  # a multi-byte stop string
    ],
)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings(text, stop, expected, chunk):
    pieces, out = _stream(text, stop, chunk)
    assert "".join(pieces) == expected == out.text
    matched = any(s in text for s in stop)
    assert out.stopped == matched
    if matched:  # counted up to the token that completed the match
        first = min(text.find(s) + len(s) for s in stop if s in text)
        assert out.num_tokens <= len(text[:first].encode()) + chunk - 1


def test_text_that_may_start_a_stop_string_is_held_back():
    tok = ByteTokenizer()
    out = IncrementalText(tok, [], ["END"])
    assert out.add(tok.encode("abE")) == "ab"  # "E" may begin "END"
    assert out.add(tok.encode("N")) == ""
    assert out.add(tok.encode("x")) == "ENx"  # it did not
    assert out.add(tok.encode("END")) == "" and out.stopped
    assert out.add(tok.encode("more")) == "" and out.finish() == ""
    assert out.text == "abENx"
