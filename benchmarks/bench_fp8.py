"""FP8 (e4m3) KV decode against the same decode over the bf16 cache it was quantised from.

Per shape: random bf16 K/V in randomly permuted pages, quantised with per-KV-head scales
``amax / 448`` (:func:`flashdec.reference.quantize_fp8`); both decodes use a workspace planned
for their cache dtype, captured in a CUDA graph (replay median). Reported: time, TB/s of the
bytes each reads, the speed-up (target >= 1.7x where the bf16 KV is >= 512 MiB) and the FP8
output's error against the bf16 output (max abs, and RMS relative to the bf16 output's RMS).

    PYTHONPATH=. python3 benchmarks/bench_fp8.py
    PYTHONPATH=. python3 benchmarks/bench_fp8.py --smoke   # CPU: tiny shapes, interpreter
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
    geomean,
    graph_us,
    markdown_table,
    use_interpreter_without_gpu,
    write_results,
)

HAS_GPU = use_interpreter_without_gpu()

import torch  # noqa: E402

from flashdec.kernels import decode, plan_decode  # noqa: E402
from flashdec.reference import quantize_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
# (num_q_heads, num_kv_heads, head_dim, batch, seq_len)
SHAPES = [
    (32, 8, 128, 1, 32768),
    (32, 8, 128, 8, 8192),
    (32, 8, 128, 32, 4096),
    (32, 8, 128, 16, 16384),
    (32, 8, 128, 64, 4096),
    (32, 8, 128, 256, 1024),
    (28, 4, 128, 48, 3000),
    (32, 1, 128, 32, 4096),
    (16, 8, 256, 32, 4096),
    (32, 8, 64, 64, 4096),
]
SMOKE_SHAPES = [(4, 2, 16, 2, 40), (8, 1, 32, 3, 70)]


def run_shape(hq, hkv, d, batch, seq_len, page, dtype, device, gen):
    per_row = -(-seq_len // page)
    num_blocks = batch * per_row
    k = torch.empty(num_blocks, hkv, page, d, dtype=dtype, device=device).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    tables = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = tables.view(batch, per_row)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    q = torch.empty(batch, hq, d, dtype=dtype, device=device).normal_(generator=gen)

    # per-KV-head scales from the data (amax / 448), as a static calibration would give
    k_scale = (k.float().abs().amax(dim=(0, 2, 3)) / 448.0).contiguous()
    v_scale = (v.float().abs().amax(dim=(0, 2, 3)) / 448.0).contiguous()
    k8 = quantize_fp8(k.transpose(1, 2), k_scale).transpose(1, 2).contiguous()
    v8 = quantize_fp8(v.transpose(1, 2), v_scale).transpose(1, 2).contiguous()

    results = {}
    fp8_scales = {"k_scale": k_scale, "v_scale": v_scale}
    default_n = plan_decode(batch, hq, hkv, d, page, seq_len, dtype, device).block_n
    variants = [("bf16", k, v, None, {}, None), ("fp8", k8, v8, FP8, fp8_scales, None)]
    if default_n < 128:  # the FP8 tile at the bf16 tile's bytes: twice the tokens
        variants.append(("fp8_wide", k8, v8, FP8, fp8_scales, 2 * default_n))
    for name, kc, vc, kv_dtype, scales, block_n in variants:
        plan = plan_decode(batch, hq, hkv, d, page, seq_len, dtype, device, kv_dtype=kv_dtype,
                           max_blocks_per_seq=per_row, block_n=block_n)  # fmt: skip
        ws = plan.allocate_workspace()

        def call(kc=kc, vc=vc, ws=ws, scales=scales):
            decode(q, kc, vc, tables, lens, workspace=ws, **scales)

        call()
        us = graph_us(call) if HAS_GPU else None
        results[name] = (us, ws.out.float().clone(), plan.num_splits)
    ref, got = results["bf16"][1], results["fp8"][1]
    wide_us = results["fp8_wide"][0] if "fp8_wide" in results else None
    err = (got - ref).abs()
    rel_rms = float((err.square().mean() / ref.square().mean().clamp_min(1e-30)).sqrt())
    kv_bytes = batch * seq_len * hkv * d * 2 * torch.empty((), dtype=dtype).element_size()
    return {
        "heads": f"{hq}/{hkv}/{d}", "batch": batch, "seq_len": seq_len,
        "bf16_kv_mib": kv_bytes / 2**20,
        "bf16_us": results["bf16"][0], "fp8_us": results["fp8"][0],
        "bf16_splits": results["bf16"][2], "fp8_splits": results["fp8"][2],
        "bf16_tbs": None if results["bf16"][0] is None else kv_bytes / results["bf16"][0] / 1e6,
        "fp8_tbs": None if results["fp8"][0] is None else kv_bytes / 2 / results["fp8"][0] / 1e6,
        "speedup": None if results["fp8"][0] is None else results["bf16"][0] / results["fp8"][0],
        "fp8_wide_us": wide_us, "block_n": default_n,
        "max_abs_err": float(err.max()), "rel_rms_err": rel_rms,
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if HAS_GPU else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        row = run_shape(*shape, args.page, dtype, device, gen)
        rows.append(row)
        print(row, flush=True)
        if HAS_GPU:
            torch.cuda.empty_cache()
    big = [r["speedup"] for r in rows if r["bf16_kv_mib"] >= 512 and r["speedup"]]
    env = environment()
    table = markdown_table(
        ["heads", "B", "L", "bf16 KV MiB", "bf16 µs", "bf16 TB/s", "FP8 µs", "FP8 TB/s",
         "speed-up", "FP8 2x block_n µs", "max abs err", "rel RMS err"],
        [[r["heads"], r["batch"], r["seq_len"], r["bf16_kv_mib"], r["bf16_us"], r["bf16_tbs"],
          r["fp8_us"], r["fp8_tbs"], r["speedup"], r["fp8_wide_us"], f"{r['max_abs_err']:.2e}",
          f"{r['rel_rms_err']:.2e}"] for r in rows],
    )  # fmt: skip
    summary = (
        f"Speed-up where the bf16 KV is >= 512 MiB: geomean {fmt(geomean(big), 2)}x, "
        f"min {fmt(min(big) if big else None, 2)}x (target >= 1.7x)."
    )
    markdown = "\n\n".join([
        "# FP8 (e4m3) KV decode vs bf16",
        environment_markdown(env),
        f"{args.dtype} q/output, page {args.page}, per-KV-head scales amax/448, random pages; "
        "graph-timed replay median. TB/s counts the bytes each cache holds (FP8: half). "
        "'FP8 2x block_n': the FP8 plan with twice the default tile's tokens (the bf16 tile's "
        "bytes), a tuning probe.",
        summary,
        table,
    ])  # fmt: skip
    name = "fp8_smoke" if args.smoke else "decode_fp8"
    md, _ = write_results(name, markdown, {"env": env, "rows": rows}, args.out_dir)
    print(markdown)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
