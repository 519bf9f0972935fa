"""The decode step's GEMMs alone (issue 25): each projection and MLP shape of a model, at the row
counts of decode steps (M = 1, 8, 64 by default), against the device's copy bandwidth.

At small M a GEMM reads its weight once and does little else, so its time is bounded below by
the weight's bytes over the memory bandwidth; this says, per shape, how close cuBLAS (through
``torch.nn.functional.linear``, exactly as the decoder calls it, with the fused q/k/v and
gate/up weights FlashDec uses on a GPU) comes to that bound, and which shapes are worth a
split-K GEMV or a fused prologue/epilogue.

Method (GPU): per (shape, M), ``--copies`` distinct weights (together several times the L2, so
no call finds its weight cached) are called back to back inside one CUDA graph; the median replay
time (``triton.testing.do_bench``, L2 flushed before each replay) over the number of calls is
one call's device time. Bytes moved: the weight, the input and the output. Achieved TB/s is
reported against the measured copy bandwidth (read + write, ``copy_ceiling_tbs``) and the
read-only bandwidth (a large reduction, ``read_ceiling_tbs``). The model rows sum the shapes over
every layer plus the LM head at each M: the GEMM part of one decode step.

    PYTHONPATH=. python3 benchmarks/bench_gemm.py                  # on the GPU machine
    PYTHONPATH=. python3 benchmarks/bench_gemm.py --smoke          # the script itself, on a CPU

Writes gemm.md, gemm.json and gemm.png (per-shape share of the copy bandwidth).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    bench_us,
    copy_ceiling_tbs,
    cuda_graph_of_calls,
    environment,
    environment_markdown,
    markdown_table,
    read_ceiling_tbs,
    write_results,
)

# below this share of the copy bandwidth, issue 25 says to try a Triton split-K GEMV or fusion
GEMV_BAR = 0.85
L2_MULTIPLE = 4  # the weights of one graph span at least this many L2 caches


@dataclass(frozen=True)
class GemmShape:
    """One ``F.linear(x [M, in_features], weight [out_features, in_features])`` of the step."""

    name: str
    out_features: int
    in_features: int
    per_step: int  # how many times one decode step runs it (layers, or 1 for the LM head)


# Qwen2-7B's projections (28/4/128 heads, hidden 3584, MLP 18944): shapes no issue lists
QWEN2_7B = [
    GemmShape("qwen2-7b qkv", 4608, 3584, 28),
    GemmShape("qwen2-7b o", 3584, 3584, 28),
    GemmShape("qwen2-7b down", 3584, 18944, 28),
]


QWEN = {shape.name for shape in QWEN2_7B}


def sweep_configs():
    from flashdec.kernels.gemv import GemvConfig

    # register caps: 64 per thread lets 8 four-warp programs share an SM (66, the compiler's
    # choice for 4 x 1,024, lets 7): o and down's 1,024 programs then fit one wave on 132 SMs
    return [
        GemvConfig(block_n, block_k, split_k, warps, registers)
        for block_n in (2, 4, 8)
        for block_k in (512, 1024)
        for split_k in (1, 2)
        for warps in ((4, 8) if block_k == 1024 else (4,))
        for registers in (None, 64, 56)
    ]


def model_shapes(config) -> list[GemmShape]:
    """The GEMMs of one decode step of a Llama-like ``config`` (q/k/v and gate/up fused, as the
    decoder runs them on a GPU)."""
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layers = config.num_hidden_layers
    inter = config.intermediate_size
    return [
        GemmShape("qkv", (heads + 2 * kv_heads) * head_dim, hidden, layers),
        GemmShape("o", hidden, heads * head_dim, layers),
        GemmShape("gate_up", 2 * inter, hidden, layers),
        GemmShape("down", hidden, inter, layers),
        GemmShape("lm_head", config.vocab_size, hidden, 1),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b-shape", help="a built-in shape (its config)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="rows M per GEMM")
    p.add_argument("--copies", type=int, default=None, help="weights per graph (default: auto)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument(
        "--gemv",
        action="store_true",
        help="also time FlashDec's GEMV (flashdec.kernels.gemv) at every M it takes: its "
        "default launch, and at M = 1 a sweep of launches (--sweep)",
    )
    p.add_argument("--sweep", action="store_true", help="with --gemv: the launch sweep at M = 1")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="gemm")
    p.add_argument("--smoke", action="store_true", help="tiny shape, wall clock (CPU check)")
    args = p.parse_args(argv)
    for m in args.batch:
        if m < 1:
            p.error(f"--batch values must be >= 1, got {m}")
    if args.copies is not None and args.copies < 1:
        p.error(f"--copies must be >= 1, got {args.copies}")
    if args.smoke:
        args.model, args.batch = "tiny", args.batch[:2]
    return args


def _copies(shape: GemmShape, itemsize: int, requested: int | None) -> int:
    if requested is not None:
        return requested
    l2 = 50 * 2**20  # H100/H200; a larger figure only means more copies
    if torch.cuda.is_available():
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", l2) or l2
    weight = shape.out_features * shape.in_features * itemsize
    return max(2, min(64, -(-L2_MULTIPLE * l2 // weight)))


def time_gemm(
    shape: GemmShape,
    m: int,
    dtype: torch.dtype,
    device: str,
    copies: int,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    **bench: float,
) -> float:
    """Microseconds of one ``linear`` (default ``F.linear``) of ``shape`` at ``m`` rows (see
    the module doc); ``bench``: do_bench's warmup_ms / rep_ms."""
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [
        torch.randn(shape.out_features, shape.in_features, generator=gen, device=device).to(dtype)
        for _ in range(copies)
    ]
    x = torch.randn(m, shape.in_features, generator=gen, device=device).to(dtype)

    def calls() -> None:
        for w in weights:
            linear(x, w)

    if device == "cuda":
        graph = cuda_graph_of_calls(calls, 1)
        try:
            return bench_us(graph.replay, **bench) / copies
        finally:
            del graph
    calls()  # warm-up; then the median of a few wall-clock rounds
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        calls()
        rounds.append((time.perf_counter() - start) * 1e6 / copies)
    return statistics.median(rounds)


