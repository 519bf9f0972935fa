"""Paged decode attention: FlashDec vs FlashInfer (CUDA-core and tensor-core paths) vs gather+SDPA.

All implementations read the same token-major cache tensors ``[pages, Hkv, page, D]`` (FlashInfer's
"HND" layout), random data, random page ids, in one process. Times are medians of
``triton.testing.do_bench`` (L2 flushed before each call). FlashDec is timed through its planned
path (``plan_decode`` once, then ``decode(..., workspace=ws)`` per call), the counterpart of
FlashInfer's ``plan()`` / ``run()``.

    PYTHONPATH=. python3 benchmarks/bench_decode.py                 # full matrix
    PYTHONPATH=. python3 benchmarks/tune_decode.py                  # tile/split tuning sweep
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    bench_us,
    copy_ceiling_tbs,
    cuda_graph_of,
    environment,
    environment_markdown,
    fmt,
    geomean,
    markdown_table,
    read_ceiling_tbs,
    write_results,
)
from flashdec.kernels import decode, launch_decode, plan_decode

SHAPES = [
    (1, 32768),
    (8, 8192),
    (16, 16384),
    (32, 4096),
    (64, 2048),
    (128, 1024),
    (256, 512),
    (512, 256),
]
SKEWED = [32768] + [1024] * 63
UNIFORM_SAME_BYTES = [sum(SKEWED) // 64] * 64
HEADS = ["32/8/128", "32/32/128", "32/4/128", "64/8/128", "32/8/64", "32/1/128"]
PRIMARY = "32/8/128"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cases() -> list[tuple[str, list[int]]]:
    out = [(f"B={b} L={n}", [n] * b) for b, n in SHAPES]
    out.append(("skewed 1x32768+63x1024", SKEWED))
    out.append((f"uniform 64x{UNIFORM_SAME_BYTES[0]}", UNIFORM_SAME_BYTES))
    return out


class Case:
    """One problem: a random paged cache, its block table and FlashInfer's page arrays."""

    def __init__(self, lens, hq, hkv, d, page, dtype, seed=0, device="cuda"):
        dev = self.device = torch.device(device)
        torch.manual_seed(seed)
        self.lens_list = lens
        self.batch = len(lens)
        self.hq, self.hkv, self.d, self.page, self.dtype = hq, hkv, d, page, dtype
        pages = torch.tensor([math.ceil(n / page) for n in lens], device=dev)
        total_pages = int(pages.sum())
        max_pages = int(pages.max())
        perm = torch.randperm(total_pages + 1, device=dev, dtype=torch.int32)
        self.k = torch.randn(total_pages + 1, hkv, page, d, device=dev, dtype=dtype)
        self.v = torch.randn_like(self.k)
        self.tables = torch.zeros(self.batch, max_pages, dtype=torch.int32, device=dev)
        used = torch.arange(max_pages, device=dev)[None, :] < pages[:, None]
        self.indices = perm[:total_pages].contiguous()
        self.tables[used] = self.indices
        self.lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.indptr = torch.zeros(self.batch + 1, dtype=torch.int32, device=dev)
        self.indptr[1:] = torch.cumsum(pages, 0)
        self.last_page_len = (self.lens - (pages.int() - 1) * page).int()
        self.q = torch.randn(self.batch, hq, d, device=dev, dtype=dtype)
        self.kv_bytes = sum(lens) * hkv * d * 2 * self.k.element_size()
        self.max_len = max(lens)

    def plan(self, **overrides):
        return plan_decode(
            self.batch,
            self.hq,
            self.hkv,
            self.d,
            self.page,
            self.max_len,
            self.dtype,
            self.device,
            total_tokens=sum(self.lens_list),
            **overrides,
        )

    def flashdec_fns(self, **overrides):
        plan = self.plan(**overrides)
        ws = plan.allocate_workspace()
        q, k, v, t, lens = self.q, self.k, self.v, self.tables, self.lens
        scale = self.d**-0.5

        def api():
            return decode(q, k, v, t, lens, workspace=ws)

        def launch():
            return launch_decode(
                q, k, v, t, lens, scale, plan, ws.out, ws.partial_out, ws.partial_lse, self.batch
            )

        return plan, api, launch

    def flashinfer_fn(self, flashinfer, tensor_cores: bool, workspace: torch.Tensor):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=tensor_cores
        )
        wrapper.plan(
            self.indptr,
            self.indices,
            self.last_page_len,
            self.hq,
            self.hkv,
            self.d,
            self.page,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return lambda: wrapper.run(self.q, (self.k, self.v))

    def sdpa_fn(self):
        uniform = len(set(self.lens_list)) == 1 and self.max_len % self.page == 0
        b, hkv, d = self.batch, self.hkv, self.d
        idx = self.tables.long()
        length = idx.shape[1] * self.page
        mask = None
        if not uniform:
            mask = torch.arange(length, device=self.device)[None, :] < self.lens[:, None]
            mask = mask[:, None, None, :]

        def run():
            k = self.k[idx].permute(0, 2, 1, 3, 4).reshape(b, hkv, length, d)
            v = self.v[idx].permute(0, 2, 1, 3, 4).reshape(b, hkv, length, d)
            out = torch.nn.functional.scaled_dot_product_attention(
                self.q[:, :, None, :], k, v, attn_mask=mask, enable_gqa=self.hq != hkv
            )
            return out[:, :, 0]

        return run


def load_flashinfer():
    try:
        import flashinfer

        return flashinfer, None
    except Exception as exc:  # missing wheel, failed JIT set-up, ...
        return None, f"{type(exc).__name__}: {exc}"


def parse_heads(spec: str) -> tuple[int, int, int]:
    hq, hkv, d = (int(x) for x in spec.split("/"))
    return hq, hkv, d


def time_graph_or_error(fn, warmup, rep):
    try:
        graph = cuda_graph_of(fn)
        return time_or_error(graph.replay, warmup, rep)
    except Exception as exc:
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def time_or_error(fn, warmup, rep):
    try:
        fn()
        torch.cuda.synchronize()
        return bench_us(fn, warmup, rep), None
    except Exception as exc:
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def run_matrix(args, flashinfer, fi_error, env, ceilings) -> list[dict]:
    rows: list[dict] = []
    fi_ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda") if flashinfer else None
    t0 = time.time()
    plan_list = []
    for dname in args.dtypes:
        first = dname == args.dtypes[0]
        heads = args.heads if first else (args.heads_other_dtypes or args.heads)
        pages = args.pages if first else (args.pages_other_dtypes or args.pages)
        plan_list += [(dname, h, p) for h in heads for p in pages]
    for dname, head, page in plan_list:
        hq, hkv, d = parse_heads(head)
        for label, lens in cases():
            if args.shapes and label.split(" ")[0] not in args.shapes and label not in args.shapes:
                continue
            if time.time() - t0 > args.budget_s:
                print(f"[budget] skipping {dname} {head} page {page} {label}", flush=True)
                continue
            case = Case(lens, hq, hkv, d, page, DTYPES[dname])
            row = {
                "dtype": dname,
                "heads": head,
                "page": page,
                "shape": label,
                "kv_mib": case.kv_bytes / 2**20,
            }
            plan, api, launch = case.flashdec_fns()
            row["plan"] = {
                "splits": plan.num_splits,
                "tokens_per_split": plan.tokens_per_split,
                "block_n": plan.block_n,
                "warps": plan.num_warps,
                "stages": plan.num_stages,
            }
            row["flashdec_us"], row["flashdec_error"] = time_or_error(api, args.warmup, args.rep)
            row["flashdec_launch_us"], _ = time_or_error(launch, args.warmup, args.rep)
            row["flashdec_graph_us"], row["flashdec_graph_error"] = time_graph_or_error(
                api, args.warmup, args.rep
            )
            ref = None
            if flashinfer is not None:
                for key, tc in (("fi_tc", True), ("fi_cc", False)):
                    try:
                        fn = case.flashinfer_fn(flashinfer, tc, fi_ws)
                    except Exception as exc:
                        row[f"{key}_us"], row[f"{key}_error"] = None, f"{type(exc).__name__}: {exc}"
                        continue
                    row[f"{key}_us"], row[f"{key}_error"] = time_or_error(fn, args.warmup, args.rep)
                    if row[f"{key}_us"] is not None:
                        row[f"{key}_graph_us"], _ = time_graph_or_error(fn, args.warmup, args.rep)
                    if ref is None and row[f"{key}_us"] is not None:
                        ref = fn().float()
            else:
                row["fi_tc_us"] = row["fi_cc_us"] = None
                row["fi_tc_error"] = row["fi_cc_error"] = fi_error
            if not args.no_sdpa:
                fn = case.sdpa_fn()
                row["sdpa_us"], row["sdpa_error"] = time_or_error(fn, args.warmup, args.rep)
                if ref is None and row["sdpa_us"] is not None:
                    ref = fn().float()
            if ref is not None and row["flashdec_us"] is not None:
                row["max_abs_diff_vs_peer"] = (api().float() - ref).abs().max().item()
            us = row["flashdec_us"]
            if us:
                row["tbs"] = case.kv_bytes / (us * 1e-6) / 1e12
                row["pct_copy"] = 100 * row["tbs"] / ceilings["copy_tbs"]
                row["pct_read"] = 100 * row["tbs"] / ceilings["read_tbs"]
            fis = [row.get("fi_tc_us"), row.get("fi_cc_us")]
            best = min([x for x in fis if x], default=None)
            row["ratio_vs_fi_tc"] = us / row["fi_tc_us"] if us and row.get("fi_tc_us") else None
            row["ratio_vs_best_fi"] = us / best if us and best else None
            g_us, g_fi = row.get("flashdec_graph_us"), row.get("fi_tc_graph_us")
            g_best = min([x for x in (g_fi, row.get("fi_cc_graph_us")) if x], default=None)
            row["graph_ratio_vs_fi_tc"] = g_us / g_fi if g_us and g_fi else None
            row["graph_ratio_vs_best_fi"] = g_us / g_best if g_us and g_best else None
            if g_us:
                row["graph_pct_copy"] = (
                    100 * case.kv_bytes / (g_us * 1e-6) / 1e12 / ceilings["copy_tbs"]
                )
            rows.append(row)
            print(
                f"{dname} {head:>9} p{page:<3} {label:<24} {fmt(row['kv_mib'], 0):>6} MiB  "
                f"FD {fmt(us):>7} us ({fmt(row.get('pct_copy'))}%)  "
                f"launch {fmt(row['flashdec_launch_us'])}  FI-tc {fmt(row.get('fi_tc_us'))}  "
                f"FI-cc {fmt(row.get('fi_cc_us'))}  SDPA {fmt(row.get('sdpa_us'))}  "
                f"x{fmt(row['ratio_vs_best_fi'], 2)}  splits {plan.num_splits}  | graph FD "
                f"{fmt(row.get('flashdec_graph_us'))} ({fmt(row.get('graph_pct_copy'))}%) FI-tc "
                f"{fmt(row.get('fi_tc_graph_us'))} x{fmt(row.get('graph_ratio_vs_fi_tc'), 2)}",
                flush=True,
            )
            del case
            torch.cuda.empty_cache()
        write_decode_results(args, env, ceilings, rows, fi_error, partial=True)
    return rows


MODES = [
    # (name, FlashDec time, FlashInfer-tc time, ratio vs tc, ratio vs best FI, % of copy)
    ("eager", "flashdec_us", "fi_tc_us", "ratio_vs_fi_tc", "ratio_vs_best_fi", "pct_copy"),
    ("CUDA graph", "flashdec_graph_us", "fi_tc_graph_us", "graph_ratio_vs_fi_tc",
     "graph_ratio_vs_best_fi", "graph_pct_copy"),
]  # fmt: skip


def summarize(rows: list[dict], ceilings: dict) -> list[str]:
    lines = []
    prim = [r for r in rows if r["dtype"] == "bf16" and r["heads"] == PRIMARY]
    for mode, fd, fi, r_tc, r_best, pct in MODES:
        lines.append(f"- **{mode} timings**")
        ratios = [r[r_tc] for r in prim if r.get(r_tc)]
        if ratios:
            worst = max(prim, key=lambda r: r.get(r_tc) or 0)
            lines.append(
                f"  - bf16 {PRIMARY} vs FlashInfer tensor-core: worst ratio {max(ratios):.3f} "
                f"({worst['shape']}, page {worst['page']}), geometric mean "
                f"{geomean(ratios):.3f} over {len(ratios)} shapes (target <= 1.00 each, "
                "<= 0.95 geomean)"
            )
        big = [r[pct] for r in prim if r.get(pct) and r["kv_mib"] >= 512]
        if big:
            lines.append(
                f"  - bf16 {PRIMARY}, KV >= 512 MiB: {min(big):.1f}-{max(big):.1f}% of copy "
                "bandwidth (target >= 90%)"
            )
        b1 = [r[pct] for r in prim if r["shape"] == "B=1 L=32768" and r.get(pct)]
        if b1:
            lines.append(
                f"  - bf16 {PRIMARY}, B=1 L=32768: {', '.join(f'{x:.1f}%' for x in b1)} "
                "of copy bandwidth (target >= 75%)"
            )
        for r in rows:
            if not r["shape"].startswith("skewed"):
                continue
            uni = [
                u
                for u in rows
                if u["shape"].startswith("uniform")
                and (u["dtype"], u["heads"], u["page"]) == (r["dtype"], r["heads"], r["page"])
            ]
            if uni and uni[0].get(fd) and r.get(fd):
                peer = ""
                if r.get(fi) and uni[0].get(fi):
                    peer = f"; FlashInfer-tc {r[fi]:.0f} vs {uni[0][fi]:.0f} us"
                lines.append(
                    f"  - skewed vs uniform ({r['dtype']} {r['heads']} page {r['page']}): "
                    f"FlashDec {r[fd]:.0f} vs {uni[0][fd]:.0f} us (x{r[fd] / uni[0][fd]:.2f}, "
                    f"target <= 1.10){peer}"
                )
        losses = [r for r in rows if r.get(r_best) and r[r_best] > 1.0]
        lines.append(
            f"  - shapes where FlashDec is slower than FlashInfer's faster path: {len(losses)} "
            f"of {sum(1 for r in rows if r.get(r_best))}"
        )
        for r in sorted(losses, key=lambda r: -r[r_best])[:20]:
            lines.append(
                f"    - {r['dtype']} {r['heads']} page {r['page']} {r['shape']}: x{r[r_best]:.3f}"
            )
        rs = [r[r_best] for r in rows if r.get(r_best)]
        if rs:
            lines.append(
                f"  - all shapes: geometric mean FlashDec / best FlashInfer {geomean(rs):.3f}"
            )
    fi_fail = [r for r in rows if r.get("fi_tc_error") or r.get("fi_cc_error")]
    lines.append(
        f"- FlashInfer failed (either path) on {len(fi_fail)} of {len(rows)} shapes; FlashDec on "
        f"{sum(1 for r in rows if r.get('flashdec_error'))}"
    )
    return lines


def write_decode_results(args, env, ceilings, rows, fi_error, partial=False) -> None:
    out_dir = Path(args.out_dir)
    columns = [
        "dtype",
        "heads q/kv/d",
        "page",
        "shape",
        "KV MiB",
        "FlashDec us",
        "TB/s",
        "% copy",
        "% read",
        "FI-tc us",
        "FI-cc us",
        "SDPA us",
        "FD/FI-tc",
        "FD/best FI",
        "graph: FD us",
        "graph: FI-tc us",
        "graph: FD/FI-tc",
        "graph: % copy",
        "splits",
        "max |diff|",
    ]
    table = []
    for r in rows:
        table.append(
            [
                r["dtype"],
                r["heads"],
                str(r["page"]),
                r["shape"],
                fmt(r["kv_mib"], 0),
                fmt(r.get("flashdec_us")),
                fmt(r.get("tbs"), 2),
                fmt(r.get("pct_copy")),
                fmt(r.get("pct_read")),
                fmt(r.get("fi_tc_us")) if not r.get("fi_tc_error") else "fail",
                fmt(r.get("fi_cc_us")) if not r.get("fi_cc_error") else "fail",
                fmt(r.get("sdpa_us")),
                fmt(r.get("ratio_vs_fi_tc"), 3),
                fmt(r.get("ratio_vs_best_fi"), 3),
                fmt(r.get("flashdec_graph_us")),
                fmt(r.get("fi_tc_graph_us")),
                fmt(r.get("graph_ratio_vs_fi_tc"), 3),
                fmt(r.get("graph_pct_copy")),
                str(r["plan"]["splits"]),
                fmt(r.get("max_abs_diff_vs_peer"), 4),
            ]
        )
    md = [
        "# Paged decode attention: FlashDec vs FlashInfer vs gather+SDPA",
        "",
        environment_markdown(env),
        f"- ceilings: device-to-device copy {ceilings['copy_tbs']:.2f} TB/s (read+write), "
        f"read-only (torch.sum) {ceilings['read_tbs']:.2f} TB/s",
        f"- FlashInfer: {'present' if not fi_error else 'MISSING (' + fi_error + ')'}",
        f"- timing: median of triton.testing.do_bench (warmup {args.warmup} ms, rep "
        f"{args.rep} ms, L2 flushed per call); FlashDec through plan_decode + "
        "decode(workspace=...); '% copy' = KV bytes / time / copy ceiling; 'graph' columns "
        "time one call captured in a CUDA graph (replay), which removes the Python launch "
        "overhead of both libraries",
        f"- dtypes: {', '.join(args.dtypes)}; head configs for {args.dtypes[0]}: "
        f"{', '.join(args.heads)}"
        + (
            f"; for other dtypes: {', '.join(args.heads_other_dtypes)}"
            if args.heads_other_dtypes
            else ""
        ),
        "" if not partial else "- **partial results (run still in progress or cut short)**",
        "",
        "## Summary",
        "",
        *summarize(rows, ceilings),
        "",
        "## All shapes",
        "",
        markdown_table(columns, table),
        "",
        "FlashDec 'launch' times (the trusted launcher without the Python checks of decode()) are "
        "in decode.json as flashdec_launch_us.",
    ]
    md_path = out_dir / f"{args.name}.md"
    if getattr(args, "from_json", None) and md_path.exists():
        # a re-render keeps the notes written by hand under the tables
        old = md_path.read_text()
        if "\n## Notes" in old:
            md += ["", old[old.index("\n## Notes") :].strip()]
    keys = ("dtypes", "heads", "heads_other_dtypes", "pages", "pages_other_dtypes", "warmup", "rep")
    payload = {
        "args": {k: vars(args).get(k) for k in keys},
        "environment": env,
        "ceilings": ceilings,
        "flashinfer_error": fi_error,
        "rows": rows,
        "partial": partial,
    }
    write_results(args.name, "\n".join(md), payload, out_dir)
    sel = [r for r in rows if r["heads"] == PRIMARY]
    labels = [f"{r['dtype']} p{r['page']} {r['shape']}" for r in sel]
    cc = ceilings["copy_tbs"]

    def pct(key):
        return [
            100 * r["kv_mib"] * 2**20 / (r[key] * 1e-6) / 1e12 / cc if r.get(key) else None
            for r in sel
        ]

    if sel:
        bar_plot(
            out_dir / f"{args.name}.png",
            labels,
            {
                "FlashDec (CUDA graph)": pct("flashdec_graph_us"),
                "FlashInfer tensor-core (CUDA graph)": pct("fi_tc_graph_us"),
                "FlashDec (eager)": pct("flashdec_us"),
                "FlashInfer tensor-core (eager)": pct("fi_tc_us"),
                "FlashInfer CUDA-core (eager)": pct("fi_cc_us"),
                "gather+SDPA (eager)": pct("sdpa_us"),
            },
            "% of copy bandwidth",
            f"decode {PRIMARY}: % of copy ceiling ({cc:.2f} TB/s)",
            hline=100.0,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(DTYPES))
    p.add_argument("--heads", nargs="+", default=HEADS)
    p.add_argument(
        "--heads-other-dtypes",
        nargs="+",
        default=None,
        help="head configs for dtypes after the first (default: --heads)",
    )
    p.add_argument("--pages", nargs="+", type=int, default=[16, 32])
    p.add_argument(
        "--pages-other-dtypes",
        nargs="+",
        type=int,
        default=None,
        help="page sizes for dtypes after the first (default: --pages)",
    )
    p.add_argument("--shapes", nargs="*", default=None, help="labels such as B=1 or skewed")
    p.add_argument("--warmup", type=float, default=25)
    p.add_argument("--rep", type=float, default=100)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop adding cases after this")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default=None)
    p.add_argument("--from-json", default=None, help="re-render .md/.png from a saved decode.json")
    args = p.parse_args(argv)
    args.name = args.name or "decode"
    if args.from_json:  # no GPU needed: rebuild the report of an earlier run
        import json

        saved = json.loads(Path(args.from_json).read_text())
        run_args = saved.get("args") or {}
        for key, value in run_args.items():
            setattr(args, key, value)
        args.out_dir = (
            str(Path(args.from_json).parent) if args.out_dir == str(RESULTS_DIR) else args.out_dir
        )
        write_decode_results(
            args,
            saved["environment"],
            saved["ceilings"],
            saved["rows"],
            saved.get("flashinfer_error"),
            partial=saved.get("partial", False),
        )
        return 0
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    flashinfer, fi_error = (
        (None, "disabled (--no-flashinfer)") if args.no_flashinfer else load_flashinfer()
    )
    if fi_error:
        print(f"FlashInfer unavailable: {fi_error} — benchmarking without it", flush=True)
    env["flashinfer"] = getattr(flashinfer, "__version__", None)
    ceilings = {"copy_tbs": copy_ceiling_tbs(), "read_tbs": read_ceiling_tbs()}
    print(
        f"ceilings: copy {ceilings['copy_tbs']:.3f} TB/s, read {ceilings['read_tbs']:.3f} TB/s",
        flush=True,
    )
    try:
        rows = run_matrix(args, flashinfer, fi_error, env, ceilings)
    except Exception:
        traceback.print_exc()
        raise
    write_decode_results(args, env, ceilings, rows, fi_error)
    print("\n".join(summarize(rows, ceilings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
