"""What the extend kernel compiles to on sm_90, without a GPU: registers, spills and shared
memory of every default plan of ``bench_extend.py``'s matrix and of the variants the tests run
on the GPU (head_dim 64/256, MQA, FP8 KV, windows, dim-major caches, fp16/fp32, forced splits).

Each plan's launch is built on meta tensors (``extend_launch_arguments``) and compiled by
Triton for ``cuda:90`` with the specialisation of a real launch (``sass_decode.compile_launch``);
resources come from the bundled cuobjdump. A kernel that does not compile, or needs more shared
memory than an H200 block may have (227 KiB), fails here before any GPU time is spent.
``--sweep`` compiles every configuration of ``bench_extend.py --sweep`` too.

    python3 benchmarks/compile_extend.py                 # writes results/extend_compile.md
    python3 benchmarks/compile_extend.py --sweep --out-dir /tmp
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # compile for the GPU (read once, when triton is first imported)
    os.environ.pop("TRITON_INTERPRET", None)

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    fmt,
    markdown_table,
    write_results,
)
from benchmarks.bench_extend import (
    DTYPES,
    SWEEP_SHAPES,
    ExtendShape,
    _overrides,
    all_shapes,
    config_label,
    parse_heads,
    sweep_configs,
)
from benchmarks.bench_extend import parse_args as bench_args
from benchmarks.sass_decode import compile_launch, resources
from flashdec.kernels import paged_extend as pe
from flashdec.kernels.extend_plan import plan_extend

FP8 = torch.float8_e4m3fn
MAX_SHARED = 227 * 1024  # an H200 block's dynamic shared memory limit
# (label, heads, shape, plan_extend keywords, dtype, kv_layout): what the GPU tests run beyond
# the benchmark's defaults
VARIANTS = [
    ("head_dim 256", "16/8/256", ExtendShape("chunk", 2, 512, 1000), {}, torch.bfloat16, None),
    ("head_dim 256", "16/8/256", ExtendShape("verify", 4, 4, 4096), {}, torch.bfloat16, None),
    ("head_dim 64", "8/8/64", ExtendShape("chunk", 2, 512, 1000), {}, torch.float16, None),
    ("MQA", "32/1/128", ExtendShape("verify", 4, 8, 9000), {}, torch.float16, None),
    ("MQA block_m 16", "32/1/128", ExtendShape("verify", 4, 8, 9000), {"block_m": 16}, None, None),
    ("fp8", "32/8/128", ExtendShape("chunk", 3, 512, 3000), {"kv_dtype": FP8}, None, None),
    ("fp8", "32/8/128", ExtendShape("verify", 1, 4, 32768), {"kv_dtype": FP8}, None, None),
    ("window", "32/8/128", ExtendShape("chunk", 3, 200, 3000), {"window": 100}, None, None),
    ("window", "32/8/128", ExtendShape("verify", 1, 4, 32768), {"window": 1000}, None, None),
    ("dim_major", "32/8/128", ExtendShape("chunk", 3, 200, 3000), {}, None, "dim_major"),
    ("forced split", "28/4/128", ExtendShape("chunk", 3, 512, 3000), {"num_splits": 7}, None, None),
    ("fp32", "8/2/128", ExtendShape("chunk", 2, 100, 2000), {}, torch.float32, None),
]


def launch_arguments(plan, shape: ExtendShape, kv_layout: str = "token_major"):
    """``(tensors, scalars, constexprs)`` of ``plan``'s launch over ``shape`` (meta tensors)."""
    meta = torch.device("meta")
    b, hq, hkv, d, page = (
        shape.batch,
        plan.num_q_heads,
        plan.num_kv_heads,
        plan.head_dim,
        plan.block_size,
    )
    per_request = -(-shape.seq_len // page)
    q = torch.empty(shape.total_q, hq, d, dtype=plan.dtype, device=meta)
    cache_shape = (b * per_request + 1, hkv, page, d)
    if kv_layout == "dim_major":
        cache_shape = (b * per_request + 1, hkv, d, page)
    k = torch.empty(cache_shape, dtype=plan.cache_dtype, device=meta)
    tables = torch.empty(b, per_request, dtype=torch.int32, device=meta)
    lens = torch.empty(b, dtype=torch.int32, device=meta)
    tiles, splits, rows = plan.max_tiles, plan.num_splits, plan.block_m
    part_out = torch.empty(tiles, hkv, splits, rows, d, dtype=torch.float32, device=meta)
    part_lse = torch.empty(tiles, hkv, splits, rows, dtype=torch.float32, device=meta)
    counters = torch.empty(tiles, hkv, dtype=torch.int32, device=meta)
    scale = torch.empty(hkv, dtype=torch.float32, device=meta)
    scales = (scale, scale) if plan.cache_dtype == FP8 else (None, None)
    args = pe.extend_launch_arguments(
        q, k, k, tables, lens, lens, d**-0.5, plan, q, part_out, part_lse, counters, b, *scales
    )
    _, tensors, scalars, constexprs, _, _ = args
    return tensors, scalars, constexprs


def planned(heads: str, shape: ExtendShape, dtype, page: int, kv_layout: str, **overrides):
    hq, hkv, d = parse_heads(heads)
    return plan_extend(
        shape.batch,
        shape.total_q,
        hq,
        hkv,
        d,
        page,
        shape.seq_len,
        dtype,
        "cpu",
        kv_layout,
        max_query_len=shape.query_len,
        **overrides,
    )


_COMPILED: dict[tuple, dict[str, Any]] = {}


def analyse(plan, shape: ExtendShape, kv_layout: str) -> dict[str, Any]:
    """Resources of ``plan``'s kernel (kernels with the same specialisation compile once)."""
    tensors, scalars, constexprs = launch_arguments(plan, shape, kv_layout)
    key = (
        tuple(t.dtype for t in tensors),
        tuple(s if s == 1 or isinstance(s, float) else s % 16 == 0 for s in scalars),
        constexprs,
        plan.num_warps,
        plan.num_stages,
    )
    if key not in _COMPILED:
        start = time.time()
        kernel = compile_launch(
            pe._extend_kernel, tensors, scalars, constexprs, plan.num_warps, plan.num_stages
        )
        regs, spills = resources(kernel)
        _COMPILED[key] = {
            "regs": regs,
            "spill_bytes": spills,
            "smem_kib": kernel.metadata.shared / 1024,
            "fits": kernel.metadata.shared <= MAX_SHARED,
            "compile_s": time.time() - start,
        }
    return {
        "block_m": plan.block_m,
        "block_n": plan.block_n,
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
        "splits": plan.num_splits,
        **_COMPILED[key],
    }


def cases(args) -> list[tuple[str, str, ExtendShape, dict[str, Any], torch.dtype, str]]:
    bench = bench_args(["--sweep"] if args.sweep else [])
    out = []
    dtype = DTYPES["bf16"]
    for heads in bench.heads:
        for shape in all_shapes():
            out.append(("default", heads, shape, {}, dtype, "token_major"))
    for label, heads, shape, overrides, vdtype, layout in VARIANTS:
        out.append((label, heads, shape, overrides, vdtype or dtype, layout or "token_major"))
    if args.sweep:
        labels = {s for kind in SWEEP_SHAPES.values() for s in kind}
        for heads in bench.heads:
            for shape in [s for s in all_shapes() if s.label in labels]:
                for config in sweep_configs(bench):
                    label = config_label(config)
                    out.append((label, heads, shape, _overrides(config), dtype, "token_major"))
    return out


COLUMNS = ["variant", "heads", "dtype", "shape", "M", "N", "warps", "stages", "splits"]
COLUMNS += ["regs", "spill B", "smem KiB", "fits", "error"]


def render(payload: dict[str, Any]) -> str:
    rows = [
        [
            r["variant"],
            r["heads"],
            r["dtype"],
            r["shape"],
            r.get("block_m"),
            r.get("block_n"),
            r.get("num_warps"),
            r.get("num_stages"),
            r.get("splits"),
            r.get("regs"),
            r.get("spill_bytes"),
            fmt(r.get("smem_kib"), 0),
            {True: "yes", False: "**NO**", None: "—"}[r.get("fits")],
            r.get("error", ""),
        ]
        for r in payload["rows"]
    ]
    bad = [r for r in payload["rows"] if r.get("error") or r.get("fits") is False]
    spilling = [r for r in payload["rows"] if r.get("spill_bytes")]
    return "\n".join(
        [
            "# Extend kernel on sm_90: what each plan compiles to (no GPU)",
            "",
            environment_markdown(payload["environment"]),
            "- method: each plan (H200's 132 SMs, page 16) compiled by Triton for cuda:90 with a "
            "real launch's specialisation; registers and spills by the bundled cuobjdump; "
            f"'fits': shared memory <= {MAX_SHARED // 1024} KiB",
            f"- {len(payload['rows'])} plans, {payload['kernels']} distinct kernels; "
            f"{len(bad)} fail to compile or do not fit; {len(spilling)} spill",
            "",
            markdown_table(COLUMNS, rows),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also every sweep configuration")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="extend_compile")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for label, heads, shape, overrides, dtype, layout in cases(args):
        row: dict[str, Any] = {
            "variant": label + ("" if layout == "token_major" else f" ({layout})"),
            "heads": heads,
            "dtype": str(dtype).replace("torch.", ""),
            "shape": shape.label,
        }
        try:
            plan = planned(heads, shape, dtype, args.page, layout, **overrides)
            row.update(analyse(plan, shape, layout))
        except Exception as exc:  # one plan that fails to compile is reported
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(row, flush=True)
    payload = {"environment": environment(), "kernels": len(_COMPILED), "rows": rows}
    text = render(payload)
    write_results(args.name, text, payload, Path(args.out_dir))
    print(text.split("\n\n|")[0])
    return 1 if any(r.get("error") or r.get("fits") is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
