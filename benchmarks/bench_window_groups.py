"""Sliding-window layer groups end to end: decode time and bytes follow the window (with the
released table entries poisoned, and FlashInfer's window as the peer), and memory stays bounded
by the window in a grouped cache. (``bench_window.py`` times the kernel alone, graph-replayed.)

1. **Decode.** For each window ``W`` and batch ``B``, contexts ``L = W .. 32 W``: FlashDec's
   ``decode(..., window=W)`` on a cache that holds only the blocks a windowed request keeps
   (``ceil(W / bs) + 1`` per request). Every table entry before the window points at a block
   filled with NaN, so a kernel that read one would return NaN: the output is checked finite and
   against ``paged_decode_attention_ref(..., window=W)``. Beside it, the same context without a
   window (full attention, every block allocated) while it fits ``--full-max-gib``, and
   FlashInfer's decode with ``window_left = W - 1`` over the window's pages when it is installed
   (the benchmark runs, and says so, without it). Times are medians of
   ``triton.testing.do_bench`` (L2 flushed), eager and replayed from a CUDA graph; bytes are the
   window's K/V (``B * min(L, W) * Hkv * D * 2 * dtype``).
2. **Memory.** A grouped :class:`flashdec.PagedKVCache` (one full and one window layer, each its
   own pool) imports requests up to ``32 W`` tokens; after each import the blocks each request
   holds in each group are read from the cache: the full group's grow with the context, the
   window group's stay at most ``ceil(W / bs) + 1``.

Markdown + JSON (+ PNG) go to ``--out-dir`` (default ``benchmarks/results``), named ``--name``.

    PYTHONPATH=. python3 benchmarks/bench_window_groups.py                          # GPU
    PYTHONPATH=. python3 benchmarks/bench_window_groups.py --smoke --out-dir /tmp/w  # CPU
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    bench_us,
    copy_ceiling_tbs,
    environment,
    environment_markdown,
    fmt,
    graph_us,
    markdown_table,
    use_interpreter_without_gpu,
    write_results,
)

ON_GPU = use_interpreter_without_gpu()  # before flashdec imports Triton

from flashdec import PagedKVCache, paged_decode_attention_ref  # noqa: E402
from flashdec.kernels import decode, plan_decode  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_flashinfer():
    try:
        import flashinfer

        return flashinfer, None
    except Exception as exc:  # missing wheel, failed JIT set-up, ...
        return None, f"{type(exc).__name__}: {exc}"


def time_us(fn, args) -> float:
    """Median device time (GPU), or median wall time of a few calls (CPU smoke runs)."""
    if ON_GPU:
        return bench_us(fn, args.warmup, args.rep)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


class WindowCase:
    """``B`` requests of length ``L`` in a windowed cache: only the blocks of ``[L - W, L)`` are
    allocated (random ids); table entries before them point at block 0, filled with NaN."""

    def __init__(self, batch, length, window, hq, hkv, d, bs, dtype, device, seed=0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.length, self.window = batch, length, window
        self.hq, self.hkv, self.d, self.bs, self.dtype = hq, hkv, d, bs, dtype
        self.first = max(0, length - window) // bs  # first block the window reads
        last = (length - 1) // bs
        self.count = last - self.first + 1  # blocks each request holds
        total = batch * self.count + 1
        shape = (total, hkv, bs, d)
        self.k = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.v = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.k[0] = float("nan")  # the poison block
        self.v[0] = float("nan")
        width = math.ceil(length / bs)
        self.tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
        ids = torch.randperm(total - 1, generator=gen, device=device).to(torch.int32) + 1
        self.tables[:, self.first : last + 1] = ids.view(batch, self.count)
        self.lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, d, generator=gen, device=device).to(dtype)
        elt = self.k.element_size()
        self.window_bytes = batch * min(length, window) * hkv * d * 2 * elt
        self.held_bytes = batch * self.count * bs * hkv * d * 2 * elt
        self.device = device

    def flashdec_fn(self):
        plan = plan_decode(
            self.batch,
            self.hq,
            self.hkv,
            self.d,
            self.bs,
            self.length,
            self.dtype,
            self.device,
            window=self.window,
        )
        ws = plan.allocate_workspace()
        args = (self.q, self.k, self.v, self.tables, self.lens)
        return plan, lambda: decode(*args, workspace=ws, window=self.window)

    def reference(self):
        return paged_decode_attention_ref(
            self.q, self.k, self.v, self.tables, self.lens, window=self.window
        )

    def flashinfer_fn(self, flashinfer, workspace, tensor_cores):
        """FlashInfer over the window's pages only, attending to the last W positions."""
        pages = self.tables[:, self.first : self.first + self.count].reshape(-1).contiguous()
        indptr = torch.arange(self.batch + 1, dtype=torch.int32, device=self.device) * self.count
        last_len = self.length - (self.first + self.count - 1) * self.bs
        last = torch.full((self.batch,), last_len, dtype=torch.int32, device=self.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=tensor_cores
        )
        wrapper.plan(
            indptr,
            pages,
            last,
            self.hq,
            self.hkv,
            self.d,
            self.bs,
            window_left=self.window - 1,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return lambda: wrapper.run(self.q, (self.k, self.v))


def full_fn(batch, length, hq, hkv, d, bs, dtype, device):
    """The same context with full attention: every block allocated and read."""
    pages = math.ceil(length / bs)
    k = torch.randn(batch * pages, hkv, bs, d, device=device).to(dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(batch * pages, device=device).to(torch.int32)
    tables = perm.view(batch, pages)
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device).to(dtype)
    plan = plan_decode(batch, hq, hkv, d, bs, length, dtype, device)
    ws = plan.allocate_workspace()
    return lambda: decode(q, k, v, tables, lens, workspace=ws)


def decode_rows(args, flashinfer, ceiling) -> list[dict]:
    hq, hkv, d = (int(x) for x in args.heads.split("/"))
    dtype, device = DTYPES[args.dtype], "cuda" if ON_GPU else "cpu"
    fi_ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda") if flashinfer else None
    rows = []
    for window in args.windows:
        for batch in args.batches:
            for m in args.multiples:
                length = m * window
                case = WindowCase(batch, length, window, hq, hkv, d, args.page, dtype, device)
                plan, fn = case.flashdec_fn()
                out = fn()
                row = {
                    "window": window,
                    "batch": batch,
                    "multiple": m,
                    "context": length,
                    "blocks_per_request": case.count,
                    "window_mib": case.window_bytes / 2**20,
                    "splits": plan.num_splits,
                }
                row["finite"] = bool(torch.isfinite(out).all())
                row["max_abs_diff_vs_ref"] = (out.float() - case.reference().float()).abs().max()
                row["max_abs_diff_vs_ref"] = float(row["max_abs_diff_vs_ref"])
                row["window_us"] = time_us(fn, args)
                row["window_graph_us"] = graph_us(fn, args.warmup, args.rep) if ON_GPU else None
                if ON_GPU and row["window_us"]:
                    tbs = case.window_bytes / (row["window_us"] * 1e-6) / 1e12
                    row["window_tbs"], row["window_pct_copy"] = tbs, 100 * tbs / ceiling
                full_bytes = batch * length * hkv * d * 2 * case.k.element_size()
                row["full_mib"] = full_bytes / 2**20
                if full_bytes <= args.full_max_gib * 2**30:
                    full = full_fn(batch, length, hq, hkv, d, args.page, dtype, device)
                    row["full_us"] = time_us(full, args)
                    del full
                else:
                    row["full_us"] = None
                if flashinfer is not None:
                    try:
                        fi = case.flashinfer_fn(flashinfer, fi_ws, tensor_cores=True)
                        row["fi_window_us"] = time_us(fi, args)
                        row["fi_max_abs_diff"] = float((fi().float() - out.float()).abs().max())
                    except Exception as exc:  # a peer that cannot run a shape is reported
                        row["fi_window_us"], row["fi_error"] = None, f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(
                    f"W={window} B={batch} L={length} ({m}xW): window {fmt(row['window_us'])} us "
                    f"(graph {fmt(row['window_graph_us'])}), full {fmt(row['full_us'])} us, "
                    f"FI {fmt(row.get('fi_window_us'))} us, finite {row['finite']}, "
                    f"diff {row['max_abs_diff_vs_ref']:.2e}",
                    flush=True,
                )
                del case
                if ON_GPU:
                    torch.cuda.empty_cache()
    for row in rows:  # time relative to the same (W, B) at L = W
        base = next(
            r
            for r in rows
            if (r["window"], r["batch"], r["multiple"])
            == (row["window"], row["batch"], min(args.multiples))
        )
        for key in ("window_us", "full_us"):
            ratio = row[key] / base[key] if row[key] and base[key] else None
            row[key.replace("_us", "_time_vs_first")] = ratio
    return rows


def memory_rows(args) -> list[dict]:
    """Blocks held per request in a full and a window group as prompts grow to 32 W."""
    _, hkv, d = (int(x) for x in args.heads.split("/"))
    dtype, device = DTYPES[args.dtype], "cuda" if ON_GPU else "cpu"
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    window, bs, batch = args.windows[0], args.page, args.memory_batch
    longest = max(args.multiples) * window
    full_blocks = batch * math.ceil(longest / bs) + 1
    # an import on top of held tokens keeps the old window's blocks until it commits: room for
    # two windows per request (the serving loop imports a prompt once, from empty)
    window_blocks = 2 * batch * (math.ceil(window / bs) + 1) + 1
    spec = (
        f"(2,{full_blocks},{bs},{hkv},{d}):{name}:1;"
        f"(2,{window_blocks},{bs},{hkv},{d}):{name}:1:window={window}"
    )
    cache = PagedKVCache(kv_spec=spec, device=device, max_seq_len=longest, restore_on_abort=False)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        cache.add_request(rid)
    rows = []
    done = 0
    for m in sorted(args.multiples):
        grow = m * window - done
        tx = cache.begin_tokens(rids, [grow] * batch)
        kv = torch.zeros(grow * batch, hkv, d, dtype=dtype, device=device)
        for layer in range(2):
            cache.write_token_layer(tx, layer, kv, kv)
        cache.commit_token(tx)
        done += grow
        metrics = cache.metrics()["groups"]
        rows.append(
            {
                "context": done,
                "multiple": m,
                "full_blocks_per_request": max(
                    len(cache.request_block_ids(r, group=0)) for r in rids
                ),
                "window_blocks_per_request": max(
                    len(cache.request_block_ids(r, group=1)) for r in rids
                ),
                "window_bound": metrics[1]["block_bound_per_request"],
                "full_used_mib": metrics[0]["used_bytes"] / 2**20,
                "window_used_mib": metrics[1]["used_bytes"] / 2**20,
            }
        )
        print(
            f"memory: {done} tokens: full {rows[-1]['full_blocks_per_request']} blocks, window "
            f"{rows[-1]['window_blocks_per_request']} (bound {rows[-1]['window_bound']})",
            flush=True,
        )
    cache.validate_invariants()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--heads", default="32/8/128", help="q/kv heads and head_dim")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--full-max-gib",
        type=float,
        default=24.0,
        help="skip the full-attention contrast above this KV size",
    )
    parser.add_argument("--memory-batch", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=25)
    parser.add_argument("--rep", type=float, default=100)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes (CPU: Triton's interpreter)"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="window_groups")
    args = parser.parse_args()
    if args.smoke:
        args.windows, args.batches, args.multiples = [32], [2], [1, 2, 4]
        args.heads, args.page, args.memory_batch = "4/2/32", 16, 2
        if not ON_GPU:
            args.dtype = "fp32"
    flashinfer, fi_error = (None, "no GPU") if not ON_GPU else load_flashinfer()
    if flashinfer is None:
        print(f"FlashInfer not available ({fi_error}): FlashDec only", flush=True)
    ceiling = copy_ceiling_tbs() if ON_GPU else None
    rows = decode_rows(args, flashinfer, ceiling)
    memory = memory_rows(args)
    env = environment()

    verdicts = []
    for window in args.windows:
        for batch in args.batches:
            mine = [r for r in rows if (r["window"], r["batch"]) == (window, batch)]
            top = max(mine, key=lambda r: r["multiple"])
            full = [r for r in mine if r.get("full_time_vs_first")]
            full_note = (
                (
                    f"; full attention {full[-1]['full_time_vs_first']:.1f}x at "
                    f"{full[-1]['multiple']}x W"
                )
                if full
                else ""
            )
            verdicts.append(
                f"- W={window}, B={batch}: window decode at {top['multiple']}x W takes "
                f"{top['window_time_vs_first']:.2f}x its time at L = W{full_note}; every output "
                f"finite: {all(r['finite'] for r in mine)}, max |diff| vs reference "
                f"{max(r['max_abs_diff_vs_ref'] for r in mine):.1e}"
            )
    table = markdown_table(
        [
            "W",
            "B",
            "L",
            "blocks/req",
            "window MiB",
            "window us",
            "graph us",
            "TB/s",
            "% copy",
            "time vs L=W",
            "full us",
            "full vs L=W",
            "FlashInfer us",
            "finite",
            "max diff",
        ],
        [
            [
                r["window"],
                r["batch"],
                f"{r['context']} ({r['multiple']}x)",
                r["blocks_per_request"],
                r["window_mib"],
                r["window_us"],
                r.get("window_graph_us"),
                r.get("window_tbs"),
                r.get("window_pct_copy"),
                fmt(r["window_time_vs_first"], 2),
                r["full_us"],
                fmt(r.get("full_time_vs_first"), 2),
                r.get("fi_window_us"),
                str(r["finite"]),
                f"{r['max_abs_diff_vs_ref']:.1e}",
            ]
            for r in rows
        ],
    )
    mem_table = markdown_table(
        [
            "context",
            "full group blocks/request",
            "window group blocks/request",
            "bound",
            "full group MiB",
            "window group MiB",
        ],
        [
            [
                f"{r['context']} ({r['multiple']}x W)",
                r["full_blocks_per_request"],
                r["window_blocks_per_request"],
                r["window_bound"],
                r["full_used_mib"],
                r["window_used_mib"],
            ]
            for r in memory
        ],
    )
    fi_line = (
        "FlashInfer: tensor-core decode with window_left = W - 1 over the window's pages."
        if flashinfer is not None
        else f"FlashInfer not available ({fi_error}): FlashDec only."
    )
    copy_line = f"- device copy ceiling: {ceiling:.2f} TB/s" if ceiling else "- no GPU: CPU smoke"
    markdown = f"""# Sliding-window decode: time and bytes follow the window; memory stays bounded

{environment_markdown(env)}
{copy_line}
- heads (q/kv/dim) {args.heads}, page {args.page}, {args.dtype}; {fi_line}

{chr(10).join(verdicts)}

## Decode across contexts (bytes = the window's K/V)

{table}

## Blocks held per request in a grouped cache (one full, one window={args.windows[0]} layer)

{mem_table}
"""
    out_dir = Path(args.out_dir)
    payload = {"env": env, "rows": rows, "memory": memory, "flashinfer": fi_error or "used"}
    md, js = write_results(args.name, markdown, payload, out_dir)
    labels = [f"W={r['window']} B={r['batch']} {r['multiple']}x" for r in rows]
    bar_plot(
        out_dir / f"{args.name}.png",
        labels,
        {
            "window decode": [r["window_us"] for r in rows],
            "full attention": [r["full_us"] for r in rows],
        },
        "us per call (median)",
        "Window decode vs context",
        log=True,
    )
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