def measure(args) -> tuple[list[dict], dict]:
    from flashdec.models.shapes import BUILTIN_SHAPES

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    config = BUILTIN_SHAPES[args.model].make_config()
    shapes = model_shapes(config)
    ceilings = {"copy_tbs": None, "read_tbs": None}
    if device == "cuda":
        ceilings = {"copy_tbs": copy_ceiling_tbs(), "read_tbs": read_ceiling_tbs()}
    rows = []
    for shape in shapes:
        copies = _copies(shape, itemsize, args.copies)
        for m in args.batch:
            us = time_gemm(shape, m, dtype, device, copies)
            nbytes = itemsize * (
                shape.out_features * shape.in_features
                + m * (shape.in_features + shape.out_features)
            )
            tbs = nbytes / (us * 1e-6) / 1e12
            rows.append(
                {
                    **asdict(shape),
                    "m": m,
                    "copies": copies,
                    "us": us,
                    "bytes": nbytes,
                    "tbs": tbs,
                    "of_copy": tbs / ceilings["copy_tbs"] if ceilings["copy_tbs"] else None,
                    "of_read": tbs / ceilings["read_tbs"] if ceilings["read_tbs"] else None,
                }
            )
            print({k: v for k, v in rows[-1].items() if k != "bytes"}, flush=True)
    return rows, {"device": device, "dtype": str(dtype).removeprefix("torch."), **ceilings}


