"""scripts/gpu_ab.sh on the CPU: a stand-in benchmark that writes the JSON rows the real ones
write; the script must run it over the base tree and this tree and print their ratio."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_BENCH = textwrap.dedent(
    """
    import argparse, json, pathlib
    p = argparse.ArgumentParser()
    p.add_argument("--us", type=float)
    p.add_argument("--shapes", nargs="*")
    p.add_argument("--out-dir")
    p.add_argument("--name")
    a = p.parse_args()
    rows = [
        {"dtype": "bf16", "heads": "32/8/128", "page": 16, "shape": s, "fd_us": a.us * FACTOR,
         "fp8": {"fd_us": a.us * FACTOR / 2}}
        for s in a.shapes
    ]
    out = pathlib.Path(a.out_dir)
    (out / f"{a.name}.json").write_text(json.dumps({"rows": rows}))
    (out / f"{a.name}.md").write_text("# fake\\n")
    """
)


def test_the_script_times_both_trees_and_prints_their_ratio(tmp_path):
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_ab.sh", tree / "scripts")
    for root, factor in ((tree, 1.1), (tree / ".base", 1.0)):
        (root / "benchmarks").mkdir(parents=True)
        (root / "benchmarks" / "bench_fake.py").write_text(
            FAKE_BENCH.replace("FACTOR", str(factor))
        )
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", "scripts/gpu_ab.sh", "fake", "--us 10 --shapes 'B=1 L=32768' 'B=32 L=4096'"],
        cwd=tree,
        env={**os.environ, "OUT": str(out), "AB_BASE": ".base"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| 32/8/128 | 16 | B=1 L=32768 | 10.0 | 11.0 | 1.100 | 5.0 | 5.5 | 1.100 |" in run.stdout
    assert "bf16: head/base geomean 1.100" in run.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "fake_base.json",
        "fake_base.md",
        "fake_head.json",
        "fake_head.md",
    ]
