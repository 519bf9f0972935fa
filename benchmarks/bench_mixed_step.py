"""Mixed steps (decode rows + a prompt chunk): eager against piecewise CUDA graphs, measured.

A step that carries prompt chunks has no fixed attention shape; issue 21 asks which is better:
eager mixed steps, or graphs captured up front. A graph removes the host's launch work and the
gaps between kernels, not the kernels: so per mixed step, the eager wall time minus the GPU's
busy time (the sum of its kernel and copy durations) bounds what any mixed-step graph can save.
``flashdec.LLM`` captures piecewise graphs (the dense work per token bucket, attention eager
between them: ``flashdec.engine.piecewise_graphs``); each step is timed both ways in the same
process, on the same LLM (its pieces switched off for the eager reps).

For each (running decode requests D, prompt chunk C), on ``flashdec.LLM``: D requests are
brought to decoding, then one request with a C-token prompt is added and the next ``step()``
(one mixed step: D decode rows + the chunk) is timed, synchronised before and after:
- wall: median over ``--reps`` (without the profiler);
- GPU busy: the profiler's device time of that step's kernels and copies, median over reps;
- the decode-only step of the same D beside it (graph replay), timed the same way;
- each of those twice: eager dense work, and on the piecewise graphs (GPU only).
The chunk's request is aborted after each rep (its blocks return), so every rep is alike.

    PYTHONPATH=. python3 benchmarks/bench_mixed_step.py            # Llama-3-8B shape, GPU
    PYTHONPATH=. python3 benchmarks/bench_mixed_step.py --smoke    # tiny model, CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    fmt,
    markdown_table,
    write_results,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--decode-rows", type=int, nargs="+", default=[1, 16, 63])
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256, 1024, 1984])
    p.add_argument("--context", type=int, default=512, help="prompt tokens of the decode rows")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--host-profile",
        type=int,
        nargs=2,
        metavar=("D", "C"),
        help="also profile the host side (cProfile) of that mixed step: where its wall time goes",
    )
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="mixed_step")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.decode_rows, args.chunks, args.context, args.reps = (
            "tiny",
            [1, 3],
            [8, 24],
            16,
            2,
        )
    return args


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_step(llm, device: str, profile: bool) -> tuple[float, Any]:
    """One synchronised step: its seconds (wall, or with ``profile`` the device seconds of its
    kernels and copies) and the loop's record of it."""
    _sync(device)
    if not profile:
        start = time.perf_counter()
        record = llm.step()
        _sync(device)
        return time.perf_counter() - start, record
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        record = llm.step()
        _sync(device)
    busy_us = sum(
        getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        for e in prof.key_averages()
    )
    return busy_us * 1e-6, record


