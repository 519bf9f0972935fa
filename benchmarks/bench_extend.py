"""Paged extend attention, graph-timed: FlashDec's ``extend`` against FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` at its best path.

The review method (issue 20; shared GPU notes, "How kernel ratios are judged"):

- both sides are captured in a CUDA graph, several calls per graph (``--calls``, fewer for long
  calls so that a graph replays in about ``--graph-us``); a call's time is the median replay time
  (``triton.testing.do_bench``, L2 flushed before each replay) / calls;
- FlashDec runs through its planned path: ``plan_extend`` once, ``extend(..., workspace=ws)``;
- FlashInfer (0.6.15.post1) runs causal paged prefill on each of its paths — HND/NHD layouts x
  the ``fa2``/``fa3`` backends, each in its CUDA-graph mode (fixed index buffers) — and the
  fastest counts (the winner is recorded). HND reads FlashDec's own K/V tensors (``[pages,
  Hkv, page, D]``: the same memory); NHD a ``[pages, page, Hkv, D]`` copy of the same values;
- random data, random page ids, both sides in one process; ratio = FlashDec / FlashInfer best.

The matrix (issue 20), bf16, page 16, Llama-3-8B (32/8/128) and Qwen2-7B (28/4/128) heads:

- ``chunk``: prompt chunks of 512 and 2,048 tokens over cached contexts of 0, 4k and 32k tokens,
  B = 1, 4, 16;
- ``verify``: speculative verification, n = 2, 4, 8 new tokens over contexts of 4k and 32k,
  B = 1, 8, 64.

Reported per shape: microseconds, TFLOP/s (causal: 4 * Hq * D per (query, attended key)), TB/s
(K/V read once plus q and the output), the ratio, and per class the geometric mean and the worst.
Targets: geomean <= 1.00x, worst <= 1.15x. Without FlashInfer the benchmark runs FlashDec alone
and says so.

``--sweep`` (FlashDec only) times a grid of launch configurations (``block_m``, ``block_n``,
``num_warps``, ``num_stages``; ``--sweep-splits``) on a few shapes per class and reports the best
per shape and, per class, the configuration with the best geometric mean relative to each shape's
best — the numbers to set ``extend_plan``'s defaults from, in one GPU run.

    PYTHONPATH=. python3 benchmarks/bench_extend.py                        # the issue's matrix
    PYTHONPATH=. python3 benchmarks/bench_extend.py --quick                # every class, fewer B
    PYTHONPATH=. python3 benchmarks/bench_extend.py --kinds verify --heads 28/4/128
    PYTHONPATH=. python3 benchmarks/bench_extend.py --sweep                # tile sweep
    python3 benchmarks/bench_extend.py --from-json benchmarks/results/extend.json  # re-render

Writes ``<name>.md``, ``.json`` and ``.png`` (default ``benchmarks/results/extend``; with
``--sweep``, ``extend_sweep``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    copy_ceiling_tbs,
    environment,
    environment_markdown,
    fmt,
    geomean,
    graph_us_per_call,
    markdown_table,
    run_in_workers,
    write_results,
)
from benchmarks.bench_decode import load_flashinfer, output_error, parse_heads, short_error
from flashdec.kernels import extend, plan_extend

FORMAT = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_CONFIGS = {"32/8/128": "Llama-3-8B", "28/4/128": "Qwen2-7B"}
KINDS = ("chunk", "verify")
FI_LAYOUTS = ("HND", "NHD")
FI_BACKENDS = ("fa2", "fa3")
TARGET_GEOMEAN = 1.0
TARGET_WORST = 1.15
FI_WORKSPACE_BYTES = 512 * 2**20
DEVICE = "cuda"  # where cases are built (the CPU tests run the interpreter)

# (batches, query lengths, contexts) per class: the matrix and the --quick subset
MATRIX = {
    "chunk": ((1, 4, 16), (512, 2048), (0, 4096, 32768)),
    "verify": ((1, 8, 64), (2, 4, 8), (4096, 32768)),
}
QUICK = {
    "chunk": ((1, 16), (512, 2048), (0, 32768)),
    "verify": ((1, 64), (2, 8), (4096, 32768)),
}
# --sweep: a few shapes per class that stand for it (labels as ExtendShape.label writes them)
SWEEP_SHAPES = {
    "chunk": ("chunk B=1 n=2048 ctx=4096", "chunk B=4 n=2048 ctx=32768"),
    "verify": ("verify B=1 n=4 ctx=32768", "verify B=64 n=8 ctx=4096"),
}
SWEEP_GRID = {
    "block_m": (None, 64),  # None: the plan's choice (chunk: 128; verify: the request's rows)
    "block_n": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
}


# ---------------------------------------------------------------------------------------------
# the matrix (pure Python: tested on the CPU)


@dataclass(frozen=True)
class ExtendShape:
    """A uniform batch: ``batch`` requests, each with ``query_len`` new tokens after
    ``context`` cached ones."""

    kind: str
    batch: int
    query_len: int
    context: int

    @property
    def label(self) -> str:
        return f"{self.kind} B={self.batch} n={self.query_len} ctx={self.context}"

    @property
    def seq_len(self) -> int:
        return self.context + self.query_len

    @property
    def total_q(self) -> int:
        return self.batch * self.query_len

    def attended(self) -> int:
        """(query, key) pairs over the batch: query i attends context + i + 1 keys."""
        n = self.query_len
        return self.batch * (n * self.context + n * (n + 1) // 2)

    def flops(self, hq: int, d: int) -> int:
        """QK^T and PV, 2 * D multiply-adds each per query head and attended key."""
        return 4 * hq * d * self.attended()

    def bytes(self, hq: int, hkv: int, d: int, elem: int) -> int:
        """K and V read once, q read and the output written."""
        return elem * d * (2 * self.batch * self.seq_len * hkv + 2 * self.total_q * hq)


def all_shapes(kinds=KINDS, quick: bool = False) -> list[ExtendShape]:
    table = QUICK if quick else MATRIX
    shapes = []
    for kind in kinds:
        batches, query_lens, contexts = table[kind]
        for ctx, n, b in itertools.product(contexts, query_lens, batches):
            shapes.append(ExtendShape(kind, b, n, ctx))
    return shapes


def shape_selected(shape: ExtendShape, selectors: list[str] | None) -> bool:
    """A selector is a full label or any of its words (``B=1``, ``n=2048``, ``ctx=0``); a shape
    must match every selector word given in one selector string."""
    if not selectors:
        return True
    words = set(shape.label.split(" "))
    return any(set(s.split(" ")) <= words for s in selectors)


@dataclass(frozen=True)
class MatrixCase:
    dtype: str
    heads: str
    page: int
    shape: ExtendShape

    @property
    def key(self) -> tuple[str, str, int, str]:
        return (self.dtype, self.heads, self.page, self.shape.label)


def kv_bytes(shape: ExtendShape, hkv: int, d: int, elem: int) -> int:
    return 2 * shape.batch * shape.seq_len * hkv * d * elem


def build_matrix(args: argparse.Namespace) -> tuple[list[MatrixCase], list[str]]:
    """The cases to run, in order, and those left out for size (``--max-kv-gib``)."""
    if args.sweep:
        labels = [s for kind in args.kinds for s in SWEEP_SHAPES[kind]]
        shapes = [s for s in all_shapes(args.kinds) if s.label in labels]
        shapes = [s for s in shapes if shape_selected(s, args.shapes)]
    else:
        shapes = [s for s in all_shapes(args.kinds, args.quick) if shape_selected(s, args.shapes)]
    cases, too_big = [], []
    for dname in args.dtypes:
        for head in args.heads:
            _, hkv, d = parse_heads(head)
            for shape in shapes:
                case = MatrixCase(dname, head, args.page, shape)
                if kv_bytes(shape, hkv, d, 2) > args.max_kv_gib * 2**30:
                    too_big.append(" ".join(map(str, case.key)))
                    continue
                cases.append(case)
    return cases, too_big


def sweep_configs(args: argparse.Namespace) -> list[dict[str, int | None]]:
    """Every combination of the sweep grid (``--sweep-*`` options)."""
    grid = {
        "block_m": args.sweep_block_m,
        "block_n": args.sweep_block_n,
        "num_warps": args.sweep_warps,
        "num_stages": args.sweep_stages,
        "num_splits": args.sweep_splits,
    }
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]


def config_label(config: dict[str, int | None]) -> str:
    names = {"block_m": "M", "block_n": "N", "num_warps": "w", "num_stages": "s"}
    names["num_splits"] = "splits"
    return " ".join(f"{names[k]}{'auto' if v is None else v}" for k, v in config.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every class, fewer batch sizes")
    p.add_argument("--heads", nargs="+", default=list(HEAD_CONFIGS), help="q/kv/head_dim")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--shapes", nargs="*", default=None, help="e.g. 'B=1' or 'n=2048 ctx=0'")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    p.add_argument("--max-kv-gib", type=float, default=16.0, help="skip larger caches")
    p.add_argument("--calls", type=int, default=20, help="most calls per CUDA graph")
    p.add_argument("--graph-us", type=float, default=4000.0, help="aim of one graph replay")
    p.add_argument("--warmup", type=float, default=10.0, help="ms")
    p.add_argument("--rep", type=float, default=40.0, help="ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--backends", nargs="+", default=list(FI_BACKENDS), help="FlashInfer's")
    p.add_argument("--sweep", action="store_true", help="FlashDec launch-configuration sweep")
    p.add_argument("--sweep-block-m", nargs="+", type=_opt_int, default=SWEEP_GRID["block_m"])
    p.add_argument("--sweep-block-n", nargs="+", type=int, default=SWEEP_GRID["block_n"])
    p.add_argument("--sweep-warps", nargs="+", type=int, default=SWEEP_GRID["num_warps"])
    p.add_argument("--sweep-stages", nargs="+", type=int, default=SWEEP_GRID["num_stages"])
    p.add_argument(
        "--sweep-splits", nargs="+", type=_opt_int, default=[None], help="0: the plan's choice"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 2) - 2)),
        help="processes that compile kernels before the timing pass (1: none)",
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="stop adding cases after this")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default=None, help="default: extend (extend_sweep with --sweep)")
    p.add_argument("--from-json", default=None, help="re-render .md/.png from a saved JSON")
    args = p.parse_args(argv)
    for head in args.heads:
        parse_heads(head)
    if args.calls < 1:
        raise SystemExit("--calls must be >= 1")
    if args.name is None:
        args.name = "extend_sweep" if args.sweep else "extend"
    return args


def _opt_int(text: str) -> int | None:
    """An int option where 0 (or 'auto') means: the plan's own choice."""
    return None if text in ("0", "auto", "None") else int(text)


