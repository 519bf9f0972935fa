"""Sliding-window decode: time and bytes read follow the window, not the context.

For a fixed ``window`` W and contexts L = W, 2W, ... 32W, times ``decode(..., window=W)``
(workspace planned with ``window=W``, captured in a CUDA graph, replay median) beside full
attention over the same cache (``window=None``). Table entries before each row's window are set
to -1 for the windowed call, as a sliding-window cache that released those blocks would leave
them (the kernel never reads them). Bytes read = B x min(L, W) x Hkv x D x 2 (K and V) x dtype
size; the ratio column is the windowed time over its time at L = W (flat = proportional to the
window).

    PYTHONPATH=. python3 benchmarks/bench_window.py [--window 4096] [--batches 1,16]
    PYTHONPATH=. python3 benchmarks/bench_window.py --smoke   # CPU: tiny shapes, interpreter
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    fmt,
    graph_us,
    markdown_table,
    use_interpreter_without_gpu,
    write_results,
)

HAS_GPU = use_interpreter_without_gpu()

import torch  # noqa: E402

from flashdec.kernels import decode, plan_decode  # noqa: E402

MULTIPLES = [1, 2, 4, 8, 16, 32]


def paged_cache(batch, seq_len, hkv, d, page, dtype, device, gen):
    """Random K/V for ``batch`` rows of ``seq_len`` tokens in randomly permuted blocks."""
    per_row = -(-seq_len // page)
    num_blocks = batch * per_row
    k = torch.empty(num_blocks, hkv, page, d, dtype=dtype, device=device).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = perm.view(batch, per_row)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    return k, v, tables, lens


def time_decode(q, k, v, tables, lens, window, device):
    batch, hq, d = q.shape
    plan = plan_decode(batch, hq, k.shape[1], d, k.shape[2], int(lens.max()), q.dtype, device,
                       max_blocks_per_seq=tables.shape[1], window=window)  # fmt: skip
    ws = plan.allocate_workspace()

    def call():
        decode(q, k, v, tables, lens, workspace=ws, window=window)

    call()
    if not HAS_GPU:
        return None, ws.out.clone(), plan.num_splits
    return graph_us(call), ws.out.clone(), plan.num_splits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--heads", default="32,8,128", help="num_q_heads,num_kv_heads,head_dim")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = parser.parse_args(argv)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    window, batches, multiples = args.window, [int(b) for b in args.batches.split(",")], MULTIPLES
    if args.smoke:
        hq, hkv, d, window, batches, multiples = 4, 2, 16, 24, [2], [1, 2, 4]
    device = "cuda" if HAS_GPU else "cpu"
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)

    rows, payload = [], []
    for batch in batches:
        base = None
        for mult in multiples:
            seq_len = window * mult
            k, v, tables, lens = paged_cache(batch, seq_len, hkv, d, args.page, dtype, device, gen)
            q = torch.empty(batch, hq, d, dtype=dtype, device=device).normal_(generator=gen)
            full_us, full_out, _ = time_decode(q, k, v, tables, lens, None, device)
            released = tables.clone()
            released[:, : (seq_len - window) // args.page] = -1  # blocks wholly before the window
            win_us, win_out, splits = time_decode(q, k, v, released, lens, window, device)
            read = batch * min(seq_len, window) * hkv * d * 2 * elem
            full_read = batch * seq_len * hkv * d * 2 * elem
            if base is None:
                base = win_us
            tbs = None if win_us is None else read / (win_us * 1e-6) / 1e12
            ratio = None if (win_us is None or not base) else win_us / base
            rows.append([batch, seq_len, f"{mult}x", splits, read / 2**20, win_us, tbs, ratio,
                         full_read / 2**20, full_us])  # fmt: skip
            payload.append({
                "batch": batch, "seq_len": seq_len, "window": window, "splits": splits,
                "window_bytes": read, "window_us": win_us, "window_tbs": tbs,
                "ratio_to_window_len": ratio, "full_bytes": full_read, "full_us": full_us,
                "outputs_finite": bool(torch.isfinite(win_out).all()),
            })  # fmt: skip
            if mult == 1:  # at L == W the two calls attend to the same tokens
                torch.testing.assert_close(win_out.float(), full_out.float(), atol=2e-2, rtol=2e-2)
            print(f"B={batch} L={seq_len}: window {fmt(win_us)} us, full {fmt(full_us)} us",
                  flush=True)  # fmt: skip
            del k, v

    env = environment()
    table = markdown_table(
        ["B", "L", "L/W", "splits", "window MiB", "window µs", "TB/s", "× time at L=W",
         "full MiB", "full µs"],
        rows,
    )  # fmt: skip
    markdown = "\n\n".join([
        f"# Sliding-window decode: cost follows the window (W = {window})",
        environment_markdown(env),
        f"Heads {hq}/{hkv}/{d}, {args.dtype}, page {args.page}; graph-timed replay median. "
        "Table entries before each window are -1 in the windowed calls (never read).",
        table,
    ])  # fmt: skip
    name = "window_smoke" if args.smoke else "window"
    md, _ = write_results(name, markdown, {"env": env, "rows": payload}, args.out_dir)
    print(markdown)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
