"""Tuning sweep of the paged decode kernel: tile shape, warps, pipeline depth and splits.

Every (head config, shape) of the decode matrix can be timed under every kernel configuration
and split choice, each as one CUDA-graph replay (the kernels' own time). Compilation dominates a
sweep, so the configurations are first compiled in parallel worker processes (Triton's on-disk
cache then serves the timing process). Writes ``<name>.md`` + ``.json`` with the best
configuration per shape, the register/shared-memory footprint of each compiled variant, and the
host-side cost of one ``decode()`` call.

    PYTHONPATH=. python3 benchmarks/tune_decode.py --heads 32/8/128 --shapes B=1 B=32 skewed
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bench_us,
    cuda_graph_of,
    environment,
    environment_markdown,
    fmt,
    geomean,
    markdown_table,
    write_results,
)
from benchmarks.bench_decode import DTYPES, Case, cases, parse_heads


def split_label(spec: tuple[str, int]) -> str:
    kind, n = spec
    return f"{kind}={n}"


def plan_overrides(cfg: dict, spec: tuple[str, int]) -> dict:
    kind, n = spec
    extra = {"pps": {"programs_per_sm": n}, "splits": {"num_splits": n}}.get(kind, {})
    return {**cfg, **extra}


def shape_matches(spec: str, head: str, label: str) -> bool:
    """``B=1``, a full label, or ``HEADS@B=1`` (that shape for that head config only)."""
    if "@" in spec:
        spec_head, spec = spec.split("@", 1)
        if spec_head != head:
            return False
    return label == spec or label.split(" ")[0] == spec


def build_jobs(args) -> list[tuple]:
    # an empty list means "the plan's own choice" for that knob
    configs = [
        {k: v for k, v in (("block_n", bn), ("num_warps", w), ("num_stages", s)) if v}
        for bn, w, s in itertools.product(
            args.block_n or [None], args.warps or [None], args.stages or [None]
        )
    ]
    specs = [("auto", 0)] * args.auto
    specs += [("pps", n) for n in args.pps] + [("splits", n) for n in args.splits]
    jobs = []
    for head in args.heads:
        for page in args.pages:
            for label, _ in cases():
                if not any(shape_matches(s, head, label) for s in args.shapes):
                    continue
                for cfg in configs:
                    for spec in specs:
                        jobs.append((head, page, label, cfg, spec))
    return jobs


def make_case(head: str, page: int, label: str, dtype: torch.dtype) -> Case:
    hq, hkv, d = parse_heads(head)
    lens = dict(cases())[label]
    return Case(lens, hq, hkv, d, page, dtype)


def _compile_worker(jobs: list[tuple], dtype_name: str) -> int:
    """Launch each job once so that Triton compiles (and caches on disk) its variant."""
    torch.cuda.init()
    built: dict[tuple, Case] = {}
    done = 0
    for head, page, label, cfg, spec in jobs:
        key = (head, page, label)
        if key not in built:
            built.clear()
            torch.cuda.empty_cache()
            built[key] = make_case(head, page, label, DTYPES[dtype_name])
        try:
            _, _, launch = built[key].flashdec_fns(**plan_overrides(cfg, spec))
            launch()
            done += 1
        except Exception as exc:  # reported again (and skipped) by the timing pass
            print(f"compile failed {head} {label} {cfg} {spec}: {exc}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple], dtype_name: str, workers: int) -> None:
    if workers <= 1:
        return
    chunks = [jobs[i::workers] for i in range(workers)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        done = pool.starmap(_compile_worker, [(c, dtype_name) for c in chunks])
    print(f"precompiled {sum(done)} launches in {time.time() - t0:.0f} s", flush=True)


def compiled_variants() -> list[dict]:
    """Registers, spills and shared memory of every compiled decode kernel variant."""
    from flashdec.kernels.paged_decode import _decode_kernel

    out = []
    for cache in getattr(_decode_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kernel in getattr(kernels, "values", lambda: [])():
            meta = getattr(kernel, "metadata", None)
            constants = getattr(getattr(kernel, "src", None), "constants", {}) or {}
            ptx = kernel.asm.get("ptx", "") if hasattr(kernel, "asm") else ""
            out.append(
                {
                    "constants": {str(k): str(v) for k, v in constants.items()},
                    "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                    "shared_bytes": getattr(meta, "shared", None),
                    "registers": getattr(kernel, "n_regs", None),
                    "spills": getattr(kernel, "n_spills", None),
                    "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                    "ld_global": ptx.count("ld.global"),
                }
            )
    return out


def host_overhead(case: Case, calls: int = 200) -> dict:
    """Host microseconds per call: decode(workspace=...) (checked) vs launch_decode (trusted)."""
    plan, api, launch = case.flashdec_fns()
    result = {}
    for name, fn in (("decode", api), ("launch_decode", launch)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        result[name] = host
    result["splits"] = plan.num_splits
    return result


def run(args) -> None:
    env = environment()
    jobs = build_jobs(args)
    print(f"{len(jobs)} timing jobs", flush=True)
    precompile(jobs, args.dtype, args.workers)
    t0 = time.time()
    results: list[dict] = []
    case_key, case, expected = None, None, None
    # one JSON line per timing as it completes: a run cut short still leaves its data
    progress = Path(args.out_dir) / f"{args.name}.jsonl"
    progress.parent.mkdir(parents=True, exist_ok=True)
    progress.write_text("")
    for head, page, label, cfg, spec in jobs:
        if time.time() - t0 > args.budget_s:
            print("time budget reached: stopping", flush=True)
            break
        if case_key != (head, page, label):
            case = None
            torch.cuda.empty_cache()
            case_key, case = (head, page, label), make_case(head, page, label, DTYPES[args.dtype])
            expected = case.flashdec_fns()[2]().float().clone()  # the default configuration
        row = {"heads": head, "page": page, "shape": label, **cfg, "split": split_label(spec)}
        try:
            plan, _, launch = case.flashdec_fns(**plan_overrides(cfg, spec))
            us = bench_us(cuda_graph_of(launch).replay, args.warmup, args.rep)
            diff = (launch().float() - expected).abs().max().item()
            row.update(splits=plan.num_splits, tokens_per_split=plan.tokens_per_split, us=us)
            row.update(block_n=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages)
            row["max_diff_vs_default"] = diff
            row["pct_copy"] = 100 * case.kv_bytes / (us * 1e-6) / 1e12 / args.copy_tbs
        except Exception as exc:
            torch.cuda.synchronize()
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        results.append(row)
        with progress.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{head} p{page} {label:<24} {cfg} {split_label(spec):<10} "
            f"splits={row.get('splits')} {fmt(row.get('us'))} us "
            f"{fmt(row.get('pct_copy'))}% diff={fmt(row.get('max_diff_vs_default'), 4)} "
            f"{row.get('error', '')}",
            flush=True,
        )
    overhead = host_overhead(make_case("32/8/128", 16, "B=1 L=32768", DTYPES[args.dtype]))
    print(f"host overhead per call: {overhead}", flush=True)
    write(args, env, results, compiled_variants(), overhead)


def best_per_shape(results: list[dict]) -> list[list]:
    rows = []
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if r.get("us"):
            groups.setdefault((r["heads"], r["page"], r["shape"]), []).append(r)
    for (head, page, shape), rs in groups.items():
        rs.sort(key=lambda r: r["us"])
        best = rs[0]
        rows.append(
            [
                head,
                page,
                shape,
                best["us"],
                best["pct_copy"],
                best["block_n"],
                best["num_warps"],
                best["num_stages"],
                best["split"],
                best["splits"],
                " / ".join(f"{r['us']:.1f}" for r in rs[1:4]),
            ]
        )
    return rows


def best_configs(results: list[dict], top: int = 8) -> list[list]:
    """Configurations ranked by geometric-mean time relative to each shape's best."""
    best = {}
    for r in results:
        if r.get("us"):
            key = (r["heads"], r["page"], r["shape"])
            best[key] = min(best.get(key, float("inf")), r["us"])
    rel: dict[tuple, list[float]] = {}
    for r in results:
        if r.get("us"):
            cfg = (r["block_n"], r["num_warps"], r["num_stages"], r["split"])
            rel.setdefault(cfg, []).append(r["us"] / best[(r["heads"], r["page"], r["shape"])])
    shapes = len(best)
    ranked = sorted(
        ((k, v) for k, v in rel.items() if len(v) == shapes), key=lambda kv: geomean(kv[1])
    )
    return [[*k, geomean(v), max(v)] for k, v in ranked[:top]]


