"""Tuning sweep of the paged decode kernel's launch parameters on the weak shapes of issue 10.

The sweep spans what ``plan_decode`` can choose and the launch accepts: the split (forced
``num_splits``, the heuristic's ``programs_per_sm``, and the split path's persistent-grid size
``num_programs``), the tile (``block_n`` tokens per loop iteration), ``num_warps`` and
``num_stages``. (The GQA packing, ``block_g``, is fixed by the group size: rows past the group
are padding, so it has no setting worth sweeping.) Every time is graph-timed like
bench_decode.py (``--calls`` calls per CUDA graph, replay median / calls), and every output is
compared with the default plan's.

Phases, each over every shape, so a ``--budget-s`` cut leaves every shape measured alike:

1. the default plan and FlashInfer's best of four paths (HND/NHD x tensor-core/CUDA-core);
   with ``--fp8``, then the FP8 kernel variants (:data:`FP8_VARIANTS`: ``fp8_compute`` x
   ``fp8_staging``, and tiles sized by bytes) at the default split;
2. split variants at the default tile (and the best FP8 variant so far);
3. the tile grid (block_n x warps x stages, pruned by shared memory) at phase 2's best split;
   its kernel variants are compiled first in parallel worker processes (Triton's on-disk cache
   then serves the timing process).

Prints, per shape, the best configuration against the default and FlashInfer's best, and writes
``<name>.md`` + ``.json`` (+ a ``.jsonl`` line per timing as it completes).

    PYTHONPATH=. python3 benchmarks/tune_decode.py                 # every weak shape, <= 4 min
    PYTHONPATH=. python3 benchmarks/tune_decode.py --shapes 28/4/128@B=48 --no-flashinfer
    PYTHONPATH=. python3 benchmarks/tune_decode.py --fp8            # FP8 KV on its own shapes
    PYTHONPATH=. python3 benchmarks/tune_decode.py --plans          # no GPU: the default plans
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
    geomean,
    markdown_table,
    run_in_workers,
    write_results,
)
from benchmarks.bench_decode import (
    DTYPES,
    FP8,
    Case,
    MatrixCase,
    Shape,
    flashinfer_best,
    flashinfer_workspace,
    graph_time,
    kv_bytes,
    load_flashinfer,
    parse_heads,
    ragged_shape,
    short_error,
    skew_pair,
    uniform_shape,
    warm_up_worker,
)
from flashdec.kernels import plan_decode
from flashdec.kernels.decode_plan import (
    DEFAULT_FP8_COMPUTE,
    DEFAULT_FP8_STAGING,
    DEFAULT_FP8_TILE,
    FP8_COMPUTE_CHOICES,
    FP8_STAGING_CHOICES,
)

# (head config, shape): the shapes issue 10 names as slower than FlashInfer, and their class
WEAK_SHAPES: list[tuple[str, Shape]] = [
    ("32/8/128", uniform_shape(1024, 17, "short")),
    ("32/8/128", uniform_shape(1024, 64, "short")),
    ("28/4/128", uniform_shape(1024, 17, "short")),
    ("28/4/128", uniform_shape(48, 3000)),
    ("28/4/128", ragged_shape(48, 12345)),
    ("16/8/256", uniform_shape(1, 32768)),
    ("16/8/256", uniform_shape(32, 4096)),
    ("16/8/256", uniform_shape(16, 16384)),
    ("16/8/256", uniform_shape(1024, 17, "short")),
    ("16/8/256", skew_pair(32768, 1024, 63)[1]),
    ("32/1/128", uniform_shape(1, 32768)),
    ("32/1/128", uniform_shape(32, 4096)),
    ("32/8/128", skew_pair(32768, 1024, 63)[0]),
]
# --fp8: FP8 e4m3 KV on the shapes of its >= 1.7x target (bf16 KV >= 512 MiB) and B=1 32k
FP8_SHAPES: list[tuple[str, Shape]] = [
    ("32/8/128", uniform_shape(32, 4096)),
    ("32/8/128", uniform_shape(16, 16384)),
    ("32/8/128", uniform_shape(1, 32768)),
    ("28/4/128", uniform_shape(48, 3000)),
    ("16/8/256", uniform_shape(32, 4096)),
]
# --fp8 phase 1b: every fp8_compute x fp8_staging with tiles of q's dtype in tokens (q/none/tokens
# is the kernel before these options), and the staged f16 ones with tiles sized by bytes; each
# at the default split, the plan's default (timed first) left out
FP8_OPTIONS = ("fp8_compute", "fp8_staging", "fp8_tile")
FP8_VARIANTS: list[dict[str, str]] = [
    v
    for v in [
        *(
            {"fp8_compute": c, "fp8_staging": s, "fp8_tile": "tokens"}
            for c in FP8_COMPUTE_CHOICES
            for s in FP8_STAGING_CHOICES
        ),
        *({"fp8_compute": "f16", "fp8_staging": s, "fp8_tile": "bytes"} for s in ("v", "kv")),
    ]
    if v
    != {
        "fp8_compute": DEFAULT_FP8_COMPUTE,
        "fp8_staging": DEFAULT_FP8_STAGING,
        "fp8_tile": DEFAULT_FP8_TILE,
    }
]
BLOCK_N = (16, 32, 64, 128)  # and 256 for one-byte (FP8) K/V
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)  # one stage only where the loop has at most two iterations
# K+V tile bytes of all stages kept below this (H200: 227 KiB of shared memory per block)
MAX_STAGE_BYTES = 160 * 1024
ITEMS_PER_SM = (1, 2, 3, 4, 8)  # split counts tried: about this many work items per SM
MIN_SPLIT_TOKENS = 16


def shape_key(head: str, shape: Shape, page: int) -> str:
    return f"{head} p{page} {shape.label}"


def shape_matches(spec: str, head: str, shape: Shape) -> bool:
    """``B=48``, a full label, or ``HEADS@LABEL`` (that shape for that head config only)."""
    if "@" in spec:
        spec_head, spec = spec.split("@", 1)
        if spec_head != head:
            return False
    return spec in (shape.label, shape.label.split(" ")[0], shape.kind)


def tile_grid(head_dim: int, elem: int, max_len: int | None = None) -> list[dict[str, int]]:
    """(block_n, warps, stages) worth timing: two warps only for tiles of at most 4096 elements
    (32 x 128), eight only for tiles of at least that, one stage only when no request needs more
    than two iterations (``max_len <= 2 * block_n``: nothing to pipeline), and no configuration
    whose pipelined K+V tiles overflow shared memory."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    out = []
    for bn in BLOCK_N + ((256,) if elem == 1 else ()):
        for w in WARPS:
            if (w == 2 and bn * block_d > 4096) or (w == 8 and bn * block_d < 4096):
                continue
            for s in STAGES:
                if s == 1 and (max_len is None or max_len > 2 * bn):
                    continue
                if s * bn * block_d * elem * 2 <= MAX_STAGE_BYTES:
                    out.append({"block_n": bn, "num_warps": w, "num_stages": s})
    return out