def _median(times: dict, mode: str, profile: bool) -> float:
    samples = times.get((mode, profile))
    return statistics.median(samples) if samples else float("nan")


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import flashdec
    from flashdec.models import build_random_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    profiles = (False, True) if device == "cuda" else (False,)  # busy: CUDA profiler only
    model = build_random_model(args.model, device=device, seed=0)
    max_batch = max(args.decode_rows) + 1
    # the decode rows keep decoding through every timed step (a few per chunk and rep)
    decode_tokens = 2 * args.reps * (1 + len(args.chunks)) + 2 * len(args.chunks) + 16
    longest = max(args.context + decode_tokens, max(args.chunks) + 2)
    start = time.perf_counter()
    llm = flashdec.LLM(
        model,
        max_batch_size=max_batch,
        num_blocks=max_batch * (longest // 16 + 2) + 64,
        max_model_len=longest + 64,
        enable_prefix_caching=False,
    )
    built = {"seconds": time.perf_counter() - start, "budget": llm.max_num_batched_tokens}
    pieces = llm._runner.mixed_graphs  # None without CUDA graphs
    if pieces is not None:
        built["pieces"] = {
            "graphs": pieces.warm_start.graphs,
            "buckets": list(pieces.buckets),
            "seconds": pieces.warm_start.seconds,
            "memory_bytes": pieces.warm_start.memory_bytes,
        }
    modes = {"eager": None} if pieces is None else {"eager": None, "pieces": pieces}
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = []
    for d in args.decode_rows:
        running = [
            llm.add_request(
                torch.randint(0, vocab, (args.context,), generator=gen).tolist(),
                max_new_tokens=decode_tokens,
                ignore_eos=True,
            )
            for _ in range(d)
        ]
        while any(not llm.output(r) for r in running):  # every prompt imported
            llm.step()
        decode_wall, decode_busy = (
            statistics.median(_timed_step(llm, device, profile)[0] for _ in range(args.reps))
            if profile in profiles
            else float("nan")
            for profile in (False, True)
        )
        for c in args.chunks:
            prompt = torch.randint(0, vocab, (c,), generator=gen).tolist()
            times = {(mode, p): [] for mode in modes for p in profiles}
            for rep in range(args.reps + 1):  # rep 0 warms up (not counted)
                for (mode, profile), samples in times.items():
                    llm._runner.mixed_graphs = modes[mode]
                    rid = llm.add_request(prompt, max_new_tokens=2, ignore_eos=True)
                    seconds, record = _timed_step(llm, device, profile)
                    llm.abort_request(rid)
                    if rid not in record.prefilled:
                        raise RuntimeError(f"the step did not carry the {c}-token prompt")
                    if rep:
                        samples.append(seconds)
            llm._runner.mixed_graphs = pieces
            chunk_tokens = min(c, llm.max_num_batched_tokens - d)

            wall, busy = _median(times, "eager", False), _median(times, "eager", True)
            row = {
                "decode_rows": d,
                "chunk": c,
                "chunk_tokens": chunk_tokens,
                "wall_ms": wall * 1e3,
                "gpu_busy_ms": busy * 1e3,
                "headroom_ms": (wall - busy) * 1e3,
                "headroom_pct": 100 * (wall - busy) / wall,
                "decode_wall_ms": decode_wall * 1e3,
                "decode_gpu_busy_ms": decode_busy * 1e3,
                "pieces_wall_ms": _median(times, "pieces", False) * 1e3,
                "pieces_gpu_busy_ms": _median(times, "pieces", True) * 1e3,
                "pieces_fit": pieces is not None and pieces.fits(d + chunk_tokens),
            }
            row["eager_over_pieces"] = row["wall_ms"] / row["pieces_wall_ms"]
            rows.append(row)
            print(
                f"D={d:<3} C={c:<5} wall {row['wall_ms']:7.2f} ms  GPU busy "
                f"{row['gpu_busy_ms']:7.2f} ms  headroom {row['headroom_pct']:5.1f}%  "
                f"(decode-only {row['decode_wall_ms']:.2f} / {row['decode_gpu_busy_ms']:.2f} ms)"
                f"  pieces {row['pieces_wall_ms']:7.2f} / {row['pieces_gpu_busy_ms']:7.2f} ms",
                flush=True,
            )
        if args.host_profile and args.host_profile[0] == d:
            built["host_profile"] = host_profile(llm, args.host_profile[1], vocab, gen, args.reps)
        for rid in running:
            llm.abort_request(rid)
    return rows, built


def host_profile(llm, chunk: int, vocab: int, gen, reps: int) -> dict[str, Any]:
    """cProfile over ``reps`` mixed steps carrying a ``chunk``-token prompt: the functions with
    the most own time, per step."""
    import cProfile
    import pstats

    prompt = torch.randint(0, vocab, (chunk,), generator=gen).tolist()
    profiler = cProfile.Profile()
    for _ in range(reps):
        rid = llm.add_request(prompt, max_new_tokens=2, ignore_eos=True)
        profiler.enable()
        llm.step()
        profiler.disable()
        llm.abort_request(rid)
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(path).name}:{line}({name})",
                "calls_per_step": calls / reps,
                "own_ms_per_step": 1e3 * own / reps,
                "cumulative_ms_per_step": 1e3 * cumulative / reps,
            }
        )
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    total = sum(r["own_ms_per_step"] for r in rows)
    return {"chunk": chunk, "reps": reps, "total_ms_per_step": total, "top": rows[:40]}


