"""RoPE + KV append for one decode token per request (Llama-3-8B heads: 32 q / 8 kv / 128).

Compares FlashDec's fused kernel (one launch: rotate q and k, scatter k and v) with the unfused
Triton path (torch RoPE + Triton scatter), the plain torch path (reference RoPE + indexed
writes) and FlashInfer's ``apply_rope_pos_ids`` + ``append_paged_kv_cache`` (two launches) when
installed. Median of ``triton.testing.do_bench``.

    PYTHONPATH=. python3 benchmarks/bench_append.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    bench_us,
    environment,
    environment_markdown,
    fmt,
    graph_us,
    markdown_table,
    write_results,
)
from flashdec.kernels import (
    fused_rope_kv_append,
    launch_fused_rope_kv_append,
    launch_kv_append,
)
from flashdec.reference import apply_rope

BATCHES = [1, 4, 16, 64, 128, 256]


def build(batch, hq, hkv, d, page, dtype, seed=0, device="cuda"):
    dev = torch.device(device)
    torch.manual_seed(seed)
    lens = torch.randint(1, 64 * page, (batch,), device=dev)  # length after this token
    pages = (lens + page - 1) // page
    total = int(pages.sum())
    perm = torch.randperm(total + 8, device=dev, dtype=torch.int32)
    indices = perm[:total].contiguous()
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = (lens - (pages - 1) * page).int()
    positions = (lens - 1).int()  # the new token's position
    block_ids = indices[indptr[:-1].long() + positions.long() // page].contiguous()
    offsets = (positions % page).int()
    num_blocks = total + 8
    return {
        "q": torch.randn(batch, hq, d, device=dev, dtype=dtype),
        "k": torch.randn(batch, hkv, d, device=dev, dtype=dtype),
        "v": torch.randn(batch, hkv, d, device=dev, dtype=dtype),
        "k_cache": torch.randn(num_blocks, hkv, page, d, device=dev, dtype=dtype),
        "v_cache": torch.randn(num_blocks, hkv, page, d, device=dev, dtype=dtype),
        "block_ids": block_ids,
        "offsets": offsets,
        "positions": positions,
        "indices": indices,
        "indptr": indptr,
        "last_page_len": last_page_len,
    }


# build()'s tensors in the order fused_rope_kv_append and its trusted launcher take them
APPEND_ARGS = ("q", "k", "v", "k_cache", "v_cache", "block_ids", "offsets", "positions")


def append_args(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t[key] for key in APPEND_ARGS)


def trusted_append(t: dict[str, torch.Tensor], q_out: torch.Tensor):
    """The engine's append of one layer on ``build``'s problem ``t``: the trusted fused launch
    (RoPE base 10000 over the whole head, q rotated into ``q_out``), arguments bound once."""
    args = (*append_args(t), None, 10000.0, q_out)
    return lambda: launch_fused_rope_kv_append(*args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--heads", default="32/8/128")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--warmup", type=float, default=25)
    p.add_argument("--rep", type=float, default=100)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="append")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_append needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    hq, hkv, d = (int(x) for x in args.heads.split("/"))
    env = environment()
    flashinfer, fi_error = None, "disabled (--no-flashinfer)"
    if not args.no_flashinfer:
        try:
            import flashinfer

            fi_error = None
        except Exception as exc:
            fi_error = f"{type(exc).__name__}: {exc}"
            print(f"FlashInfer unavailable: {fi_error} — benchmarking without it", flush=True)
    env["flashinfer"] = getattr(flashinfer, "__version__", None)

    rows = []
    for batch in args.batches:
        t = build(batch, hq, hkv, d, args.page, dtype)
        q_out = torch.empty_like(t["q"])
        kc, vc = t["k_cache"], t["v_cache"]
        slots = (t["block_ids"].long(), t["offsets"].long())

        fused, tensors = trusted_append(t, q_out), append_args(t)

        def fused_checked(tensors=tensors, q_out=q_out):
            return fused_rope_kv_append(*tensors, q_out=q_out)

        def triton_unfused(t=t):
            q_rot = apply_rope(t["q"], t["positions"])
            k_rot = apply_rope(t["k"], t["positions"])
            launch_kv_append(
                t["k_cache"], t["v_cache"], k_rot, t["v"], t["block_ids"], t["offsets"]
            )
            return q_rot

        def torch_path(t=t, slots=slots):
            q_rot = apply_rope(t["q"], t["positions"])
            k_rot = apply_rope(t["k"], t["positions"])
            t["k_cache"][slots[0], :, slots[1]] = k_rot
            t["v_cache"][slots[0], :, slots[1]] = t["v"]
            return q_rot

        row = {"batch": batch}
        # correctness first: fused vs the torch path on the same slots
        q_t = torch_path()
        k_t = kc[slots[0], :, slots[1]].clone()
        kc[slots[0], :, slots[1]] = 0
        q_f = fused()
        torch.cuda.synchronize()
        row["max_q_diff"] = (q_f.float() - q_t.float()).abs().max().item()
        row["max_k_diff"] = (kc[slots[0], :, slots[1]].float() - k_t.float()).abs().max().item()
        row["v_bitwise"] = bool(torch.equal(vc[slots[0], :, slots[1]], t["v"]))
        row["fused_us"] = bench_us(fused, args.warmup, args.rep)
        row["fused_graph_us"] = graph_us(fused, args.warmup, args.rep)
        row["fused_checked_us"] = bench_us(fused_checked, args.warmup, args.rep)
        row["triton_unfused_us"] = bench_us(triton_unfused, args.warmup, args.rep)
        row["torch_us"] = bench_us(torch_path, args.warmup, args.rep)
        row["flashinfer_us"] = row["flashinfer_graph_us"] = None
        if flashinfer is not None:
            try:
                batch_idx = torch.arange(batch, dtype=torch.int32, device="cuda")

                def fi(t=t, batch_idx=batch_idx):
                    q_rot, k_rot = flashinfer.apply_rope_pos_ids(t["q"], t["k"], t["positions"])
                    flashinfer.append_paged_kv_cache(
                        k_rot,
                        t["v"],
                        batch_idx,
                        t["positions"],
                        (t["k_cache"], t["v_cache"]),
                        t["indices"],
                        t["indptr"],
                        t["last_page_len"],
                        kv_layout="HND",
                    )
                    return q_rot

                fi()
                torch.cuda.synchronize()
                row["flashinfer_us"] = bench_us(fi, args.warmup, args.rep)
                row["flashinfer_graph_us"] = graph_us(fi, args.warmup, args.rep)
            except Exception as exc:
                row["flashinfer_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        row["fused_vs_flashinfer"] = (
            row["fused_us"] / row["flashinfer_us"] if row["flashinfer_us"] else None
        )
        fg, fig = row["fused_graph_us"], row["flashinfer_graph_us"]
        row["graph_fused_vs_flashinfer"] = fg / fig if fg and fig else None
        rows.append(row)
        print(
            f"B={batch:<4} fused {row['fused_us']:.1f} us (checked {row['fused_checked_us']:.1f})"
            f"  triton-unfused {row['triton_unfused_us']:.1f}  torch {row['torch_us']:.1f}  "
            f"FlashInfer {fmt(row['flashinfer_us'])}  q diff {row['max_q_diff']:.3g} "
            f"k diff {row['max_k_diff']:.3g} v bitwise {row['v_bitwise']}  | graph: fused "
            f"{fmt(row['fused_graph_us'])} FlashInfer {fmt(row['flashinfer_graph_us'])}",
            flush=True,
        )

    columns = [
        "B",
        "fused us (launch_*)",
        "fused us (checked API)",
        "RoPE(torch)+Triton scatter",
        "torch path us",
        "FlashInfer us",
        "fused/FlashInfer",
        "graph: fused us",
        "graph: FlashInfer us",
        "graph: fused/FlashInfer",
        "max |q diff|",
        "max |k diff|",
        "v bitwise",
    ]
    table = [
        [
            str(r["batch"]),
            fmt(r["fused_us"]),
            fmt(r["fused_checked_us"]),
            fmt(r["triton_unfused_us"]),
            fmt(r["torch_us"]),
            fmt(r["flashinfer_us"]),
            fmt(r["fused_vs_flashinfer"], 2),
            fmt(r["fused_graph_us"]),
            fmt(r["flashinfer_graph_us"]),
            fmt(r["graph_fused_vs_flashinfer"], 2),
            f"{r['max_q_diff']:.3g}",
            f"{r['max_k_diff']:.3g}",
            str(r["v_bitwise"]),
        ]
        for r in rows
    ]
    md = "\n".join(
        [
            f"# Fused RoPE + KV append ({args.dtype}, heads {args.heads}, page {args.page})",
            "",
            environment_markdown(env),
            f"- FlashInfer: {'present' if not fi_error else 'MISSING (' + fi_error + ')'}",
            "- fused = ONE Triton launch per layer (rotate q and k, scatter k and v); "
            "'checked API' adds fused_rope_kv_append's validation (its one device read happens "
            "on the first call; the same, unmodified metadata is not read again)",
            f"- median of triton.testing.do_bench (warmup {args.warmup} ms, rep {args.rep} ms, "
            "L2 flushed per call); 'graph' columns replay one call from a CUDA graph (no Python "
            "launch overhead)",
            "- q/k diff: fused vs torch path (reference RoPE), bf16 rounding level expected",
            "",
            markdown_table(columns, table),
        ]
    )
    out_dir = Path(args.out_dir)
    write_results(
        args.name, md, {"environment": env, "flashinfer_error": fi_error, "rows": rows}, out_dir
    )
    labels = [f"B={r['batch']}" for r in rows]
    bar_plot(
        out_dir / f"{args.name}.png",
        labels,
        {
            "fused (1 launch)": [r["fused_us"] for r in rows],
            "FlashInfer RoPE+append": [r["flashinfer_us"] for r in rows],
            "RoPE torch + Triton scatter": [r["triton_unfused_us"] for r in rows],
        },
        "microseconds",
        f"RoPE + KV append, {args.heads} {args.dtype}",
    )
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