# ---------------------------------------------------------------------------------------------
# one problem on the GPU


class ExtendCase:
    """One problem: a random paged cache (permuted page ids), the new tokens' queries and
    FlashInfer's page arrays. ``k``/``v`` are token-major ``[pages, Hkv, page, D]`` (FlashInfer's
    HND); the NHD copy is made on first use."""

    def __init__(self, shape: ExtendShape, hq, hkv, d, page, dtype, seed=0, device=None):
        dev = self.device = torch.device(device or DEVICE)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.shape, self.hq, self.hkv, self.d, self.page, self.dtype = (
            shape,
            hq,
            hkv,
            d,
            page,
            dtype,
        )
        b = shape.batch
        per_request = math.ceil(shape.seq_len / page)
        total_pages = b * per_request
        perm = torch.randperm(total_pages + 1, device=dev, generator=gen).to(torch.int32)
        kv_shape = (total_pages + 1, hkv, page, d)
        self.k = torch.randn(kv_shape, device=dev, generator=gen).to(dtype)
        self.v = torch.randn(kv_shape, device=dev, generator=gen).to(dtype)
        self.indices = perm[:total_pages].contiguous()
        self.tables = self.indices.view(b, per_request)
        self.lens = torch.full((b,), shape.seq_len, dtype=torch.int32, device=dev)
        self.qlens = torch.full((b,), shape.query_len, dtype=torch.int32, device=dev)
        self.q = torch.randn(shape.total_q, hq, d, device=dev, generator=gen).to(dtype)
        steps = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.qo_indptr = steps * shape.query_len
        self.kv_indptr = steps * per_request
        last = shape.seq_len - (per_request - 1) * page
        self.last_page_len = torch.full((b,), last, dtype=torch.int32, device=dev)
        self._nhd: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, **overrides):
        return plan_extend(
            self.shape.batch,
            self.shape.total_q,
            self.hq,
            self.hkv,
            self.d,
            self.page,
            self.shape.seq_len,
            self.dtype,
            self.device,
            max_blocks_per_seq=self.tables.shape[1],
            max_query_len=self.shape.query_len,
            **overrides,
        )

    def flashdec_fn(self, plan):
        """``extend(..., workspace=ws)`` with ``plan``'s workspace (the capturable path)."""
        ws = plan.allocate_workspace()
        q, k, v, t, lens, qlens = self.q, self.k, self.v, self.tables, self.lens, self.qlens
        return lambda: extend(q, k, v, t, lens, qlens, workspace=ws)

    def kv_for(self, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
        if layout == "HND":
            return self.k, self.v
        if self._nhd is None:
            self._nhd = (self.k.transpose(1, 2).contiguous(), self.v.transpose(1, 2).contiguous())
        return self._nhd

    def flashinfer_fn(self, flashinfer, workspace: torch.Tensor, layout: str, backend: str):
        """FlashInfer's causal paged prefill in its CUDA-graph mode (fixed index buffers)."""
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            layout,
            use_cuda_graph=True,
            qo_indptr_buf=self.qo_indptr.clone(),
            paged_kv_indptr_buf=self.kv_indptr.clone(),
            paged_kv_indices_buf=self.indices.clone(),
            paged_kv_last_page_len_buf=self.last_page_len.clone(),
            backend=backend,
        )
        wrapper.plan(
            self.qo_indptr,
            self.kv_indptr,
            self.indices,
            self.last_page_len,
            self.hq,
            self.hkv,
            self.d,
            self.page,
            causal=True,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        kv = self.kv_for(layout)
        out = torch.empty_like(self.q)
        return lambda: wrapper.run(self.q, kv, out=out)


def flashinfer_workspace() -> torch.Tensor:
    """FlashInfer's float workspace (split-KV partials of prefill); zeroed, as it asks."""
    return torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def graph_time(fn, args) -> tuple[float | None, str | None, int]:
    """Graph-timed microseconds per call, or the error that stopped it, and the calls per
    graph (as many as fit in about ``--graph-us``, at most ``--calls``)."""
    try:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        once_us = (time.perf_counter() - start) * 1e6
        calls = max(1, min(args.calls, int(args.graph_us / max(once_us, 1.0))))
        return graph_us_per_call(fn, calls, args.warmup, args.rep), None, calls
    except Exception as exc:
        torch.cuda.synchronize()
        return None, short_error(exc), 0


def fi_paths(args) -> list[tuple[str, str]]:
    return [(layout, backend) for layout in FI_LAYOUTS for backend in args.backends]


def fi_path_name(layout: str, backend: str) -> str:
    return f"{layout}-{backend}"


def flashinfer_best(case: ExtendCase, flashinfer, fi_ws, args) -> dict[str, Any]:
    """Every FlashInfer path graph-timed: ``{"us": {path: us|None}, "errors": {path: str},
    "best_path", "best_us", "best_fn"}``."""
    times: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    fns = {}
    for layout, backend in fi_paths(args):
        name = fi_path_name(layout, backend)
        try:
            fns[name] = case.flashinfer_fn(flashinfer, fi_ws, layout, backend)
        except Exception as exc:
            torch.cuda.synchronize()
            times[name], errors[name] = None, short_error(exc)
            continue
        times[name], err, _ = graph_time(fns[name], args)
        if err:
            errors[name] = err
    ok = {k: v for k, v in times.items() if v}
    best = min(ok, key=ok.get) if ok else None
    return {
        "us": times,
        "errors": errors,
        "best_path": best,
        "best_us": ok.get(best) if best else None,
        "best_fn": fns.get(best),
    }


def plan_summary(plan) -> dict[str, Any]:
    return {
        "block_m": plan.block_m,
        "block_n": plan.block_n,
        "warps": plan.num_warps,
        "stages": plan.num_stages,
        "splits": plan.num_splits,
        "tokens_per_split": plan.tokens_per_split,
        "programs": plan.num_programs,
    }


def base_row(mc: MatrixCase) -> dict[str, Any]:
    hq, hkv, d = parse_heads(mc.heads)
    s = mc.shape
    elem = DTYPES[mc.dtype].itemsize
    return {
        "dtype": mc.dtype,
        "heads": mc.heads,
        "page": mc.page,
        "shape": s.label,
        "kind": s.kind,
        "batch": s.batch,
        "query_len": s.query_len,
        "context": s.context,
        "gflop": s.flops(hq, d) / 1e9,
        "mib": s.bytes(hq, hkv, d, elem) / 2**20,
    }


def finish_row(row: dict[str, Any], ceilings: dict[str, float]) -> dict[str, Any]:
    """Derived columns: TFLOP/s, TB/s and % of the copy ceiling of both sides, the ratio."""
    us, fi = row.get("fd_us"), row.get("fi_best_us")
    for side, t in (("fd", us), ("fi", fi)):
        if t:
            row[f"{side}_tflops"] = row["gflop"] * 1e9 / (t * 1e-6) / 1e12
            row[f"{side}_tbs"] = row["mib"] * 2**20 / (t * 1e-6) / 1e12
            row[f"{side}_pct_copy"] = 100 * row[f"{side}_tbs"] / ceilings["copy_tbs"]
    row["ratio"] = us / fi if us and fi else None
    return row


def measure(mc: MatrixCase, args, flashinfer, fi_ws, ceilings) -> dict[str, Any]:
    """Time one case. A path that fails is recorded in the row; a case that cannot even be
    built (e.g. out of memory) raises, and :func:`run` records that."""
    row = base_row(mc)
    hq, hkv, d = parse_heads(mc.heads)
    case = ExtendCase(mc.shape, hq, hkv, d, mc.page, DTYPES[mc.dtype], seed=args.seed)
    try:
        plan = case.plan()
        row["plan"] = plan_summary(plan)
        fn = case.flashdec_fn(plan)
        row["fd_us"], row["fd_error"], row["calls"] = graph_time(fn, args)
        fd_out = fn().clone() if row["fd_us"] else None
        if flashinfer is not None:
            fi = flashinfer_best(case, flashinfer, fi_ws, args)
            row["fi_us"], row["fi_errors"] = fi["us"], fi["errors"]
            row["fi_best_path"], row["fi_best_us"] = fi["best_path"], fi["best_us"]
            if fd_out is not None and fi["best_fn"] is not None:
                row["max_abs_diff_vs_fi"] = output_error(fd_out, fi["best_fn"]())["max_abs"]
            del fi
    finally:
        del case
        torch.cuda.empty_cache()
    return finish_row(row, ceilings)


def measure_sweep(mc: MatrixCase, configs, args) -> list[dict[str, Any]]:
    """FlashDec alone under every configuration (and the plan's default first)."""
    hq, hkv, d = parse_heads(mc.heads)
    case = ExtendCase(mc.shape, hq, hkv, d, mc.page, DTYPES[mc.dtype], seed=args.seed)
    rows = []
    try:
        for config in [None, *configs]:
            row = base_row(mc)
            row["config"] = "default" if config is None else config_label(config)
            try:
                plan = case.plan(**_overrides(config))
            except ValueError as exc:  # e.g. a block_n that does not divide the split
                row["fd_error"] = short_error(exc)
                rows.append(row)
                continue
            row["plan"] = plan_summary(plan)
            row["fd_us"], row["fd_error"], row["calls"] = graph_time(case.flashdec_fn(plan), args)
            rows.append(row)
    finally:
        del case
        torch.cuda.empty_cache()
    return rows


def _overrides(config: dict[str, int | None] | None) -> dict[str, int]:
    return {} if config is None else {k: v for k, v in config.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# report (pure Python: tested on the CPU from fake rows)


def _case(r: dict[str, Any]) -> str:
    return f"{r['dtype']} {r['heads']} {r['shape']}"


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 20's targets per class and over all: ``{"target", "status", "detail"}``."""
    targets = []
    groups = [("all shapes", rows)] + [
        (kind, [r for r in rows if r["kind"] == kind]) for kind in KINDS
    ]
    for name, sel in groups:
        ratios = [r for r in sel if r.get("ratio")]
        if not ratios:
            targets.append(
                {"target": f"{name}: geomean / worst", "status": "not measured", "detail": "—"}
            )
            continue
        g = geomean([r["ratio"] for r in ratios])
        worst = max(ratios, key=lambda r: r["ratio"])
        losses = sum(r["ratio"] > 1.0 for r in ratios)
        for target, ok, detail in (
            (
                f"{name}: geomean <= {TARGET_GEOMEAN:.2f}x FlashInfer's best",
                g <= TARGET_GEOMEAN,
                f"{g:.3f}x over {len(ratios)} shapes; {losses} slower than FlashInfer",
            ),
            (
                f"{name}: worst <= {TARGET_WORST:.2f}x",
                worst["ratio"] <= TARGET_WORST,
                f"{worst['ratio']:.3f}x ({_case(worst)})",
            ),
        ):
            targets.append(
                {"target": target, "status": "met" if ok else "MISSED", "detail": detail}
            )
    return targets


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("ratio"):
            by.setdefault((r["heads"], r["kind"]), []).append(r["ratio"])
    if by:
        lines += ["FlashDec / FlashInfer best, per head config and class (geomean, worst):", ""]
        for (heads, kind), rs in by.items():
            lines.append(
                f"- {heads} ({HEAD_CONFIGS.get(heads, 'custom')}) {kind}: {geomean(rs):.3f}x, "
                f"worst {max(rs):.3f}x, {len(rs)} shapes"
            )
        lines.append("")
    wins: dict[str, int] = {}
    for r in rows:
        if r.get("fi_best_path"):
            wins[r["fi_best_path"]] = wins.get(r["fi_best_path"], 0) + 1
    if wins:
        order = sorted(wins.items(), key=lambda kv: -kv[1])
        lines += ["FlashInfer's winning path: " + ", ".join(f"{k} {v}" for k, v in order), ""]
    diffs = [r for r in rows if r.get("max_abs_diff_vs_fi") is not None]
    if diffs:
        worst = max(diffs, key=lambda r: r["max_abs_diff_vs_fi"])
        lines += [
            f"Outputs, FlashDec vs FlashInfer's best path: largest |diff| "
            f"{worst['max_abs_diff_vs_fi']:.4f} ({_case(worst)}) over {len(diffs)} shapes",
            "",
        ]
    failed = [r for r in rows if r.get("fd_error") or r.get("error")]
    fi_none = [r for r in rows if "fi_us" in r and not r.get("fi_best_us")]
    lines.append(
        f"FlashDec failed on {len(failed)} of {len(rows)} shapes; FlashInfer ran no path on "
        f"{len(fi_none)}."
    )
    lines += [f"- {_case(r)}: {r.get('error') or r.get('fd_error')}" for r in failed[:10]]
    return lines


def _fi_cell(r: dict[str, Any], path: str) -> str:
    if "fi_us" not in r:
        return "—"
    us = (r.get("fi_us") or {}).get(path)
    return fmt(us) if us else "fail"


def table(rows: list[dict[str, Any]], paths: list[str]) -> str:
    columns = ["heads", "shape", "GFLOP", "MiB", "plan (M/N/w/s/splits)", "FlashDec us"]
    columns += ["TFLOP/s", "TB/s", "FI best us", "FI path", "FI TFLOP/s", "FD / FI", *paths]
    columns.append("max |diff| vs FI")
    out = []
    for r in rows:
        p = r.get("plan") or {}
        plan = "/".join(str(p.get(k, "?")) for k in ("block_m", "block_n", "warps", "stages"))
        out.append(
            [
                r["heads"],
                r["shape"],
                fmt(r["gflop"]),
                fmt(r["mib"], 0),
                f"{plan}/{p.get('splits', '?')}" if p else "—",
                fmt(r.get("fd_us")) if r.get("fd_us") else "fail",
                fmt(r.get("fd_tflops")),
                fmt(r.get("fd_tbs"), 2),
                fmt(r.get("fi_best_us")),
                r.get("fi_best_path") or "—",
                fmt(r.get("fi_tflops")),
                fmt(r.get("ratio"), 3),
                *(_fi_cell(r, path) for path in paths),
                fmt(r.get("max_abs_diff_vs_fi"), 4),
            ]
        )
    return markdown_table(columns, out)


def render_markdown(payload: dict[str, Any], notes: str | None = None) -> str:
    rows, env, a = payload["rows"], payload["environment"], payload["args"]
    fi_error = payload.get("flashinfer_error")
    paths = [fi_path_name(lay, be) for lay in FI_LAYOUTS for be in a["backends"]]
    md = [
        "# Paged extend attention: FlashDec vs FlashInfer's best prefill path, graph-timed",
        "",
        environment_markdown(env),
        f"- ceiling: device-to-device copy {payload['ceilings']['copy_tbs']:.2f} TB/s",
        "- FlashInfer: "
        + ("present" if not fi_error else f"**MISSING** ({fi_error}): FlashDec alone, no ratios"),
        "- method: each side captured in a CUDA graph, up to "
        f"{a['calls']} calls per graph (about {a['graph_us']:.0f} us per replay), median replay "
        f"/ calls (do_bench, warmup {a['warmup']} ms, rep {a['rep']} ms, L2 flushed per replay); "
        "FlashDec through plan_extend + extend(workspace=); FlashInfer "
        "BatchPrefillWithPagedKVCacheWrapper (causal, CUDA-graph mode) at its best of "
        f"{', '.join(paths)} (HND reads FlashDec's K/V tensors, NHD a copy of the same values); "
        f"random data and page ids (seed {a['seed']}), page {a['page']}; TFLOP/s counts 4 * Hq * "
        "D per (query, attended key); TB/s counts K/V once plus q and the output",
        f"- matrix: dtypes {', '.join(a['dtypes'])}; heads {', '.join(a['heads'])}; kinds "
        f"{', '.join(a['kinds'])}" + (" (--quick)" if a.get("quick") else ""),
    ]
    if payload.get("partial"):
        md.append("- **partial results (run in progress or cut short)**")
    if payload.get("skipped_budget"):
        md.append(
            f"- not run, time budget ({a['budget_s']:.0f} s) spent: "
            f"{len(payload['skipped_budget'])} cases"
        )
    if payload.get("skipped_size"):
        md.append(f"- left out, KV over {a['max_kv_gib']} GiB: {len(payload['skipped_size'])}")
    md += ["", "## Targets of issue 20", ""]
    md += [f"- [{t['status']}] {t['target']}: {t['detail']}" for t in evaluate_targets(rows)]
    md += ["", "## Summary", "", *summary_lines(rows), "", "## All shapes", ""]
    md.append(table(rows, paths))
    if notes:
        md += ["", notes.strip()]
    return "\n".join(md)


def sweep_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape the fastest configuration and its speed-up over the plan's default; per
    (heads, class) the configuration whose time / that shape's best has the lowest geomean
    over the class's shapes (only configurations that ran on every one of them)."""
    shapes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        shapes.setdefault((r["heads"], r["shape"]), []).append(r)
    best_per_shape = []
    rel: dict[tuple[str, str], dict[str, list[float]]] = {}
    counts: dict[tuple[str, str], int] = {}
    for (heads, label), rs in shapes.items():
        ok = [r for r in rs if r.get("fd_us")]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["fd_us"])
        default = next((r for r in ok if r["config"] == "default"), None)
        best_per_shape.append(
            {
                "heads": heads,
                "shape": label,
                "best": best["config"],
                "best_us": best["fd_us"],
                "default_us": default["fd_us"] if default else None,
                "speedup": default["fd_us"] / best["fd_us"] if default else None,
            }
        )
        key = (heads, rs[0]["kind"])
        counts[key] = counts.get(key, 0) + 1
        for r in ok:
            rel.setdefault(key, {}).setdefault(r["config"], []).append(r["fd_us"] / best["fd_us"])
    per_class = []
    for key, by_config in rel.items():
        full = {c: v for c, v in by_config.items() if len(v) == counts[key]}
        if not full:
            continue
        config = min(full, key=lambda c: geomean(full[c]))
        per_class.append(
            {
                "heads": key[0],
                "kind": key[1],
                "config": config,
                "geomean_vs_best": geomean(full[config]),
                "worst_vs_best": max(full[config]),
                "default_geomean_vs_best": geomean(full["default"]) if "default" in full else None,
            }
        )
    return {"best_per_shape": best_per_shape, "per_class": per_class}


def render_sweep(payload: dict[str, Any]) -> str:
    summary = sweep_summary(payload["rows"])
    md = [
        "# Paged extend attention: launch-configuration sweep (FlashDec alone, graph-timed)",
        "",
        environment_markdown(payload["environment"]),
        f"- configurations: {payload['num_configs']} (+ the plan's default) per shape; "
        "M = block_m (auto: the plan's), N = block_n, w = warps, s = stages",
        "",
        "## Best configuration per class",
        "",
        "The configuration with the lowest geometric mean of (its time / the shape's best time) "
        "over the class's shapes, beside the plan's default:",
        "",
        markdown_table(
            ["heads", "class", "configuration", "geomean vs best", "worst vs best", "default"],
            [
                [
                    c["heads"],
                    c["kind"],
                    c["config"],
                    fmt(c["geomean_vs_best"], 3),
                    fmt(c["worst_vs_best"], 3),
                    fmt(c["default_geomean_vs_best"], 3),
                ]
                for c in summary["per_class"]
            ],
        ),
        "",
        "## Best per shape",
        "",
        markdown_table(
            ["heads", "shape", "best configuration", "best us", "default us", "speed-up"],
            [
                [
                    b["heads"],
                    b["shape"],
                    b["best"],
                    fmt(b["best_us"]),
                    fmt(b["default_us"]),
                    fmt(b["speedup"], 3),
                ]
                for b in summary["best_per_shape"]
            ],
        ),
        "",
        "## Every configuration",
        "",
        markdown_table(
            ["heads", "shape", "configuration", "us", "TFLOP/s", "error"],
            [
                [
                    r["heads"],
                    r["shape"],
                    r["config"],
                    fmt(r.get("fd_us")),
                    fmt(r.get("fd_tflops")),
                    (r.get("fd_error") or "")[:80],
                ]
                for r in payload["rows"]
            ],
        ),
    ]
    return "\n".join(md)


def write_report(payload: dict[str, Any], out_dir: Path, name: str, plot: bool = True) -> Path:
    md_path = out_dir / f"{name}.md"
    if payload.get("sweep"):
        public = {**payload, "summary": sweep_summary(payload["rows"])}
        write_results(name, render_sweep(payload), public, out_dir)
        return md_path
    notes = None
    if md_path.exists():  # a re-render keeps the notes written by hand under the tables
        old = md_path.read_text()
        if "\n## Notes" in old:
            notes = old[old.index("\n## Notes") :]
    public = {**payload, "targets": evaluate_targets(payload["rows"])}
    write_results(name, render_markdown(payload, notes), public, out_dir)
    if plot:
        plot_rows(payload["rows"], out_dir / f"{name}.png")
    return md_path


def plot_rows(rows: list[dict[str, Any]], path: Path) -> None:
    sel = [r for r in rows if r.get("fd_us")][:80]
    if not sel:
        return
    bar_plot(
        path,
        [f"{r['heads']} {r['shape']}" for r in sel],
        {
            "FlashDec": [r.get("fd_tflops") for r in sel],
            "FlashInfer best path": [r.get("fi_tflops") for r in sel],
        },
        "TFLOP/s (CUDA graph)",
        "paged extend attention, graph-timed",
        log=True,
    )


# ---------------------------------------------------------------------------------------------


ARG_KEYS = (
    "quick",
    "heads",
    "kinds",
    "shapes",
    "page",
    "dtypes",
    "max_kv_gib",
    "calls",
    "graph_us",
    "warmup",
    "rep",
    "seed",
    "backends",
    "budget_s",
)
PRECOMPILE_MAX_BYTES = 4 * 2**30  # larger cases compile in the timing pass (worker memory)


def warm_up_worker(jobs: list[tuple[str, Any]], seed: int, backends: list[str]) -> int:
    """Worker: compile FlashDec's kernel for ``("case", (MatrixCase, config))`` jobs and build
    FlashInfer's JIT modules for ``("flashinfer", (heads, dtype))`` jobs (on a small batch), so
    that the timing pass finds them in the on-disk caches."""
    torch.cuda.init()
    done = 0
    flashinfer = None
    if any(kind == "flashinfer" for kind, _ in jobs):
        flashinfer, _ = load_flashinfer()
    for kind, what in jobs:
        case = None
        try:
            if kind == "case":
                mc, config = what
                hq, hkv, d = parse_heads(mc.heads)
                case = ExtendCase(mc.shape, hq, hkv, d, mc.page, DTYPES[mc.dtype], seed)
                case.flashdec_fn(case.plan(**_overrides(config)))()
            elif flashinfer is not None:
                heads, dname, page = what
                hq, hkv, d = parse_heads(heads)
                small = ExtendShape("chunk", 2, 40, 70)
                case = ExtendCase(small, hq, hkv, d, page, DTYPES[dname], seed)
                ws = flashinfer_workspace()
                for layout in FI_LAYOUTS:
                    for backend in backends:
                        # a path that fails here fails (and is recorded) in the timing pass
                        with contextlib.suppress(Exception):
                            case.flashinfer_fn(flashinfer, ws, layout, backend)()
            torch.cuda.synchronize()
            done += 1
        except Exception as exc:  # the timing pass meets (and records) it again
            print(f"warm-up failed: {kind} {what}: {short_error(exc)}", flush=True)
        finally:
            case = None
            torch.cuda.empty_cache()
    return done


def warm_up(cases: list[MatrixCase], configs, args, flashinfer) -> None:
    """Compile in parallel what the timing pass would otherwise compile one case at a time."""
    if args.workers <= 1 or not cases:
        return
    jobs: list[tuple[str, Any]] = []
    if flashinfer is not None:
        keys = dict.fromkeys((c.heads, c.dtype, c.page) for c in cases)
        jobs += [("flashinfer", key) for key in keys]
    for c in cases:
        if kv_bytes(c.shape, *parse_heads(c.heads)[1:], 2) <= PRECOMPILE_MAX_BYTES:
            jobs += [("case", (c, config)) for config in [None, *configs]]
    timeout = max(10.0, min(args.budget_s / 2, 300.0))
    run_in_workers(
        warm_up_worker, jobs, args.workers, timeout, args.seed, args.backends, round_robin=True
    )


def progress_line(row: dict[str, Any]) -> str:
    error = row.get("error") or row.get("fd_error")
    return (
        f"{_case(row):<48} {row.get('config', ''):<28} FD {fmt(row.get('fd_us')):>9} us "
        f"{fmt(row.get('fd_tflops')):>6} TFLOP/s  FI {fmt(row.get('fi_best_us')):>9} us "
        f"[{row.get('fi_best_path') or '-'}] x{fmt(row.get('ratio'), 3)}"
        + (f"  ERROR {error}" if error else "")
    )


def run(args) -> int:
    env = environment()
    if args.sweep or args.no_flashinfer:
        flashinfer, fi_error = None, "not used (--sweep)" if args.sweep else "disabled"
    else:
        flashinfer, fi_error = load_flashinfer()
    if fi_error:
        print(f"FlashInfer unavailable: {fi_error} — FlashDec alone, no ratios", flush=True)
    env["flashinfer"] = getattr(flashinfer, "__version__", None)
    ceilings = {"copy_tbs": copy_ceiling_tbs()}
    cases, too_big = build_matrix(args)
    configs = sweep_configs(args) if args.sweep else []
    print(f"{len(cases)} cases ({len(too_big)} left out for size), {len(configs)} configs")
    t0 = time.time()
    warm_up(cases, configs, args, flashinfer)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "sweep": args.sweep,
        "num_configs": len(configs),
        "args": {k: getattr(args, k) for k in ARG_KEYS},
        "environment": env,
        "ceilings": ceilings,
        "flashinfer_error": fi_error,
        "rows": [],
        "skipped_size": too_big,
        "skipped_budget": [],
        "partial": True,
    }
    out_dir = Path(args.out_dir)
    fi_ws = flashinfer_workspace() if flashinfer else None
    for mc in cases:
        if time.time() - t0 > args.budget_s:
            payload["skipped_budget"].append(" ".join(map(str, mc.key)))
            continue
        try:
            if args.sweep:
                rows = [finish_row(r, ceilings) for r in measure_sweep(mc, configs, args)]
            else:
                rows = [measure(mc, args, flashinfer, fi_ws, ceilings)]
        except Exception as exc:  # one failing shape is reported and skipped
            traceback.print_exc()
            torch.cuda.synchronize()
            rows = [{**base_row(mc), "error": short_error(exc)}]
        payload["rows"] += rows
        for row in rows:
            print(progress_line(row), flush=True)
        write_report(payload, out_dir, args.name, plot=False)
    payload["partial"] = False
    md_path = write_report(payload, out_dir, args.name)
    text = md_path.read_text()
    if args.sweep:
        print(text[text.index("## Best configuration") : text.index("## Every configuration")])
    else:
        print(text[text.index("## Targets") : text.index("## All shapes")])
    return 0


def rerender(args) -> int:
    path = Path(args.from_json)
    payload = json.loads(path.read_text())
    if payload.get("format") != FORMAT:
        print(f"{path} was written by another bench_extend format", file=sys.stderr)
        return 2
    payload.pop("targets", None)
    payload.pop("summary", None)
    out_dir = path.parent if args.out_dir == str(RESULTS_DIR) else Path(args.out_dir)
    write_report(payload, out_dir, path.stem)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # no GPU needed
        return rerender(args)
    if not torch.cuda.is_available():
        print("bench_extend needs a CUDA GPU (or --from-json)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