def render(payload: dict[str, Any]) -> str:
    built = payload["built"]
    lines = [
        "# Mixed steps: eager against piecewise CUDA graphs, and the GPU's busy time",
        "",
        environment_markdown(payload["environment"]),
        f"- model: {payload['model']} (random weights); decode rows over {payload['context']}-"
        f"token prompts; step token budget {built['budget']}; `flashdec.LLM(...)` "
        f"{built['seconds']:.1f} s",
        f"- method: one synchronised `LLM.step()` carrying D decode rows and one C-token prompt "
        f"chunk; wall = median of {payload['reps']} reps; GPU busy = the profiler's device time "
        "of the step's kernels and copies (median of as many profiled reps); headroom = wall - "
        "busy, the most a CUDA graph of that step could save. Decode-only: the D rows' own "
        "step (CUDA graph replay), timed the same way. Pieces: the same step with its dense "
        "work on the piecewise graphs of its token bucket (attention eager), same LLM, reps "
        "interleaved with the eager ones; 'eager / pieces' = wall over wall ('—': the step "
        "exceeds the largest bucket and runs eagerly either way).",
    ]
    if "pieces" in built:
        info = built["pieces"]
        lines.append(
            f"- piecewise graphs: {info['graphs']} over token buckets {info['buckets'][0]}.."
            f"{info['buckets'][-1]} ({len(info['buckets'])}), captured in "
            f"{info['seconds']:.1f} s of the warm start, holding "
            f"{info.get('memory_bytes', 0) / 2**30:.2f} GiB"
        )
    lines.append("")
    lines.append(
        markdown_table(
            [
                "D",
                "chunk tokens",
                "wall ms",
                "GPU busy ms",
                "headroom ms",
                "headroom %",
                "decode-only wall / busy ms",
                "pieces wall ms",
                "pieces GPU busy ms",
                "eager / pieces",
            ],
            [
                [
                    r["decode_rows"],
                    r["chunk_tokens"],
                    fmt(r["wall_ms"], 2),
                    fmt(r["gpu_busy_ms"], 2),
                    fmt(r["headroom_ms"], 2),
                    fmt(r["headroom_pct"]),
                    f"{fmt(r['decode_wall_ms'], 2)} / {fmt(r['decode_gpu_busy_ms'], 2)}",
                    fmt(r["pieces_wall_ms"], 2),
                    fmt(r["pieces_gpu_busy_ms"], 2),
                    fmt(r["eager_over_pieces"], 2) if r["pieces_fit"] else "—",
                ]
                for r in payload["rows"]
            ],
        )
    )
    profile = built.get("host_profile")
    if profile:
        lines += [
            "",
            f"## Host profile of a mixed step (cProfile, chunk {profile['chunk']}, "
            f"{profile['reps']} steps; {fmt(profile['total_ms_per_step'], 2)} ms per step "
            "under the profiler)",
            "",
            markdown_table(
                ["function", "calls per step", "own ms per step", "cumulative ms per step"],
                [
                    [
                        f"`{r['function']}`",
                        fmt(r["calls_per_step"], 0),
                        fmt(r["own_ms_per_step"], 3),
                        fmt(r["cumulative_ms_per_step"], 3),
                    ]
                    for r in profile["top"]
                ],
            ),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, built = measure(args)
    payload = {
        "environment": environment(),
        "model": args.model,
        "context": args.context,
        "reps": args.reps,
        "built": built,
        "rows": rows,
    }
    md, _ = write_results(args.name, render(payload), payload, args.out_dir)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