def split_specs(shape: Shape, num_kv_heads: int, num_sms: int) -> list[tuple[str, int]]:
    """Split variants: ``("splits", n)`` forced counts that put about ITEMS_PER_SM work items on
    every SM (and 1), ``("pps", n)`` the heuristic aiming at n programs per SM."""
    if shape.max_len < 2 * MIN_SPLIT_TOKENS:
        return []
    cap = min(1024, shape.max_len // MIN_SPLIT_TOKENS)
    counts = {1}
    for k in ITEMS_PER_SM:
        counts.add(max(1, min(cap, round(k * num_sms / (shape.batch * num_kv_heads)))))
    specs = [("splits", n) for n in sorted(counts)]
    specs += [("pps", n) for n in (1, 4)]
    return specs


def persist_specs(shape: Shape, num_kv_heads: int, num_sms: int) -> list[tuple[str, int]]:
    """``("persist", n)``: every request in one split, but through the split path's persistent
    grid of n programs that loop over the (request, KV head) items (for many short requests,
    where the single-pass grid has many tiny programs). The split path launches its merge
    kernel too, which then has nothing to merge: its launch is part of the time."""
    items = shape.batch * num_kv_heads
    return [("persist", k * num_sms) for k in (4, 8, 16) if k * num_sms < items]


def program_specs(num_items: int, num_sms: int) -> list[tuple[str, int]]:
    """``("programs", n)``: the split path's persistent grid shrunk to n programs (each then
    loops over several work items)."""
    return [("programs", k * num_sms) for k in (1, 2, 4, 8) if k * num_sms < num_items]


def spec_label(spec: tuple[str, int]) -> str:
    return "auto" if spec[0] == "auto" else f"{spec[0]}={spec[1]}"


def make_plan(case: Case, spec: tuple[str, int], tile: dict[str, int], kv_dtype=None):
    """The plan of one split spec and tile (``kv_dtype``: the cache's, e.g. FP8)."""
    kind, n = spec
    kw: dict[str, Any] = dict(tile)
    if kv_dtype is not None:
        kw["kv_dtype"] = kv_dtype
    if kind == "splits":
        kw["num_splits"] = n
    elif kind == "pps":
        kw["programs_per_sm"] = n
    elif kind == "persist":  # two splits of max_len or more: each request takes one
        block_n = case.plan(**kw).block_n
        kw["num_splits"] = 2
        kw["tokens_per_split"] = -(-case.max_len // block_n) * block_n
    plan = case.plan(**kw)
    if kind == "persist":
        plan = dataclasses.replace(plan, num_programs=min(n, plan.num_programs))
    if kind == "programs" and plan.uses_split:
        plan = dataclasses.replace(plan, num_programs=min(n, plan.num_programs))
    return plan


def build_case(head: str, shape: Shape, page: int, dtype: torch.dtype, seed: int) -> Case:
    hq, hkv, d = parse_heads(head)
    return Case(list(shape.lens), hq, hkv, d, page, dtype, seed=seed)


def _compile_worker(jobs: list[tuple], dtype_name: str, seed: int, fp8: bool) -> int:
    """Launch each job once so that Triton compiles (and caches on disk) its variant."""
    torch.cuda.init()
    done = 0
    key, case = None, None
    for head, label, page, spec, tile in jobs:
        if key != (head, label, page):
            case = None
            torch.cuda.empty_cache()
            shapes = WEAK_SHAPES + FP8_SHAPES
            shape = next(s for h, s in shapes if h == head and s.label == label)
            key, case = (head, label, page), build_case(head, shape, page, DTYPES[dtype_name], seed)
        try:
            plan = make_plan(case, spec, tile, FP8 if fp8 else None)
            _, launch = case.flashdec_fns_for(plan)
            launch()
            done += 1
        except Exception as exc:  # reported again (and skipped) by the timing pass
            print(f"compile failed {head} {label} {spec} {tile}: {short_error(exc)}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple], args, timeout_s: float) -> None:
    """Compile ``jobs`` in ``args.workers`` processes, giving up after ``timeout_s`` (the timing
    pass then compiles what is missing)."""
    if args.workers <= 1 or not jobs:
        return
    jobs = sorted(jobs, key=lambda j: (j[0], j[1], j[2]))  # a worker builds few cases
    run_in_workers(_compile_worker, jobs, args.workers, timeout_s, args.dtype, args.seed, args.fp8)


class Sweep:
    """The shapes' cases (built once each, lazily) and every timing so far."""

    def __init__(self, args, shapes: list[tuple[str, Shape]]):
        self.args = args
        self.shapes = shapes
        self.results: list[dict[str, Any]] = []
        self.cases: dict[str, Case] = {}
        self.expected: dict[str, torch.Tensor] = {}
        self.t0 = time.time()
        self.progress = Path(args.out_dir) / f"{args.name}.jsonl"
        self.progress.parent.mkdir(parents=True, exist_ok=True)
        self.progress.write_text("")

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.args.budget_s

    def case(self, head: str, shape: Shape) -> Case:
        key = shape_key(head, shape, self.args.page)
        if key not in self.cases:
            self.cases[key] = build_case(
                head, shape, self.args.page, DTYPES[self.args.dtype], self.args.seed
            )
        return self.cases[key]

    def time(self, head: str, shape: Shape, phase: str, spec, tile) -> dict[str, Any]:
        key = shape_key(head, shape, self.args.page)
        row: dict[str, Any] = {"shape": key, "phase": phase, "split": spec_label(spec), **tile}
        try:
            case = self.case(head, shape)
            plan = make_plan(case, spec, tile, FP8 if self.args.fp8 else None)
            _, launch = case.flashdec_fns_for(plan)
            row.update(
                block_n=plan.block_n,
                num_warps=plan.num_warps,
                num_stages=plan.num_stages,
                splits=plan.num_splits,
                tokens_per_split=plan.tokens_per_split,
                programs=plan.num_programs if plan.uses_split else None,
            )
            if plan.fp8_compute is not None:
                row.update(fp8_compute=plan.fp8_compute, fp8_staging=plan.fp8_staging)
                row.setdefault("fp8_tile", DEFAULT_FP8_TILE)
            row["us"], err = graph_time(launch, self.args)
            if err:
                row["error"] = err
            else:
                out = launch().float()
                if key not in self.expected:
                    self.expected[key] = out.clone()
                row["max_diff_vs_default"] = (out - self.expected[key]).abs().max().item()
                nbytes = case.kv_bytes // (2 if self.args.fp8 else 1)  # e4m3: half of bf16
                row["pct_copy"] = 100 * nbytes / (row["us"] * 1e-6) / 1e12 / self.args.copy_tbs
        except Exception as exc:  # one failing configuration is reported and skipped
            torch.cuda.synchronize()
            row["us"], row["error"] = None, short_error(exc)
        self.results.append(row)
        with self.progress.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{key:<36} {phase:<7} {row['split']:<12} bn={row.get('block_n')} "
            f"w={row.get('num_warps')} s={row.get('num_stages')} splits={row.get('splits')} "
            f"{fmt(row.get('us')):>7} us {fmt(row.get('pct_copy'))}% "
            f"diff={fmt(row.get('max_diff_vs_default'), 4)} {row.get('error', '')}",
            flush=True,
        )
        return row

    def best(self, key: str, phases: tuple[str, ...] | None = None) -> dict[str, Any] | None:
        rows = [
            r
            for r in self.results
            if r["shape"] == key and r.get("us") and (phases is None or r["phase"] in phases)
        ]
        return min(rows, key=lambda r: r["us"]) if rows else None


def fp8_of(row: dict[str, Any] | None, with_tile: bool = True) -> dict[str, str]:
    """The FP8 kernel options a timed row ran with (none for a float cache); ``with_tile``
    False drops the tile sizing rule (for rows that set block_n themselves)."""
    keys = FP8_OPTIONS if with_tile else FP8_OPTIONS[:2]
    return {k: row[k] for k in keys if row and row.get(k)}


def spec_of(row: dict[str, Any]) -> tuple[str, int]:
    if row["split"] == "auto":
        return ("auto", 0)
    kind, n = row["split"].split("=")
    return (kind, int(n))


def run(args) -> int:
    env = environment()
    flashinfer, fi_error = (
        (None, "disabled (--no-flashinfer)") if args.no_flashinfer else load_flashinfer()
    )
    if fi_error:
        print(f"FlashInfer unavailable: {fi_error} — FlashDec alone", flush=True)
    env["flashinfer"] = getattr(flashinfer, "__version__", None)
    shapes = [
        (h, s)
        for h, s in (FP8_SHAPES if args.fp8 else WEAK_SHAPES)
        if not args.shapes or any(shape_matches(x, h, s) for x in args.shapes)
    ]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sweep = Sweep(args, shapes)
    if args.workers > 1:  # default plans and FlashInfer's JIT modules, built in parallel
        jobs = [("case", MatrixCase(args.dtype, h, args.page, s)) for h, s in shapes]
        if flashinfer is not None:
            jobs += [("flashinfer", (h, args.dtype)) for h in dict.fromkeys(h for h, _ in shapes)]
        run_in_workers(
            warm_up_worker,
            jobs,
            args.workers,
            args.budget_s / 2,
            args.seed,
            args.fp8,
            round_robin=True,
        )
    fi: dict[str, dict[str, Any]] = {}
    bf16_us: dict[str, float | None] = {}  # --fp8: the bf16 cache's default plan, same shape
    fi_ws = flashinfer_workspace() if flashinfer else None
    for head, shape in shapes:  # phase 1: the default and FlashInfer
        if sweep.over_budget():
            break
        key = shape_key(head, shape, args.page)
        sweep.time(head, shape, "default", ("auto", 0), {})
        if args.fp8:
            try:
                bf16 = sweep.case(head, shape).flashdec_fns()[2]
                bf16_us[key] = graph_time(bf16, args)[0]
            except Exception as exc:
                print(f"{key} bf16: {short_error(exc)}", flush=True)
        if flashinfer is not None:
            try:
                res = flashinfer_best(sweep.case(head, shape), flashinfer, fi_ws, args, args.fp8)
                fi[key] = {k: v for k, v in res.items() if k != "best_fn"}
            except Exception as exc:
                fi[key] = {"best_us": None, "errors": {"all": short_error(exc)}}
            print(f"{key:<36} FlashInfer {fi[key].get('best_path')} {fmt(fi[key]['best_us'])} us")
    if args.fp8 and not sweep.over_budget():  # phase 1b: FP8 kernel variants, default split
        jobs = [(h, s.label, args.page, ("auto", 0), v) for h, s in shapes for v in FP8_VARIANTS]
        precompile(jobs, args, max(10.0, args.budget_s - (time.time() - sweep.t0)))
        for variant in FP8_VARIANTS:  # round-robin over shapes, like the tile grid
            for head, shape in shapes:
                if not sweep.over_budget():
                    sweep.time(head, shape, "fp8", ("auto", 0), variant)
    for head, shape in shapes:  # phase 2: splits at the default tile
        key = shape_key(head, shape, args.page)
        _, hkv, _ = parse_heads(head)
        default = sweep.best(key, ("default",))
        fp8 = fp8_of(sweep.best(key))  # the best FP8 variant so far (none for a float cache)
        specs = split_specs(shape, hkv, num_sms) + persist_specs(shape, hkv, num_sms)
        if default and default.get("programs"):
            specs += program_specs(default["programs"], num_sms)
        for spec in specs:
            if sweep.over_budget():
                break
            sweep.time(head, shape, "split", spec, fp8)
    # phase 3: the tile grid at each shape's best split so far
    grid: list[tuple[str, Shape, tuple[str, int], dict[str, int]]] = []
    for head, shape in shapes:
        best = sweep.best(shape_key(head, shape, args.page))
        if best is None:
            continue
        _, _, d = parse_heads(head)
        fp8 = fp8_of(best, with_tile=False)  # block_n is the grid's
        for tile in tile_grid(d, 1 if args.fp8 else 2, shape.max_len):
            grid.append((head, shape, spec_of(best), {**tile, **fp8}))
    if not sweep.over_budget():
        jobs = [(h, s.label, args.page, sp, t) for h, s, sp, t in grid]
        precompile(jobs, args, max(10.0, args.budget_s - (time.time() - sweep.t0)))
    # interleaved over shapes: a budget cut leaves every shape with the same part of the grid
    for i in grid_tiles(grid):
        if sweep.over_budget():
            print("time budget reached: stopping", flush=True)
            break
        head, shape, spec, tile = grid[i]
        sweep.time(head, shape, "tile", spec, tile)
    payload = {
        "environment": env,
        "args": {k: v for k, v in vars(args).items()},
        "num_sms": num_sms,
        "flashinfer_error": fi_error,
        "flashinfer": fi,
        "shapes": [
            {
                "key": shape_key(h, s, args.page),
                "heads": h,
                "kind": s.kind,
                "batch": s.batch,
                "max_len": s.max_len,
                "kv_mib": kv_bytes(s.lens, *parse_heads(h)[1:], 1 if args.fp8 else 2) / 2**20,
                "bf16_default_us": bf16_us.get(shape_key(h, s, args.page)),
            }
            for h, s in shapes
        ],
        "results": sweep.results,
        "elapsed_s": time.time() - sweep.t0,
    }
    write_results(args.name, render(payload), payload, Path(args.out_dir))
    print(render(payload))
    return 0


def grid_tiles(grid: list[tuple]) -> list[int]:
    """Indices of ``grid`` in round-robin order over shapes (first tile of every shape, then
    the second, ...)."""
    per_shape: dict[str, list[int]] = {}
    for i, (head, shape, _, _) in enumerate(grid):
        per_shape.setdefault(f"{head} {shape.label}", []).append(i)
    out = []
    for k in range(max((len(v) for v in per_shape.values()), default=0)):
        out += [v[k] for v in per_shape.values() if k < len(v)]
    return out


def config_text(row: dict[str, Any] | None) -> str:
    if not row:
        return "—"
    text = f"bn {row['block_n']} w{row['num_warps']} s{row['num_stages']} {row['split']}"
    text += f" ({row['splits']} splits"
    text += f", {row['programs']} programs)" if row.get("programs") else ")"
    if row.get("fp8_compute"):
        text += f" {fp8_label(row)}"
    return text


def fp8_label(row: dict[str, Any]) -> str:
    """``compute/staging`` and, for tiles sized by bytes, ``/bytes``."""
    text = f"{row['fp8_compute']}/{row['fp8_staging']}"
    return text + ("/bytes" if row.get("fp8_tile") == "bytes" else "")


def fp8_variant_rows(payload: dict[str, Any]) -> list[list[str]]:
    """Per shape and FP8 variant (phase 1b, default split): time and time / the default's."""
    out = []
    for s in payload["shapes"]:
        rows = [r for r in payload["results"] if r["shape"] == s["key"]]
        default = next((r for r in rows if r["phase"] == "default" and r.get("us")), None)
        for r in rows:
            if r["phase"] not in ("default", "fp8") or not r.get("fp8_compute"):
                continue
            us, d_us = r.get("us"), (default or {}).get("us")
            out.append(
                [
                    s["key"],
                    fp8_label(r) + (" (default)" if r["phase"] == "default" else ""),
                    f"bn {r.get('block_n')} w{r.get('num_warps')} s{r.get('num_stages')}",
                    fmt(us),
                    fmt(r.get("pct_copy")),
                    fmt(us / d_us, 3) if us and d_us else "—",
                    r.get("error", ""),
                ]
            )
    return out


def summary_rows(payload: dict[str, Any]) -> list[list[str]]:
    """Per shape: default, best, speed-up, FlashInfer's best and both ratios."""
    results, fi = payload["results"], payload.get("flashinfer") or {}
    out = []
    for s in payload["shapes"]:
        key = s["key"]
        rows = [r for r in results if r["shape"] == key and r.get("us")]
        default = next((r for r in rows if r["phase"] == "default"), None)
        best = min(rows, key=lambda r: r["us"]) if rows else None
        fi_us = (fi.get(key) or {}).get("best_us")
        d_us, b_us = (default or {}).get("us"), (best or {}).get("us")
        out.append(
            [
                key,
                fmt(s["kv_mib"], 0),
                fmt(d_us),
                config_text(default),
                fmt(b_us),
                fmt((best or {}).get("pct_copy")),
                config_text(best),
                fmt(d_us / b_us, 2) if d_us and b_us else "—",
                f"{fmt(fi_us)} ({(fi.get(key) or {}).get('best_path') or '—'})",
                fmt(d_us / fi_us, 3) if d_us and fi_us else "—",
                fmt(b_us / fi_us, 3) if b_us and fi_us else "—",
                fmt(s["bf16_default_us"] / b_us, 2) if s.get("bf16_default_us") and b_us else "—",
                str(len(rows)),
            ]
        )
    return out


SUMMARY_COLUMNS = [
    "shape",
    "KV MiB",
    "default us",
    "default config",
    "best us",
    "best % copy",
    "best config",
    "default / best",
    "FI best us (path)",
    "default / FI",
    "best / FI",
    "bf16 / best",
    "timed",
]


def tile_ranking(results: list[dict[str, Any]], top: int = 8) -> list[list[str]]:
    """Tile configurations timed on every shape of the tile phase, ranked by the geometric mean
    of time / that shape's best tile time."""
    tiles = [r for r in results if r["phase"] == "tile" and r.get("us")]
    best: dict[str, float] = {}
    for r in tiles:
        best[r["shape"]] = min(best.get(r["shape"], float("inf")), r["us"])
    rel: dict[tuple, list[float]] = {}
    for r in tiles:
        cfg = (r["block_n"], r["num_warps"], r["num_stages"])
        rel.setdefault(cfg, []).append(r["us"] / best[r["shape"]])
    full = [(k, v) for k, v in rel.items() if len(v) == len(best)]
    full.sort(key=lambda kv: geomean(kv[1]))
    return [[*map(str, k), fmt(geomean(v), 3), fmt(max(v), 3)] for k, v in full[:top]]


def render(payload: dict[str, Any]) -> str:
    a = payload["args"]
    errors = [r for r in payload["results"] if r.get("error")]
    diffs = [r["max_diff_vs_default"] for r in payload["results"] if "max_diff_vs_default" in r]
    lines = [
        "# Decode kernel tuning sweep: "
        + ("FP8 e4m3 KV" if a.get("fp8") else "the weak shapes of issue 10"),
        "",
        environment_markdown(payload["environment"]),
        f"- dtype {a['dtype']}"
        + (
            " (q), KV float8_e4m3fn ('bf16 / best': the bf16 cache's "
            "default plan against the best FP8 configuration)"
            if a.get("fp8")
            else ""
        )
        + f", page {a['page']}; graph-timed: {a['calls']} calls per CUDA graph, "
        f"median replay / calls (do_bench, warmup {a['warmup']} ms, rep {a['rep']} ms); "
        f"'% copy' against {a['copy_tbs']} TB/s; {len(payload['results'])} timings in "
        f"{payload['elapsed_s']:.0f} s (budget {a['budget_s']:.0f} s)",
        "- FlashInfer: "
        + (
            "best of HND/NHD x tensor-core/CUDA-core"
            if not payload.get("flashinfer_error")
            else f"**MISSING** ({payload['flashinfer_error']})"
        ),
        f"- largest output difference from the default plan: {fmt(max(diffs, default=None), 4)}; "
        f"{len(errors)} configurations failed",
        "- config: `bn` tokens per iteration, `w` warps, `s` pipeline stages, then the split: "
        "`auto` (the plan's), `splits=N` forced, `pps=N` heuristic at N programs per SM, "
        "`programs=N` split-path grid of N persistent programs, `persist=N` one split per request "
        "through a persistent grid of N programs (plus an idle merge launch)",
        "",
        "## Best configuration per shape",
        "",
        markdown_table(SUMMARY_COLUMNS, summary_rows(payload)),
        "",
        *(
            [
                "## FP8 kernel variants at the default split (compute/staging[/bytes])",
                "",
                markdown_table(
                    ["shape", "variant", "tile", "us", "% copy", "/ default", "error"],
                    fp8_variant_rows(payload),
                ),
                "",
            ]
            if a.get("fp8")
            else []
        ),
        "## Tiles that suit every shape (time / the shape's best tile, at its best split)",
        "",
        markdown_table(
            ["block_n", "warps", "stages", "geomean", "worst"], tile_ranking(payload["results"])
        ),
    ]
    if errors:
        lines += ["", "## Failed configurations", ""]
        lines += [
            f"- {r['shape']} {config_text(r) if r.get('block_n') else r['split']}: {r['error']}"
            for r in errors[:20]
        ]
    return "\n".join(lines)


def plan_facts(head: str, shape: Shape, page: int, kv_dtype=None) -> dict[str, Any]:
    """What the default plan does with one shape on this machine's SM count (the H200's 132 on
    a CPU-only machine): the launch's tile and split, and the numbers the proposals in the
    tuning report are about: work items per SM, the largest item against an SM's mean share,
    and the split path's partial-output traffic against the KV bytes."""
    hq, hkv, d = parse_heads(head)
    dtype = DTYPES["bf16"]
    plan = plan_decode(
        shape.batch,
        hq,
        hkv,
        d,
        page,
        shape.max_len,
        dtype,
        "cpu",
        total_tokens=shape.total_tokens,
        kv_dtype=kv_dtype,
    )
    sms, tps = plan.sm_count, plan.tokens_per_split
    if plan.uses_split:  # as the kernel deals them: ceil(len / tps) splits, the last takes the rest
        counts = [min(max(-(-n // tps), 1), plan.num_splits) for n in shape.lens]
        sizes = [
            n - tps * (c - 1) if i == c - 1 else tps
            for n, c in zip(shape.lens, counts, strict=True)
            for i in range(c)
        ]
        merged = sum(c for c in counts if c > 1)
    else:
        sizes, merged = list(shape.lens), 0
    items = len(sizes) * hkv
    elem = 1 if kv_dtype is not None else 2
    kv = kv_bytes(shape.lens, hkv, d, elem)
    per_sm = shape.total_tokens * hkv / sms  # token-heads of an SM's mean share
    return {
        "shape": shape_key(head, shape, page),
        "split": plan.uses_split,
        "splits": plan.num_splits,
        "tokens_per_split": tps,
        "block_n": plan.block_n,
        "warps": plan.num_warps,
        "stages": plan.num_stages,
        "programs": plan.num_programs if plan.uses_split else items,
        "items": items,
        "items_per_sm": items / sms,
        # > 1: whole waves of programs cannot be even (e.g. 1.45 per SM -> some SMs do 2)
        "wave_ratio": -(-items // sms) / (items / sms),
        "largest_item_vs_sm_share": max(sizes) / per_sm,
        # partial outputs written by stage 1 and read by the merge (float32, D + 1 per row)
        "partial_traffic": merged * hq * (d + 1) * 4 * 2 / kv if kv else 0.0,
        "fp8": f"{plan.fp8_compute}/{plan.fp8_staging}" if plan.fp8_compute else "—",
    }


PLAN_COLUMNS = [
    "shape",
    "split",
    "splits",
    "tokens/split",
    "block_n",
    "warps",
    "stages",
    "programs",
    "items",
    "items/SM",
    "waves ceil/mean",
    "largest item / SM share",
    "partials / KV bytes",
    "FP8 compute/staging",
]


def plans_markdown(facts: list[dict[str, Any]]) -> str:
    rows = [
        [
            f["shape"],
            "yes" if f["split"] else "no",
            str(f["splits"]),
            str(f["tokens_per_split"]),
            str(f["block_n"]),
            str(f["warps"]),
            str(f["stages"]),
            str(f["programs"]),
            str(f["items"]),
            fmt(f["items_per_sm"], 2),
            fmt(f["wave_ratio"], 2),
            fmt(f["largest_item_vs_sm_share"], 2),
            fmt(f["partial_traffic"], 3),
            f["fp8"],
        ]
        for f in facts
    ]
    return markdown_table(PLAN_COLUMNS, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        nargs="*",
        default=None,
        help="B=1024, a full label, a kind (short, ragged, skewed) or HEADS@LABEL (default: all)",
    )
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--warmup", type=float, default=5)
    p.add_argument("--rep", type=float, default=20)
    p.add_argument("--copy-tbs", type=float, default=4.27, help="copy ceiling for '%% copy'")
    p.add_argument("--budget-s", type=float, default=200, help="stop timing after this")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--fp8", action="store_true", help="FP8 e4m3 KV on its own shapes")
    p.add_argument(
        "--plans",
        action="store_true",
        help="no timing (no GPU needed): print what the default plan does with each shape",
    )
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="decode_tuning")
    args = p.parse_args(argv)
    if args.calls < 1:
        raise SystemExit("--calls must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plans:
        shapes = FP8_SHAPES if args.fp8 else WEAK_SHAPES
        facts = [
            plan_facts(h, s, args.page, FP8 if args.fp8 else None)
            for h, s in shapes
            if not args.shapes or any(shape_matches(x, h, s) for x in args.shapes)
        ]
        print(plans_markdown(facts))
        return 0
    if not torch.cuda.is_available():
        print("tune_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
