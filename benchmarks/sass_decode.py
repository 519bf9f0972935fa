"""What the decode kernel compiles to on sm_90, without a GPU: registers, spills, shared memory and
the instructions of its inner (token-tile) loop, per plan variant.

Triton's compiler and the ptxas/cuobjdump bundled with its wheel need no device: each plan is
compiled for ``cuda:90`` with the constexprs and argument specialisation of a real launch
(``_decode_launches`` on meta tensors), and the SASS of the innermost loop that holds the MMAs
is counted. Instructions per KiB of K+V read (warps x loop instructions / tile KiB) is what an
issue-bound kernel pays per byte; a float cache's tile is the reference. For the FP8 kernel
variants (``DecodePlan.fp8_compute`` / ``fp8_staging``, ``plan_decode(fp8_tile=)``) on the shapes
of ``tune_decode.py --fp8``.

    python3 benchmarks/sass_decode.py                      # writes results/decode_fp8_sass.md
    python3 benchmarks/sass_decode.py --shapes B=16 --out-dir /tmp
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # compile for the GPU (read once, when triton is first imported)
    os.environ.pop("TRITON_INTERPRET", None)

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    fmt,
    markdown_table,
    write_results,
)
from benchmarks.bench_decode import FP8, parse_heads
from benchmarks.tune_decode import FP8_SHAPES, FP8_VARIANTS, shape_key, shape_matches
from flashdec.kernels import paged_decode as pd
from flashdec.kernels.decode_plan import plan_decode

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
if FP8 is not None:
    TRITON_TYPES[FP8] = "fp8e4nv"
# opcode families reported per loop (the rest is address arithmetic, softmax and control)
FAMILIES = {
    "conversions": ("F2FP", "F2F"),
    "byte loads": ("LDS.U8",),
    "ldmatrix": ("LDSM",),
    "mma": ("HMMA",),
    "moves": ("IMAD.MOV", "MOV", "PRMT"),
}
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def launch_arguments(plan, lens: list[int]):
    """``(tensors, scalars, constexprs)`` of the decode launch of ``plan`` over requests of
    ``lens`` (meta tensors: shapes and strides only)."""
    meta = torch.device("meta")
    b, hq, hkv, d = plan.batch, plan.num_q_heads, plan.num_kv_heads, plan.head_dim
    page = plan.block_size
    pages = sum(-(-n // page) for n in lens) + 1
    q = torch.empty(b, hq, d, dtype=plan.dtype, device=meta)
    k = torch.empty(pages, hkv, page, d, dtype=plan.cache_dtype, device=meta)
    tables = torch.empty(b, -(-max(lens) // page), dtype=torch.int32, device=meta)
    seq_lens = torch.empty(b, dtype=torch.int32, device=meta)
    shape = (b, hq, plan.num_splits)
    part_out = torch.empty(*shape, d, dtype=torch.float32, device=meta)
    part_lse = torch.empty(shape, dtype=torch.float32, device=meta)
    scale = torch.empty(hkv, dtype=torch.float32, device=meta)
    scales = (scale, scale) if plan.kv_dtype == FP8 else (None, None)
    # a fused-merge plan launches with its workspace's arrival counters (the in-kernel merge)
    counters = torch.empty(b, hkv, dtype=torch.int32, device=meta) if plan.fused_merge else None
    args, _, _ = pd._decode_launches(
        q,
        k,
        k.clone(),
        tables,
        seq_lens,
        d**-0.5,
        plan,
        q,
        part_out,
        part_lse,
        b,
        *scales,
        counters,
    )
    _, tensors, scalars, constexprs, _, _ = args
    return tensors, scalars, constexprs


def compile_plan(plan, lens: list[int]):
    """The kernel of ``plan`` compiled for sm_90 (:func:`compile_launch`)."""
    tensors, scalars, constexprs = launch_arguments(plan, lens)
    return compile_launch(
        pd._decode_kernel, tensors, scalars, constexprs, plan.num_warps, plan.num_stages
    )


def compile_launch(fn, tensors, scalars, constexprs, num_warps: int, num_stages: int):
    """A ``@triton.jit`` kernel compiled for sm_90 with the arguments of a launch (tensors may
    be meta tensors), specialised as Triton 3.6 would (pointers 16-byte aligned; ints equal to
    1 constant, others tagged when divisible by 16)."""
    signature, constants, attrs = {}, {}, {}
    values = [*tensors, *scalars, *constexprs]
    first_constexpr = len(tensors) + len(scalars)
    for i, (name, value) in enumerate(zip(fn.arg_names, values, strict=True)):
        if i >= first_constexpr or (isinstance(value, int) and value == 1):
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constants, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=TARGET, options=options)


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run(
            [str(BIN / "cuobjdump"), flag, f.name], capture_output=True, text=True, check=True
        ).stdout


def inner_loop(sass: str) -> list[str]:
    """Opcodes of the shortest loop (a backward branch and its target) that holds an MMA."""
    code = [(int(a, 16), op, rest) for a, op, rest in _INSTR.findall(sass)]
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            body = [o for a, o, _ in code if start <= a <= addr]
            if any(o.startswith("HMMA") for o in body):
                loops.append(body)
    return min(loops, key=len) if loops else []


def resources(kernel) -> tuple[int | None, int | None]:
    """Registers per thread and local-memory (spill) bytes of a compiled kernel."""
    usage = _cuobjdump(kernel, "-res-usage")
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return (int(regs.group(1)) if regs else None), (int(local.group(1)) if local else None)


def analyse(plan, lens: list[int]) -> dict[str, Any]:
    kernel = compile_plan(plan, lens)
    regs, spills = resources(kernel)
    loop = inner_loop(_cuobjdump(kernel, "-sass"))
    elem = 1 if plan.kv_dtype == FP8 else torch.empty((), dtype=plan.dtype).element_size()
    tile_kib = plan.block_n * plan.head_dim * 2 * elem / 1024
    counts = collections.Counter(loop)
    out = {
        "block_n": plan.block_n,
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
        "splits": plan.num_splits,
        "regs": regs,
        "spill_bytes": spills,
        "smem_kib": kernel.metadata.shared / 1024,
        "loop_instructions": len(loop),
        "warp_instructions_per_kib": len(loop) * plan.num_warps / tile_kib if loop else None,
    }
    for family, prefixes in FAMILIES.items():
        out[family] = sum(n for op, n in counts.items() if op.startswith(prefixes))
    return out


def variants(fp8: bool) -> list[tuple[str, dict[str, Any]]]:
    """(label, plan_decode overrides): the float cache, then the FP8 default and variants."""
    out: list[tuple[str, dict[str, Any]]] = [("bf16 KV", {})]
    if fp8:
        out.append(("fp8 default", {"kv_dtype": FP8}))
        for v in FP8_VARIANTS:
            label = f"fp8 {v['fp8_compute']}/{v['fp8_staging']}"
            label += "/bytes" if v["fp8_tile"] == "bytes" else ""
            out.append((label, {"kv_dtype": FP8, **v}))
    return out


COLUMNS = [
    "shape",
    "variant",
    "block_n",
    "warps",
    "stages",
    "regs",
    "spill B",
    "smem KiB",
    "loop instr",
    "warp instr / KiB",
    "conversions",
    "byte loads",
    "ldmatrix",
    "mma",
    "moves",
]


def render(payload: dict[str, Any]) -> str:
    rows = [
        [
            r["shape"],
            r["variant"],
            r.get("block_n"),
            r.get("num_warps"),
            r.get("num_stages"),
            r.get("regs"),
            r.get("spill_bytes"),
            fmt(r.get("smem_kib"), 0),
            r.get("loop_instructions"),
            fmt(r.get("warp_instructions_per_kib")),
            *(r.get(f) for f in FAMILIES),
            r.get("error", ""),
        ]
        for r in payload["rows"]
    ]
    return "\n".join(
        [
            "# Decode kernel on sm_90: what each FP8 variant compiles to (no GPU)",
            "",
            environment_markdown(payload["environment"]),
            "- method: each default plan (H200's 132 SMs, bf16 q, page "
            f"{payload['page']}) compiled by Triton for cuda:90, SASS by the bundled cuobjdump;"
            " 'loop': the innermost loop holding the MMAs (one tile of block_n tokens); 'warp "
            "instr / KiB': loop instructions x warps per KiB of K+V the tile reads (the issue "
            "cost of a byte; an SM issues 4 warp instructions per cycle and must take 16 bytes "
            "per cycle for the H200's copy bandwidth); families: conversions F2FP/F2F, byte "
            "loads LDS.U8, ldmatrix LDSM, mma HMMA, moves IMAD.MOV/MOV/PRMT",
            "- variants: `compute/staging[/bytes]` = DecodePlan.fp8_compute / fp8_staging "
            "(plan_decode(fp8_tile='bytes'): twice the tokens per tile)",
            "",
            markdown_table([*COLUMNS, "error"], rows),
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=None, help="as tune_decode.py --shapes")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--no-fp8", action="store_true", help="the float-cache kernel only")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="decode_fp8_sass")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for head, shape in FP8_SHAPES:
        if args.shapes and not any(shape_matches(x, head, shape) for x in args.shapes):
            continue
        hq, hkv, d = parse_heads(head)
        for label, overrides in variants(not args.no_fp8):
            row: dict[str, Any] = {"shape": shape_key(head, shape, args.page), "variant": label}
            try:
                plan = plan_decode(
                    shape.batch,
                    hq,
                    hkv,
                    d,
                    args.page,
                    shape.max_len,
                    torch.bfloat16,
                    "cpu",
                    total_tokens=shape.total_tokens,
                    **overrides,
                )
                if label == "fp8 default":
                    row["variant"] += f" ({plan.fp8_compute}/{plan.fp8_staging})"
                row.update(analyse(plan, list(shape.lens)))
            except Exception as exc:  # one variant that fails to compile is reported
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            print(row, flush=True)
    payload = {"environment": environment(), "page": args.page, "rows": rows}
    text = render(payload)
    write_results(args.name, text, payload, Path(args.out_dir))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