def measure_gemv(args, rows: list[dict], measured: dict) -> list[dict]:
    """FlashDec's GEMV beside each cuBLAS row it could replace (M <= its MAX_ROWS), plus
    Qwen2-7B's shapes: the default launch, and at M = 1 with ``--sweep`` the best of
    :func:`sweep_configs`. ``used``: whether the decoder takes it (``gemv_wins``)."""
    from flashdec.kernels.gemv import MAX_ROWS, gemv, gemv_wins

    device, dtype = measured["device"], getattr(torch, measured["dtype"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    copy = measured["copy_tbs"]
    cublas = {(r["name"], r["m"]): r["us"] for r in rows}
    shapes = {
        r["name"]: GemmShape(r["name"], r["out_features"], r["in_features"], r["per_step"])
        for r in rows
    }
    for extra in QWEN2_7B if device == "cuda" else []:  # too large for the interpreter
        shapes.setdefault(extra.name, extra)
    quick = {"warmup_ms": 5, "rep_ms": 20}
    out = []
    for shape in shapes.values():
        copies = _copies(shape, itemsize, args.copies)
        weight = torch.empty(shape.out_features, shape.in_features, dtype=dtype, device=device)
        for m in [m for m in args.batch if m <= MAX_ROWS]:
            if (shape.name, m) not in cublas:
                cublas[shape.name, m] = time_gemm(shape, m, dtype, device, copies)
            default_us = time_gemm(shape, m, dtype, device, copies, gemv)
            best_us, best = default_us, "default"
            used = gemv_wins(m, weight) if weight.is_cuda else False
            swept = []
            if args.sweep and m == 1 and device == "cuda" and (used or shape.name in QWEN):
                for cfg in sweep_configs():
                    us = time_gemm(
                        shape,
                        m,
                        dtype,
                        device,
                        copies,
                        functools.partial(gemv, config=cfg),
                        **quick,
                    )
                    swept.append({**asdict(cfg), "us": us})
                    if us < best_us:
                        best_us, best = us, cfg
            nbytes = itemsize * (
                shape.out_features * shape.in_features
                + m * (shape.in_features + shape.out_features)
            )
            row = {
                "name": shape.name,
                "m": m,
                "cublas_us": cublas[shape.name, m],
                "gemv_us": default_us,
                "best_us": best_us,
                "best_config": best if best == "default" else asdict(best),
                "gemv_of_copy": nbytes / (default_us * 1e-6) / 1e12 / copy if copy else None,
                "best_of_copy": nbytes / (best_us * 1e-6) / 1e12 / copy if copy else None,
                "used": used,
                "sweep": swept,
            }
            out.append(row)
            print({k: v for k, v in row.items() if k != "sweep"}, flush=True)
        del weight
    return out


def gemv_table(gemv_rows: list[dict]) -> str:
    body = [
        [
            r["name"],
            r["m"],
            f"{r['cublas_us']:.1f}",
            f"{r['gemv_us']:.1f}",
            _share(r["gemv_of_copy"]),
            f"{r['gemv_us'] / r['cublas_us']:.2f}x",
            f"{r['best_us']:.1f}",
            _share(r["best_of_copy"]),
            "default"
            if r["best_config"] == "default"
            else "{block_n}/{block_k}/{split_k}/{num_warps}".format(**r["best_config"])
            + _registers(r["best_config"]),
            "yes" if r["used"] else "",
        ]
        for r in gemv_rows
    ]
    return markdown_table(
        [
            "GEMM",
            "M",
            "cuBLAS us",
            "GEMV us",
            "of copy",
            "GEMV / cuBLAS",
            "best us",
            "best of copy",
            "best launch (n/k/split/warps[/registers])",
            "decoder uses it",
        ],
        body,
    )


def step_totals(rows: list[dict]) -> list[dict]:
    """Per M: the GEMM time and bytes of one decode step (each shape times its count)."""
    totals = []
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]
        us = sum(r["us"] * r["per_step"] for r in at)
        nbytes = sum(r["bytes"] * r["per_step"] for r in at)
        totals.append({"m": m, "us": us, "bytes": nbytes, "tbs": nbytes / (us * 1e-6) / 1e12})
    return totals


def _registers(config: dict) -> str:
    """A swept launch's register cap, as ``/r64`` (nothing without one)."""
    cap = config.get("max_registers")
    return "" if cap is None else f"/r{cap}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def report(
    args,
    rows: list[dict],
    totals: list[dict],
    env: dict,
    measured: dict,
    gemv_rows: list[dict] | None = None,
) -> str:
    copy = measured["copy_tbs"]
    table = [
        [
            r["name"],
            f"{r['out_features']} x {r['in_features']}",
            r["m"],
            f"{r['us']:.1f}",
            f"{r['bytes'] / 2**20:.1f}",
            f"{r['tbs']:.2f}",
            _share(r["of_copy"]),
            _share(r["of_read"]),
            "yes" if r["of_copy"] is not None and r["of_copy"] < GEMV_BAR else "",
        ]
        for r in rows
    ]
    step = [
        [
            t["m"],
            f"{t['us'] / 1e3:.3f}",
            f"{t['bytes'] / 2**30:.2f}",
            f"{t['tbs']:.2f}",
            _share(t["tbs"] / copy if copy else None),
            f"{t['bytes'] / (copy * 1e12) * 1e3:.3f}" if copy else "—",
        ]
        for t in totals
    ]
    ceilings = (
        f"copy {copy:.2f} TB/s (read + write), read {measured['read_tbs']:.2f} TB/s"
        if copy
        else "not measured (no GPU: wall clock on the CPU, a check of the script only)"
    )
    return "\n".join(
        [
            f"# The decode step's GEMMs ({args.model}, {measured['dtype']})",
            "",
            environment_markdown(env),
            f"- bandwidth ceilings: {ceilings}",
            "- each row: `F.linear(x [M, in], weight [out, in])`, the median over CUDA-graph "
            "replays of `copies` calls on distinct weights (L2 flushed per replay), per call",
            "",
            "## Per shape",
            "",
            markdown_table(
                [
                    "GEMM",
                    "weight (out x in)",
                    "M",
                    "us",
                    "MiB moved",
                    "TB/s",
                    "of copy",
                    "of read",
                    f"< {100 * GEMV_BAR:.0f}% of copy",
                ],
                table,
            ),
            "",
            "## One decode step's GEMMs (every layer and the LM head)",
            "",
            markdown_table(
                ["M", "ms", "GiB moved", "TB/s", "of copy", "copy-bound floor (ms)"], step
            ),
            "",
            *(
                [
                    "## FlashDec's GEMV (flashdec.kernels.gemv) against cuBLAS",
                    "",
                    "Same method per row. `GEMV us`: its default launch (what the decoder "
                    "runs); `best`: the fastest of the launch sweep at M = 1 (`--sweep`; "
                    "do_bench 5/20 ms per launch). `decoder uses it`: `gemv_wins` takes this "
                    "weight at this M.",
                    "",
                    gemv_table(gemv_rows),
                    "",
                ]
                if gemv_rows
                else []
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, measured = measure(args)
    totals = step_totals(rows)
    gemv_rows = measure_gemv(args, rows, measured) if args.gemv else None
    env = environment()
    markdown = report(args, rows, totals, env, measured, gemv_rows)
    payload = {"environment": env, "args": vars(args), "ceilings": measured, "rows": rows}
    payload["step_totals"] = totals
    payload["gemv_rows"] = gemv_rows
    md, _ = write_results(args.name, markdown, payload, args.out_dir)
    labels = [f"{r['name']} M={r['m']}" for r in rows]
    if measured["copy_tbs"]:
        bar_plot(
            Path(args.out_dir) / f"{args.name}.png",
            labels,
            {"share of copy bandwidth": [r["of_copy"] for r in rows]},
            "achieved / copy bandwidth",
            f"{args.model} GEMMs (cuBLAS via F.linear)",
            hline=GEMV_BAR,
        )
    print(markdown)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
