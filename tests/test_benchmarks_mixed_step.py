"""benchmarks/bench_mixed_step.py on the tiny model (CPU): every (decode rows, chunk) pair runs
one mixed step that carries the whole chunk, and the report comes out."""

from __future__ import annotations

import json

from benchmarks import bench_mixed_step


def test_smoke_run_times_every_mixed_step(tmp_path):
    bench_mixed_step.main(["--smoke", "--out-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "mixed_step.json").read_text())
    rows = payload["rows"]
    assert [(r["decode_rows"], r["chunk_tokens"]) for r in rows] == [
        (1, 8),
        (1, 24),
        (3, 8),
        (3, 24),
    ]
    assert all(r["wall_ms"] > 0 and r["decode_wall_ms"] > 0 for r in rows)
    markdown = (tmp_path / "mixed_step.md").read_text()
    assert "| D | chunk tokens | wall ms | GPU busy ms |" in markdown
