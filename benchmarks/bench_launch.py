"""Host cost per call of FlashDec's launchers and public calls (no synchronisation per call).

What the engine's hot path (one trusted append + decode launch per layer) and a user's eager
call pay on the host, with calibration rows: ``torch.empty``, a tiny torch op, an ``.item()``
round trip, and the two ways of reading the decode metadata's range stats back (the stats
kernel vs a fused torch expression). Median over thousands of calls; the device is drained
between blocks of calls so that the launch queue never fills (``host_us_per_call``). Calls marked
"reads" synchronise with the device by design: their host time includes waiting for the work
queued before them.

    PYTHONPATH=. python3 benchmarks/bench_launch.py
    PYTHONPATH=. python3 benchmarks/bench_launch.py --flashdec-root before/ --label before
    PYTHONPATH=. python3 benchmarks/bench_launch.py --smoke     # CPU: interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    add_call_cost_arguments,
    attach_before,
    call_cost_report_head,
    environment,
    fmt,
    host_us_per_call,
    markdown_table,
    start_call_cost_run,
    write_results,
)

ENGINE_LAYER_TARGET_US = 25.0  # host time per layer (append + decode) the engine aims for


def _fresh(make, count):
    """A callable returning a new tensor (made in advance) on each call."""
    pool = [make() for _ in range(count)]
    return itertools.cycle(pool).__next__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_call_cost_arguments(p, "launch")
    p.add_argument("--decode-shapes", nargs="+", default=["1x32768", "64x2048"])
    p.add_argument("--append-batch", type=int, default=64)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    run = start_call_cost_run(args, "bench_launch")
    if run is None:
        return 2
    import flashdec.kernels as kernels
    from benchmarks.bench_append import build, trusted_append
    from benchmarks.bench_decode import Case
    from flashdec._checks import check_paged_decode_inputs

    try:
        from flashdec.kernels.validation import decode_metadata_stats as stats_kernel
    except ImportError:  # the measured version has no stats kernel
        stats_kernel = None

    device, dtype, origin = run.device, run.dtype, run.origin
    (hq, hkv, d), page = run.heads, run.page
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.decode_shapes]
    batch, calls, block = args.append_batch, args.calls, 50
    if args.smoke:
        shapes, batch, calls, block = [(1, 300), (3, 40)], 3, 4, 2
    rows: list[dict] = []

    def measure(call: str, shape: str, fn, note: str = "") -> None:
        row = {"call": call, "shape": shape, "note": note, "host_us": None}
        try:
            fn()  # compile / warm up outside the timing
            row["host_us"] = host_us_per_call(fn, device, calls=calls, block=block)
        except Exception as exc:  # e.g. a call the measured version does not have
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
        print(f"{call:<48} {shape:<14} {fmt(row['host_us'], 2):>8} us {row.get('error', '')}")

    # calibration
    one = torch.zeros(1, device=device)
    q_like = torch.empty(64, hq, d, dtype=dtype, device=device)
    measure("torch.empty_like(q)", "64 x q", lambda: torch.empty_like(q_like))
    measure("tiny torch op (x.add_(1))", "1 element", lambda: one.add_(1))
    measure(".item() round trip", "1 element", one.item, "reads")

    layer = {}
    for b, n in shapes:
        shape = f"B={b} L={n}"
        case = Case([n] * b, hq, hkv, d, page, dtype, device=device)
        q, k, v, tables, lens = case.q, case.k, case.v, case.tables, case.lens
        plan = case.plan()
        with_ws, trusted = case.flashdec_fns_for(plan)  # decode(workspace=ws), launch_decode
        splits = f"{plan.num_splits} split(s)"
        layer[shape] = trusted
        measure("launch_decode (trusted)", shape, trusted, splits)
        measure("decode(workspace=ws)", shape, with_ws, splits)
        measure(
            "decode (no workspace, same metadata)",
            shape,
            lambda q=q, k=k, v=v, t=tables, lens=lens: kernels.decode(q, k, v, t, lens),
        )
        fresh_tables = _fresh(tables.clone, calls + 2 * block)
        measure(
            "decode (no workspace, fresh metadata)",
            shape,
            lambda q=q, k=k, v=v, lens=lens, f=fresh_tables: kernels.decode(q, k, v, f(), lens),
            "reads",
        )
        dims = check_paged_decode_inputs(q, k, v, tables, lens)
        if stats_kernel is not None:
            measure(
                "metadata stats: Triton kernel + one read",
                shape,
                lambda t=tables, lens=lens, dims=dims: stats_kernel(t, lens, dims),
                "reads",
            )
        width = torch.arange(tables.shape[1], device=device)

        def torch_stats(t=tables, lens=lens, width=width):
            lengths = lens.long()
            used = (lengths.clamp(min=0) + page - 1) // page
            mask = width[None, :] < used[:, None]
            ids = t.long()
            big = 2**62
            return torch.stack(
                [
                    lengths.min(),
                    lengths.max(),
                    lengths.sum(),
                    torch.where(mask, ids, big).min(),
                    torch.where(mask, ids, -big).max(),
                ]
            ).tolist()

        measure("metadata stats: torch expression + one read", shape, torch_stats, "reads")
        del case

    t = build(batch, hq, hkv, d, page, dtype, device=device)
    q_out = torch.empty_like(t["q"])
    append_shape = f"B={batch}"
    cache_args = (t["k_cache"], t["v_cache"])
    fused_trusted = trusted_append(t, q_out)
    measure("launch_fused_rope_kv_append (trusted)", append_shape, fused_trusted)
    measure(
        "launch_kv_append (trusted)",
        append_shape,
        lambda: kernels.launch_kv_append(*cache_args, t["k"], t["v"], t["block_ids"], t["offsets"]),
    )
    measure(
        "kv_append (same metadata)",
        append_shape,
        lambda: kernels.kv_append(*cache_args, t["k"], t["v"], t["block_ids"], t["offsets"]),
    )

    def fused_public(ids=None):
        return kernels.fused_rope_kv_append(
            t["q"],
            t["k"],
            t["v"],
            *cache_args,
            t["block_ids"] if ids is None else ids,
            t["offsets"],
            t["positions"],
            q_out=q_out,
        )

    measure("fused_rope_kv_append (same metadata)", append_shape, fused_public)
    fresh_ids = _fresh(t["block_ids"].clone, calls + 2 * block)
    measure(
        "fused_rope_kv_append (fresh metadata)",
        append_shape,
        lambda: fused_public(fresh_ids()),
        "reads",
    )
    for shape, trusted in layer.items():
        measure(
            "engine layer: fused append + launch_decode",
            f"{shape}, append B={batch}",
            lambda trusted=trusted: (fused_trusted(), trusted()),
            f"target <= {ENGINE_LAYER_TARGET_US:.0f} us",
        )

    env = environment()
    before_env = attach_before(rows, args.before, ("call", "shape"), ("host_us",))
    columns = ["call", "shape", "host µs / call", "note"]
    table = [[r["call"], r["shape"], fmt(r["host_us"], 2), r["note"]] for r in rows]
    if before_env is not None:
        columns = ["call", "shape", "before µs", "after µs", "after / before", "note"]
        table = [
            [
                r["call"],
                r["shape"],
                fmt(r["before_host_us"], 2),
                fmt(r["host_us"], 2),
                fmt(r["host_us"] / r["before_host_us"], 2)
                if r["host_us"] and r["before_host_us"]
                else None,
                r["note"],
            ]
            for r in rows
        ]
    title = f"# Host cost per call ({args.dtype}, heads {hq}/{hkv}/{d}, page {page})"
    md = call_cost_report_head(title, args, env, origin)
    if before_env is not None:
        md.append(
            f"- before: {before_env.get('label') or 'earlier run'}, commit "
            f"{before_env.get('commit')} ({args.before})"
        )
    md += [
        "- host µs: median over the calls of the time until the call returns, no synchronisation "
        "per call (the device is drained between blocks of 50 calls, untimed). 'reads' calls "
        "synchronise by design and include waiting for the queued work.",
        "",
        markdown_table(columns, table),
    ]
    if args.smoke:
        md.append("\nSMOKE RUN (tiny shapes through the interpreter): not a measurement.")
    payload = {"environment": env, "label": args.label, "flashdec": origin, "rows": rows}
    md_path, _ = write_results(args.name, "\n".join(md), payload, run.out_dir)
    print(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