def write(args, env, results, variants, overhead) -> None:
    lines = ["# Decode kernel tuning sweep", "", environment_markdown(env), ""]
    lines += [
        f"- dtype {args.dtype}; times: CUDA-graph replay, median of do_bench "
        f"(warmup {args.warmup} ms, rep {args.rep} ms, L2 flushed); '% copy' against "
        f"{args.copy_tbs} TB/s",
        "",
        "## Best configuration per shape",
        "",
        markdown_table(
            [
                "heads",
                "page",
                "shape",
                "us",
                "% copy",
                "block_n",
                "warps",
                "stages",
                "split",
                "splits",
                "next best us",
            ],
            best_per_shape(results),
        ),
        "",
        "## Configurations that suit every shape (time / shape's best)",
        "",
        markdown_table(
            ["block_n", "warps", "stages", "split", "geomean", "worst"],
            best_configs(results),
        ),
        "",
        f"## Host cost of one call (B=1 L=32768): {overhead}",
    ]
    payload = {
        "environment": env,
        "args": vars(args),
        "results": results,
        "variants": variants,
        "host_overhead_us": overhead,
    }
    write_results(args.name, "\n".join(lines), payload, Path(args.out_dir))
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", nargs="+", default=["32/8/128"])
    p.add_argument("--pages", nargs="+", type=int, default=[16])
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["B=1", "B=32", "skewed"],
        help="shape labels (B=1, skewed, ...), or HEADS@LABEL for one head config only",
    )
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--block-n", nargs="*", type=int, default=[], help="default: the plan's")
    p.add_argument("--warps", nargs="*", type=int, default=[], help="default: the plan's")
    p.add_argument("--stages", nargs="*", type=int, default=[], help="default: the plan's")
    p.add_argument(
        "--auto", type=int, default=1, choices=[0, 1], help="time the plan's own split choice"
    )
    p.add_argument("--pps", nargs="*", type=int, default=[], help="programs per SM")
    p.add_argument("--splits", nargs="*", type=int, default=[], help="forced split counts")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--warmup", type=float, default=5)
    p.add_argument("--rep", type=float, default=20)
    p.add_argument("--copy-tbs", type=float, default=4.27, help="copy ceiling for '% copy'")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop timing after this")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="decode_tuning")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
