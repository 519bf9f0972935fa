"""Split count x merge variant sweep of the paged decode kernel on the merge-bound shapes.

Long single requests over few KV heads (MQA, small KV) are cut into many splits, so the merge
of their partial outputs costs as much as reading the cache. For each shape this times, graph
-timed like bench_decode.py (``--calls`` calls per CUDA graph, replay median / calls, L2
flushed), every forced split count with three merges:

- ``fused``: the last split of each (request, KV head) merges in the same launch;
- ``launch``: a second launch, one program per (request, query head, 32 head dims);
- ``launch-1d``: a second launch, one program per (request, query head), 32 splits per step
  (the merge launch before the head dimension was cut).

    PYTHONPATH=. python3 benchmarks/tune_merge.py --name decode_merge
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    copy_ceiling_tbs,
    environment,
    environment_markdown,
    fmt,
    graph_us_per_call,
    markdown_table,
    write_results,
)
from benchmarks.bench_decode import Case, parse_heads

DEFAULT_HEADS = ("32/1/128", "28/4/128", "32/4/128", "12/2/128", "14/2/64", "32/8/128")
DEFAULT_SPLITS = (16, 32, 64, 128, 256)
MERGES = ("fused", "launch", "launch-1d")


def merge_variant(plan, merge: str):
    if merge == "fused":
        return dataclasses.replace(plan, fused_merge=True)
    if merge == "launch":
        return dataclasses.replace(plan, fused_merge=False)
    return dataclasses.replace(
        plan, fused_merge=False, merge_block_d=plan.block_d, merge_block_s=32
    )


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    copy_tbs = copy_ceiling_tbs()
    for head in args.heads:
        hq, hkv, d = parse_heads(head)
        case = Case([args.length] * args.batch, hq, hkv, d, args.page, torch.bfloat16)
        default = case.plan()
        expected = None
        specs = [(None, "default")] + [(n, m) for n in args.splits for m in MERGES]
        for splits, merge in specs:
            plan = default if splits is None else merge_variant(case.plan(num_splits=splits), merge)
            _, launch = case.flashdec_fns_for(plan)
            us = graph_us_per_call(launch, calls=args.calls)
            out = launch().float()
            expected = out.clone() if expected is None else expected
            merge_label = (
                merge if splits is not None else ("fused" if plan.fused_merge else "launch")
            )
            row = {
                "heads": head,
                "shape": f"B={args.batch} L={args.length}",
                "splits": plan.num_splits,
                "merge": merge_label,
                "default": splits is None,
                "us": us,
                "pct_copy": 100 * case.kv_bytes / (us * 1e-6) / 1e12 / copy_tbs,
                "max_diff_vs_default": (out - expected).abs().max().item(),
            }
            rows.append(row)
            print(
                f"{head:<10} splits={row['splits']:<4} {row['merge']:<10} "
                f"{'(default)' if row['default'] else '':<9} {us:7.1f} us "
                f"{row['pct_copy']:5.1f}% diff={row['max_diff_vs_default']:.4f}",
                flush=True,
            )
    return rows


def render(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    lines = [
        "# Decode split count x merge variant (merge-bound shapes)",
        "",
        environment_markdown(payload["environment"]),
        "- method: one decode (stage 1 + merge) per call, "
        f"{payload['calls']} calls per CUDA graph, median replay / calls (L2 flushed); "
        "'% copy' = KV bytes / time / measured copy bandwidth",
        "",
        "## Best per head config",
        "",
    ]
    best_rows = []
    for head in dict.fromkeys(r["heads"] for r in rows):
        mine = [r for r in rows if r["heads"] == head]
        default = next(r for r in mine if r["default"])
        best = min(mine, key=lambda r: r["us"])
        best_rows.append(
            [
                head,
                mine[0]["shape"],
                f"{default['splits']} {default['merge']}",
                fmt(default["us"]),
                fmt(default["pct_copy"]),
                f"{best['splits']} {best['merge']}",
                fmt(best["us"]),
                fmt(best["pct_copy"]),
            ]
        )
    lines.append(
        markdown_table(
            ["heads", "shape", "default", "us", "% copy", "best", "us", "% copy"], best_rows
        )
    )
    lines += ["", "## Every timing", ""]
    lines.append(
        markdown_table(
            ["heads", "splits", "merge", "default", "us", "% copy", "max |diff| vs default"],
            [
                [
                    r["heads"],
                    r["splits"],
                    r["merge"],
                    "yes" if r["default"] else "",
                    fmt(r["us"]),
                    fmt(r["pct_copy"]),
                    fmt(r["max_diff_vs_default"], 4),
                ]
                for r in rows
            ],
        )
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", default=list(DEFAULT_HEADS))
    p.add_argument("--splits", nargs="+", type=int, default=list(DEFAULT_SPLITS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="decode_merge")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_merge.py times CUDA graphs: it needs a CUDA device", file=sys.stderr)
        return 2
    payload = {
        "command": "python3 benchmarks/tune_merge.py " + " ".join(sys.argv[1:]),
        "environment": environment(),
        "calls": args.calls,
        "rows": sweep(args),
    }
    md, _ = write_results(args.name, render(payload), payload, args.out_dir)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
