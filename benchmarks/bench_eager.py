"""Eager wall time per call of FlashDec's public API against FlashInfer's eager calls.

What a user pays calling ``flashdec.decode(...)`` or ``fused_rope_kv_append(...)`` from Python:
wall time per call = total time of ``--calls`` back-to-back calls, synchronised once at the end,
divided by the number of calls; median of ``--repeats`` runs.

- decode (bf16 32/8/128, page 16; B=1 L=32768, B=64 L=2048, B=512 L=256): ``decode()`` without
  a workspace on the same metadata (validated once, then cached), the same with a *new*
  ``block_tables`` / ``seq_lens`` tensor each call (the uncached path: one small device read per
  call), ``decode(..., workspace=ws)``, FlashInfer's ``run()`` on the same memory (best of its
  tensor-core and CUDA-core paths), and the kernel alone (FlashDec's launches replayed from a
  CUDA graph, device time).
- append (B = 1, 8, 64, 256): ``fused_rope_kv_append`` (same and fresh metadata) against
  FlashInfer's ``apply_rope_pos_ids`` + ``append_paged_kv_cache``, and ``kv_append`` against
  ``append_paged_kv_cache`` alone.

Before/after in one GPU session: unpack the earlier commit's package somewhere (e.g.
``git archive <commit> flashdec | tar -x -C before/``), run once with ``--flashdec-root before
--label before --out-dir /tmp/b``, then with ``--label after --before /tmp/b/eager.json``.

    PYTHONPATH=. python3 benchmarks/bench_eager.py
    PYTHONPATH=. python3 benchmarks/bench_eager.py --smoke     # CPU: interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    add_call_cost_arguments,
    attach_before,
    bar_plot,
    call_cost_report_head,
    environment,
    fmt,
    graph_us,
    markdown_table,
    start_call_cost_run,
    wall_us_per_call,
    write_results,
)

DECODE_SHAPES = [(1, 32768), (64, 2048), (512, 256)]
APPEND_BATCHES = [1, 8, 64, 256]
DECODE_BEFORE_FIELDS = ("nows_us", "fresh_us", "ws_us")
APPEND_BEFORE_FIELDS = ("fused_us", "fused_fresh_us", "kv_append_us")


def _ratio(a, b):
    return a / b if a and b else None


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


class FreshPool:
    """New tensors for every call of a timed run (made untimed, in ``refill``)."""

    def __init__(self, make, count: int) -> None:
        self.make, self.count, self.items, self.next = make, count, [], 0

    def refill(self) -> None:
        self.items = [self.make() for _ in range(self.count)]
        self.next = 0

    def take(self):
        item = self.items[self.next]
        self.next += 1
        return item


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_call_cost_arguments(p, "eager")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-flashinfer", action="store_true")
    args = p.parse_args(argv)
    run = start_call_cost_run(args, "bench_eager")
    if run is None:
        return 2
    import flashdec.kernels as kernels
    from benchmarks.bench_append import build, trusted_append
    from benchmarks.bench_decode import Case, load_flashinfer

    has_gpu, device, dtype, origin = run.has_gpu, run.device, run.dtype, run.origin
    (hq, hkv, d), page, out_dir = run.heads, run.page, run.out_dir
    decode_shapes, batches = DECODE_SHAPES, APPEND_BATCHES
    calls, repeats, warmup = args.calls, args.repeats, 20
    if args.smoke:
        decode_shapes, batches, calls, repeats, warmup = [(1, 300), (3, 40)], [1, 3], 3, 1, 1
    flashinfer, fi_error = None, "disabled (--no-flashinfer)"
    if not args.no_flashinfer and has_gpu:
        flashinfer, fi_error = load_flashinfer()
    elif not has_gpu:
        fi_error = "no GPU (smoke run)"
    if flashinfer is None:
        print(f"FlashInfer unavailable: {fi_error} — FlashDec columns only", flush=True)

    def wall(fn, setup=None):
        return wall_us_per_call(
            fn, device, calls=calls, repeats=repeats, warmup=warmup, setup=setup
        )

    def kernel_graph_us(fn):
        return graph_us(fn) if has_gpu else None

    rows: list[dict] = []
    fi_ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device=device) if flashinfer else None
    for b, n in decode_shapes:
        case = Case([n] * b, hq, hkv, d, page, dtype, device=device)
        q, k, v, tables, lens = case.q, case.k, case.v, case.tables, case.lens
        plan = case.plan()
        with_ws, trusted = case.flashdec_fns_for(plan)  # decode(workspace=ws), launch_decode
        row = {"table": "decode", "shape": f"B={b} L={n}", "splits": plan.num_splits}
        out = kernels.decode(q, k, v, tables, lens)
        row["nows_us"] = wall(
            lambda q=q, k=k, v=v, t=tables, lens=lens: kernels.decode(q, k, v, t, lens)
        )
        pool = FreshPool(lambda t=tables, lens=lens: (t.clone(), lens.clone()), calls + warmup)

        def fresh(q=q, k=k, v=v, pool=pool):
            t, lens = pool.take()
            return kernels.decode(q, k, v, t, lens)

        row["fresh_us"] = wall(fresh, setup=pool.refill)
        del pool
        row["ws_us"] = wall(with_ws)
        row["kernel_graph_us"] = kernel_graph_us(trusted)
        if flashinfer is not None:
            for key, tensor_cores in (("fi_tc", True), ("fi_cc", False)):
                try:
                    fn = case.flashinfer_fn(flashinfer, tensor_cores, fi_ws)
                    row[f"{key}_us"] = wall(fn)
                    row[f"{key}_graph_us"] = graph_us(fn)
                    diff = (fn().float() - out.float()).abs().max().item()
                    row["max_abs_diff_vs_fi"] = max(row.get("max_abs_diff_vs_fi", 0.0), diff)
                except Exception as exc:
                    row[f"{key}_error"] = _error(exc)
        fis = [row.get("fi_tc_us"), row.get("fi_cc_us")]
        row["fi_us"] = min([x for x in fis if x], default=None)
        row["nows_vs_fi"] = _ratio(row["nows_us"], row["fi_us"])
        row["fresh_vs_fi"] = _ratio(row["fresh_us"], row["fi_us"])
        row["ws_vs_fi"] = _ratio(row["ws_us"], row["fi_us"])
        rows.append(row)
        print(
            f"decode {row['shape']:<14} no-ws {fmt(row['nows_us'])} us (fresh "
            f"{fmt(row['fresh_us'])})  ws {fmt(row['ws_us'])}  FlashInfer {fmt(row['fi_us'])}  "
            f"kernel {fmt(row['kernel_graph_us'])}  x{fmt(row['nows_vs_fi'], 2)} / "
            f"x{fmt(row['ws_vs_fi'], 2)}",
            flush=True,
        )
        del case, with_ws, trusted, out

    for batch in batches:
        t = build(batch, hq, hkv, d, page, dtype, device=device)
        caches = (t["k_cache"], t["v_cache"])
        row = {"table": "append", "shape": f"B={batch}"}

        def fused(ids=None, offsets=None, positions=None, t=t, caches=caches):
            return kernels.fused_rope_kv_append(
                t["q"],
                t["k"],
                t["v"],
                *caches,
                t["block_ids"] if ids is None else ids,
                t["offsets"] if offsets is None else offsets,
                t["positions"] if positions is None else positions,
            )

        row["fused_us"] = wall(fused)
        pool = FreshPool(
            lambda t=t: (t["block_ids"].clone(), t["offsets"].clone(), t["positions"].clone()),
            calls + warmup,
        )
        row["fused_fresh_us"] = wall(
            lambda fused=fused, pool=pool: fused(*pool.take()), pool.refill
        )
        del pool
        trusted = trusted_append(t, torch.empty_like(t["q"]))
        row["trusted_us"] = wall(trusted)
        row["kernel_graph_us"] = kernel_graph_us(trusted)
        row["kv_append_us"] = wall(
            lambda t=t, caches=caches: kernels.kv_append(
                *caches, t["k"], t["v"], t["block_ids"], t["offsets"]
            )
        )
        if flashinfer is not None:
            batch_idx = torch.arange(batch, dtype=torch.int32, device=device)

            def fi_append(k, t=t, caches=caches, batch_idx=batch_idx):
                flashinfer.append_paged_kv_cache(
                    k,
                    t["v"],
                    batch_idx,
                    t["positions"],
                    caches,
                    t["indices"],
                    t["indptr"],
                    t["last_page_len"],
                    kv_layout="HND",
                )

            def fi_rope_append(t=t, fi_append=fi_append):
                q_rot, k_rot = flashinfer.apply_rope_pos_ids(t["q"], t["k"], t["positions"])
                fi_append(k_rot)
                return q_rot

            try:
                row["fi_us"] = wall(fi_rope_append)
                row["fi_append_us"] = wall(lambda t=t, fi_append=fi_append: fi_append(t["k"]))
            except Exception as exc:
                row["fi_error"] = _error(exc)
        row["fused_vs_fi"] = _ratio(row["fused_us"], row.get("fi_us"))
        row["fused_fresh_vs_fi"] = _ratio(row["fused_fresh_us"], row.get("fi_us"))
        row["kv_append_vs_fi"] = _ratio(row["kv_append_us"], row.get("fi_append_us"))
        rows.append(row)
        print(
            f"append B={batch:<4} fused {fmt(row['fused_us'])} us (fresh "
            f"{fmt(row['fused_fresh_us'])}, trusted {fmt(row['trusted_us'])})  FlashInfer "
            f"{fmt(row.get('fi_us'))}  x{fmt(row['fused_vs_fi'], 2)}  kv_append "
            f"{fmt(row['kv_append_us'])} vs {fmt(row.get('fi_append_us'))}",
            flush=True,
        )

    env = environment()
    before_env = attach_before(
        [r for r in rows if r["table"] == "decode"],
        args.before,
        ("table", "shape"),
        DECODE_BEFORE_FIELDS,
    )
    attach_before(
        [r for r in rows if r["table"] == "append"],
        args.before,
        ("table", "shape"),
        APPEND_BEFORE_FIELDS,
    )
    shape = f"{args.dtype}, heads {hq}/{hkv}/{d}, page {page}"
    md = report(args, shape, env, origin, fi_error, rows, before_env, calls, repeats)
    payload = {
        "environment": env,
        "label": args.label,
        "flashdec": origin,
        "flashinfer_error": fi_error,
        "calls": calls,
        "repeats": repeats,
        "rows": rows,
    }
    write_results(args.name, md, payload, out_dir)
    bar_plot(
        out_dir / f"{args.name}.png",
        [f"{r['table']} {r['shape']}" for r in rows],
        {
            "public call, same metadata": [r.get("nows_us", r.get("fused_us")) for r in rows],
            "public call, fresh metadata": [
                r.get("fresh_us", r.get("fused_fresh_us")) for r in rows
            ],
            "decode(workspace) / trusted launch": [
                r.get("ws_us", r.get("trusted_us")) for r in rows
            ],
            "FlashInfer eager": [r.get("fi_us") for r in rows],
            "kernel alone (CUDA graph)": [r.get("kernel_graph_us") for r in rows],
        },
        "wall µs per call (log)",
        f"Eager calls, {args.dtype} {hq}/{hkv}/{d} page {page}"
        + (f" ({args.label})" if args.label else ""),
        log=True,
    )
    print(md)
    return 0


def report(args, shape, env, origin, fi_error, rows, before_env, calls, repeats) -> str:
    decode_rows = [r for r in rows if r["table"] == "decode"]
    append_rows = [r for r in rows if r["table"] == "append"]
    has_before = before_env is not None
    decode_cols = [
        "shape",
        "decode() no ws",
        "no ws, fresh metadata",
        "decode(ws)",
        "FlashInfer run()",
        "kernel alone (graph)",
        "no ws / FI",
        "fresh / FI",
        "ws / FI",
        "splits",
        "max abs diff vs FI",
    ]
    decode_table = [
        [
            r["shape"],
            fmt(r["nows_us"]),
            fmt(r["fresh_us"]),
            fmt(r["ws_us"]),
            fmt(r["fi_us"]),
            fmt(r["kernel_graph_us"]),
            fmt(r["nows_vs_fi"], 2),
            fmt(r["fresh_vs_fi"], 2),
            fmt(r["ws_vs_fi"], 2),
            str(r["splits"]),
            fmt(r.get("max_abs_diff_vs_fi"), 4),
        ]
        for r in decode_rows
    ]
    append_cols = [
        "B",
        "fused_rope_kv_append",
        "fresh metadata",
        "launch_* (trusted)",
        "FlashInfer RoPE+append",
        "fused / FI",
        "fresh / FI",
        "kv_append",
        "FlashInfer append",
        "kv_append / FI",
        "kernel alone (graph)",
    ]
    append_table = [
        [
            r["shape"],
            fmt(r["fused_us"]),
            fmt(r["fused_fresh_us"]),
            fmt(r["trusted_us"]),
            fmt(r.get("fi_us")),
            fmt(r["fused_vs_fi"], 2),
            fmt(r["fused_fresh_vs_fi"], 2),
            fmt(r["kv_append_us"]),
            fmt(r.get("fi_append_us")),
            fmt(r["kv_append_vs_fi"], 2),
            fmt(r["kernel_graph_us"]),
        ]
        for r in append_rows
    ]
    title = f"# Eager calls: FlashDec public API vs FlashInfer ({shape})"
    lines = call_cost_report_head(title, args, env, origin)
    lines += [
        f"- FlashInfer: {'present' if not fi_error else 'MISSING (' + fi_error + ')'}",
        f"- wall µs per call: {calls} back-to-back calls synchronised once at the end, divided "
        f"by {calls}; median of {repeats} runs. 'fresh metadata' passes a new block_tables / "
        "seq_lens (decode) or block_ids / offsets / positions (append) tensor each call, so "
        "every call pays its one device read; 'same metadata' reuses validated tensors. "
        "'kernel alone' is device time of the launches replayed from a CUDA graph.",
        "- targets (issue 8): decode() no workspace <= 1.5x FlashInfer run() at every shape, with "
        "a workspace <= 1.0x; fused_rope_kv_append <= 1.5x FlashInfer RoPE + append.",
        "",
        "## decode",
        "",
        markdown_table(decode_cols, decode_table),
        "",
        "## RoPE + KV append",
        "",
        markdown_table(append_cols, append_table),
    ]
    if has_before:
        pairs = {
            "decode": (
                ("decode() no ws", "nows_us"),
                ("decode() no ws, fresh", "fresh_us"),
                ("decode(ws)", "ws_us"),
            ),
            "append": (
                ("fused_rope_kv_append", "fused_us"),
                ("fused_rope_kv_append, fresh", "fused_fresh_us"),
                ("kv_append", "kv_append_us"),
            ),
        }
        table = [
            [
                name,
                r["shape"],
                fmt(r.get(f"before_{field}")),
                fmt(r.get(field)),
                fmt(_ratio(r.get(field), r.get(f"before_{field}")), 2),
            ]
            for r in rows
            for name, field in pairs[r["table"]]
        ]
        lines += [
            "",
            f"## before ({before_env.get('label') or 'earlier run'}, commit "
            f"{before_env.get('commit')}) and after",
            "",
            markdown_table(["call", "shape", "before µs", "after µs", "after / before"], table),
        ]
    if args.smoke:
        lines.append("\nSMOKE RUN (tiny shapes through the interpreter): not a measurement.")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
