"""benchmarks/bench_speculative.py --smoke: every (model, batch, mode) row runs, speculation keeps
greedy output token for token, and the report and its JSON come out."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_speculative
from flashdec.models import real_model_problem


def _run(tmp_path, *extra: str) -> tuple[list[dict], str]:
    bench_speculative.main(["--smoke", "--out-dir", str(tmp_path), *extra])
    payload = json.loads((tmp_path / "speculative.json").read_text())
    return payload["rows"], (tmp_path / "speculative.md").read_text()


def _check(rows: list[dict], markdown: str) -> None:
    assert all(r["identical_to_off"] for r in rows)
    assert {r["mode"] for r in rows} == {"off", "ngram"}
    for r in rows:
        assert r["tok_s"] > 0 and 1.0 <= r["tokens_per_step"] <= 5.0
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
        if r["mode"] == "off":
            assert r["draft_tokens"] == 0 and r["tokens_per_step"] == 1.0
    assert "Outputs that differ from plain greedy: none." in markdown
    assert "| vs off |" in markdown and "- commit:" in markdown


def test_smoke_on_the_tiny_shape(tmp_path):
    rows, markdown = _run(tmp_path, "--real-model", "tiny")
    modes = [(b, m) for b in (1, 2) for m in ("off", "ngram")]
    assert [(r["batch"], r["mode"]) for r in rows] == modes * 2
    _check(rows, markdown)


@pytest.mark.skipif(real_model_problem("smollm2") is not None, reason="smollm2 not installed")
def test_smoke_on_smollm2_grounded_prompts_accepts_drafts(tmp_path):
    rows, markdown = _run(tmp_path)
    chat = [r for r in rows if r["kind"] == "grounded chat"]
    assert [(r["model"], r["batch"], r["mode"]) for r in chat] == [
        ("smollm2", 1, "off"),
        ("smollm2", 1, "ngram"),
    ]
    assert chat[1]["accepted_tokens"] > 0  # the answer copies its input: lookups hit
    _check(rows, markdown)
