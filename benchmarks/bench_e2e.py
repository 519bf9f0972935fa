"""End-to-end decode speed: FlashDec's ``LLM`` against transformers (and vLLM) on one model.

Llama-3-8B shape with random bf16 weights by default (hidden 4096, 32 layers, 32/8 heads,
head_dim 128, intermediate 14336, vocab 128256), random prompts of ``--prompt-len`` tokens,
greedy, EOS ignored. For each batch B:

- **decode tok/s** = B × (N − 1) / (time(N new tokens) − time(1 new token)), median of
  ``--reps`` runs each, N = ``--new-tokens``: the prefill is the same in both runs, so it cancels;
- FlashDec with CUDA graphs (the default) and without; ``transformers``' own ``generate`` with
  its static cache, in the same process on the same model;
- vLLM 0.24.0 from ``--vllm-json`` (``vllm_anchor.py``, same method, same machine and lease);
- the bytes-read floor: weights + the KV of one step, over the measured copy bandwidth.

It also reports, at B=1, token agreement with transformers over N greedy steps and the largest
per-step logits difference with FlashDec teacher-forced on transformers' tokens; the share of a
decode step spent in attention (the step's attention kernels replayed alone from a CUDA graph);
a per-kernel-class profile of one eager step; peak memory against weights + KV pool; and TTFT /
TPOT percentiles of a Poisson-arrival run through the serving loop.

Writes ``benchmarks/results/e2e.{md,json,png}``. ``--smoke`` runs the tiny model on the CPU.
``--kv-cache-dtype fp8`` stores the KV cache as float8_e4m3fn (fixed per-head scale
``--kv-scale``, not calibrated; the model stays bf16) and writes ``e2e_fp8.*`` by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    copy_ceiling_tbs,
    environment,
    environment_markdown,
    fmt,
    markdown_table,
    write_results,
)
from flashdec import LLM
from flashdec.models import build_random_model
from flashdec.workloads.model_config import ServeConfig
from flashdec.workloads.serving import run_serve_benchmark


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:  # checked before the model is built, not after minutes of benchmarking
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="runs per timing (FlashDec)")
    p.add_argument(
        "--baseline-reps",
        type=int,
        default=1,
        help="runs per timing of transformers and FlashDec without graphs",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers runs")
    p.add_argument("--no-eager", action="store_true", help="skip FlashDec without CUDA graphs")
    p.add_argument("--vllm-json", help="vllm_anchor.py's --json output of the same lease")
    p.add_argument(
        "--serve-requests",
        type=_at_least_one,
        default=128,
        help="requests of the Poisson serving run (>= 1)",
    )
    p.add_argument("--serve-rate", type=float, default=16.0, help="Poisson arrivals per second")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", help="results file name (default: e2e, or e2e_fp8 with FP8 KV)")
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="KV cache storage: the model's dtype, or float8_e4m3fn",
    )
    p.add_argument("--kv-scale", type=float, default=1.0, help="fixed FP8 K/V scale (per head)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (script check)")
    args = p.parse_args()
    if args.name is None:
        args.name = "e2e_fp8" if args.kv_cache_dtype == "fp8" else "e2e"
    if args.smoke:
        args.model, args.batches, args.prompt_len, args.new_tokens = "tiny", [1, 3], 20, 6
        args.reps, args.serve_requests, args.serve_rate = 1, 6, 50.0
    return args


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=gen).tolist()


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_rate(run, batch: int, new: int, reps: int) -> dict:
    """tok/s of the decode phase: B(N-1) / (t(N) - t(1)), each a median of ``reps``."""
    run(batch, 1)  # warm-up at both lengths: compiles (transformers' static cache compiles per
    run(batch, new)  # cache length), captures FlashDec's graphs for the batch
    t1 = median_time(lambda: run(batch, 1), reps)
    tn = median_time(lambda: run(batch, new), reps)
    return {
        "tok_s": batch * (new - 1) / (tn - t1),
        "step_ms": (tn - t1) / (new - 1) * 1e3,
        "t1_s": t1,
        "tn_s": tn,
    }


def hf_generate(model, prompts: list[list[int]], new: int) -> torch.Tensor:
    ids = torch.tensor(prompts, device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        eos_token_id=None,  # EOS a token like any other, as FlashDec's ignore_eos (no masking)
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :]


def agreement(llm: LLM, model, prompt: list[int], new: int) -> dict:
    """Greedy token agreement with transformers at B=1, and per-step logits teacher-forced on
    transformers' tokens (one early near-tie then does not decide every later step), each
    against a float32 run of the same model — next to transformers' own bf16 error."""
    from flashdec.models.reference import float32_logits

    hf_tokens = hf_generate(model, [prompt], new)[0].tolist()
    ours = llm.generate([prompt], new, ignore_eos=True)[0]
    first_diff = next(
        (i for i, (a, b) in enumerate(zip(ours, hf_tokens, strict=True)) if a != b), None
    )
    forced = teacher_forced_logits(llm, prompt, hf_tokens)  # [new, V]
    sequence = torch.tensor(prompt + hf_tokens[:-1], device=model.device)
    with torch.no_grad():
        hf_bf16 = model(sequence[None]).logits[0, len(prompt) - 1 :].float()
    reference = float32_logits(model, sequence)[len(prompt) - 1 :]

    def rel(a: torch.Tensor) -> list[float]:
        return ((a - reference).norm(dim=-1) / reference.norm(dim=-1)).tolist()

    ours_err, hf_err = rel(forced), rel(hf_bf16)
    return {
        "steps": new,
        "tokens_equal": sum(a == b for a, b in zip(ours, hf_tokens, strict=True)),
        "first_divergence": first_diff,
        "max_rel_err_flashdec_vs_fp32": max(ours_err),
        "max_rel_err_transformers_bf16_vs_fp32": max(hf_err),
        "mean_rel_err_flashdec_vs_fp32": sum(ours_err) / len(ours_err),
        "mean_rel_err_transformers_bf16_vs_fp32": sum(hf_err) / len(hf_err),
        "argmax_equal_teacher_forced": int((forced.argmax(-1) == hf_bf16.argmax(-1)).sum()),
    }


def teacher_forced_logits(llm: LLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of each step when FlashDec is fed ``tokens`` instead of its own choices."""
    engine, adapter = llm.engine, llm.adapter
    rid = "teacher-forced"
    engine_spec = llm.adapter.spec
    engine.submit_request(__import__("flashdec").RequestSpec(rid, len(prompt), len(tokens), 10**9))
    snapshot = engine.scheduling_snapshot(0)
    engine.submissions.apply_trusted_decision(llm.scheduler.plan(snapshot))
    tx = engine.begin_prefill([rid], [len(prompt)])
    ids = torch.tensor(prompt, device=engine_spec.device)
    rows = [adapter.prefill(ids, lambda layer, k, v: engine.prefill_layer(tx, layer, k, v))]
    engine.commit_step(tx)
    for token in tokens[:-1]:
        tx = engine.begin_step([rid])
        step_ids = torch.tensor([token], device=engine_spec.device)
        logits = adapter.decode(
            step_ids, lambda layer, q, k, v, tx=tx: engine.step_layer(tx, layer, q, k, v)
        )
        engine.commit_step(tx)
        rows.append(logits[0].float())
    engine.finish_request(rid)
    return torch.stack(rows)


def attention_share(llm: LLM, batch: int, context: int) -> dict | None:
    """Device time of one step's attention (RoPE+append and decode for every layer) replayed
    alone from a CUDA graph, against the graph-replayed full step."""
    if not torch.cuda.is_available():
        return None
    from benchmarks._common import graph_us
    from flashdec import RequestSpec

    engine, spec = llm.engine, llm.adapter.spec
    rids = [f"share{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        engine.submit_request(RequestSpec(rid, context, 4, 10**9 + 1000 * batch + i))
    engine.submissions.apply_trusted_decision(llm.scheduler.plan(engine.scheduling_snapshot(0)))
    tx = engine.begin_prefill(rids, [context] * batch)
    kv = torch.randn(batch * context, spec.num_kv_heads, spec.head_dim, device="cuda")
    for layer in range(spec.num_layers):
        engine.prefill_layer(tx, layer, kv.to(spec.dtype), kv.to(spec.dtype))
    engine.commit_step(tx)
    q = torch.randn(batch, spec.num_q_heads, spec.head_dim, device="cuda").to(spec.dtype)
    k = torch.randn(batch, spec.num_kv_heads, spec.head_dim, device="cuda").to(spec.dtype)
    tx = engine.begin_step(rids)
    for layer in range(spec.num_layers):  # warm: compiles this batch's kernels
        engine.step_layer(tx, layer, q, k, k)
    engine.commit_step(tx)
    tx = engine.begin_step(rids)
    slots = engine.cache.steps.transaction_slots(tx)
    from flashdec.engine.layer_ops import write_rope_layer

    state = engine.attention.decode_states[0]
    layout = engine.cache.layout
    # an FP8 cache's scales, per layer
    scales = [layout.layer_kv_scales(i) or (None, None) for i in range(spec.num_layers)]

    def attention_only():
        for layer in range(spec.num_layers):
            k_layer, v_layer = layout.layer_kv(layer)
            q_rot = write_rope_layer(
                "fused", engine.rope, q, k, k, k_layer, v_layer, slots, None, *scales[layer]
            )
            state.decode(q_rot, k_layer, v_layer, slots, engine.sm_scale, out, *scales[layer])

    out = torch.empty_like(q)

    attention_us = graph_us(attention_only)
    engine.abort_step(tx)
    for rid in rids:
        engine.finish_request(rid)
    return {"batch": batch, "context": context, "attention_us": attention_us}


def _profile_classes(llm: LLM, prompts, new: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, new, ignore_eos=True)
    return {
        e.key: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        for e in prof.key_averages()
    }


def kernel_profile(llm: LLM, batch: int, context: int, steps: int = 8) -> list[dict]:
    """CUDA time by kernel class per eager decode step (torch.profiler): a run of ``steps + 1``
    new tokens minus a run of 1 (same prompts), so the prefill cancels."""
    if not torch.cuda.is_available():
        return []
    prompts = prompts_for(batch, context, llm.adapter.spec.vocab_size, 7)
    graphs = llm.cuda_graphs
    llm.cuda_graphs = False
    try:
        llm.generate(prompts, 2, ignore_eos=True)
        long = _profile_classes(llm, prompts, steps + 1)
        short = _profile_classes(llm, prompts, 1)
    finally:
        llm.cuda_graphs = graphs
    classes = {
        "attention (RoPE+append, decode)": ("_decode_kernel", "_merge_splits", "_fused_rope"),
        "GEMM (projections, MLP, lm_head)": ("gemm", "gemv", "sm90", "cutlass", "xmma", "Kernel2"),
        "RMSNorm (+residual)": ("rms_norm",),
        "SiLU x up": ("silu",),
        "argmax, sampling": ("argmax", "reduce"),
        "embedding, token gather/scatter": ("index", "embedding", "gather", "scatter"),
        "copies": ("copy", "memcpy", "memset"),
    }
    totals: dict[str, float] = {}
    for key, long_us in long.items():
        us = (long_us - short.get(key, 0.0)) / steps
        if us <= 0:
            continue
        name = key.lower()
        label = next(
            (c for c, keys in classes.items() if any(k.lower() in name for k in keys)), "other"
        )
        totals[label] = totals.get(label, 0.0) + us
    total = sum(totals.values()) or 1.0
    return [
        {"class": k, "us_per_step": v, "share_pct": 100 * v / total}
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
    ]


def graph_replay_us(llm: LLM, batch: int, max_len: int) -> float | None:
    """GPU time of the captured decode step of this batch's bucket and length (the longest
    request's), replayed alone (it rewrites the last step's slots: a measurement, after the runs
    that used them)."""
    graphs = llm._runner.graphs
    if graphs is None:
        return None
    from benchmarks._common import bench_us

    bucket = graphs.bucket(batch)
    held = graphs.graphs.get((bucket, graphs.key(bucket, max_len)))
    return bench_us(held.graph.replay) if held else None


def main() -> None:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    env = environment()
    env["transformers"] = __import__("transformers").__version__
    torch.manual_seed(0)
    fp8 = args.kv_cache_dtype == "fp8"
    # FP8 KV needs fp16/bf16 activations: the CPU smoke shape is float32 otherwise
    model = build_random_model(
        args.model, device=device, seed=0, dtype=torch.bfloat16 if fp8 and not on_gpu else None
    )
    spec_vocab = model.config.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    max_batch = max(args.batches)
    total_len = args.prompt_len + args.new_tokens
    blocks = max_batch * -(-total_len // 16) + 64
    copy_tbs = copy_ceiling_tbs() if on_gpu else None
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    llm = LLM(
        model,
        max_batch_size=max_batch,
        num_blocks=blocks,
        max_model_len=total_len + 64,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_scale=args.kv_scale,
    )
    kv_spec = llm.engine.cache.kv_groups[0]
    pool_bytes = kv_spec.block_bytes * blocks
    # K/V bytes per token as stored (FP8: 1 byte per element)
    kv_itemsize = torch.empty((), dtype=kv_spec.dtype).element_size()
    kv_token_bytes = 2 * llm.adapter.spec.num_layers * kv_spec.num_kv_heads * kv_spec.head_dim
    kv_token_bytes *= kv_itemsize
    rows = []
    print(
        f"model {args.model}: {weight_bytes / 2**30:.2f} GiB weights, KV pool "
        f"{pool_bytes / 2**30:.2f} GiB",
        flush=True,
    )

    transient = 0  # the most FlashDec allocated beyond what was resident before a run

    def flashdec_run(batch: int, new: int) -> None:
        nonlocal transient
        if on_gpu:  # resident before: weights, pool (and what transformers' runs left cached)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        llm.generate(prompts_for(batch, args.prompt_len, spec_vocab, batch), new, ignore_eos=True)
        if on_gpu:
            transient = max(transient, torch.cuda.max_memory_allocated() - base)

    for batch in args.batches:
        row = {"batch": batch}
        row["flashdec"] = decode_rate(flashdec_run, batch, args.new_tokens, args.reps)
        if on_gpu and not args.no_eager:
            runner = llm._runner  # the same LLM without its graphs: every step eager
            saved = runner.graphs, runner.mixed_graphs
            runner.graphs = runner.mixed_graphs = None
            row["flashdec_eager"] = decode_rate(
                flashdec_run, batch, args.new_tokens, args.baseline_reps
            )
            runner.graphs, runner.mixed_graphs = saved
        if not args.no_transformers:
            row["transformers"] = decode_rate(
                lambda b, n: hf_generate(model, prompts_for(b, args.prompt_len, spec_vocab, b), n),
                batch,
                args.new_tokens,
                args.baseline_reps,
            )
        kv_bytes = kv_token_bytes * batch * (total_len - args.new_tokens / 2)
        floor_ms = (weight_bytes + kv_bytes) / (copy_tbs * 1e12) * 1e3 if copy_tbs else None
        row["floor_ms"] = floor_ms
        replay = graph_replay_us(llm, batch, total_len)
        row["graph_replay_ms"] = None if replay is None else replay / 1e3
        if floor_ms:
            row["floor_fraction"] = floor_ms / row["flashdec"]["step_ms"]
        share = attention_share(llm, batch, args.prompt_len + args.new_tokens // 2)
        if share and share["attention_us"]:
            share["step_us"] = row["flashdec"]["step_ms"] * 1e3
            share["share_pct"] = 100 * share["attention_us"] / share["step_us"]
        row["attention"] = share
        rows.append(row)
        print(json.dumps(row), flush=True)

    # FlashDec's peak: the weights and the KV pool, plus the most its runs added on top
    peak = weight_bytes + pool_bytes + transient if on_gpu else None
    agree = agreement(
        llm, model, prompts_for(1, args.prompt_len, spec_vocab, 99)[0], args.new_tokens
    )
    print("agreement:", json.dumps(agree), flush=True)
    profile_rows = kernel_profile(llm, min(64, max_batch), args.prompt_len)
    serve = run_serve_benchmark(
        llm,
        ServeConfig(
            model=args.model,
            max_batch_size=max_batch,
            num_requests=args.serve_requests,
            request_rate=args.serve_rate,
            min_prompt_len=max(1, args.prompt_len // 4),
            max_prompt_len=args.prompt_len,
            max_new_tokens=args.new_tokens,
            seed=0,
        ),
    )
    vllm = json.loads(Path(args.vllm_json).read_text()) if args.vllm_json else None
    report(
        args, env, rows, agree, profile_rows, serve, vllm, weight_bytes, pool_bytes, peak, copy_tbs
    )


def report(
    args, env, rows, agree, profile_rows, serve, vllm, weight_bytes, pool_bytes, peak, copy_tbs
) -> None:
    vllm_rows = {r["batch"]: r for r in (vllm or {}).get("rows", [])}
    kv_note = "model-dtype KV"
    if args.kv_cache_dtype == "fp8":
        kv_note = f"float8_e4m3fn KV, fixed scale {args.kv_scale}, not calibrated"
    table_rows = []
    for r in rows:
        b = r["batch"]
        table_rows.append(
            [
                b,
                r["flashdec"]["tok_s"],
                r["flashdec"]["step_ms"],
                r.get("graph_replay_ms"),
                r.get("flashdec_eager", {}).get("tok_s"),
                r.get("transformers", {}).get("tok_s"),
                vllm_rows.get(b, {}).get("decode_tok_s"),
                vllm_rows.get(b, {}).get("step_ms"),
                r["floor_ms"],
                None if r.get("floor_fraction") is None else 100 * r["floor_fraction"],
                None if not r.get("attention") else r["attention"].get("share_pct"),
            ]
        )
    table = markdown_table(
        [
            "B",
            "FlashDec tok/s",
            "FlashDec ms/step",
            "graph replay alone ms",
            "FlashDec no graphs tok/s",
            "transformers tok/s",
            "vLLM tok/s",
            "vLLM ms/step",
            "floor ms/step",
            "% of floor",
            "attention % of step",
        ],
        table_rows,
    )
    targets = []
    by_batch = {r["batch"]: r for r in rows}
    for batch, target in ((1, 230.0), (64, 9000.0)):
        if batch in by_batch:
            got = by_batch[batch]["flashdec"]["tok_s"]
            verdict = "met" if got >= target else f"missed by {100 * (1 - got / target):.1f}%"
            targets.append(
                f"- B={batch}: {got:,.0f} tok/s against the ≥ {target:,.0f} target: {verdict}"
            )
    memory = (
        f"peak {peak / 2**30:.2f} GiB against weights + KV pool "
        f"{(weight_bytes + pool_bytes) / 2**30:.2f} GiB "
        f"(+{100 * (peak / (weight_bytes + pool_bytes) - 1):.1f}%)"
        if peak
        else "not measured (CPU)"
    )
    profile_table = (
        markdown_table(
            [
                f"kernel class (eager decode step, B={min(64, max(r['batch'] for r in rows))})",
                "µs per step",
                "share %",
            ],
            [[p["class"], p["us_per_step"], p["share_pct"]] for p in profile_rows],
        )
        if profile_rows
        else "(no GPU profile)"
    )
    lat = serve.as_dict()
    markdown = f"""# End to end: FlashDec `LLM` vs transformers and vLLM

{environment_markdown(env)}
- transformers {env["transformers"]}; vLLM: {vllm.get("version") if vllm else "not run"}
- model: {args.model} (random weights), {weight_bytes / 2**30:.2f} GiB; prompt {args.prompt_len},
  {args.new_tokens} new tokens, greedy, EOS ignored; KV pool {pool_bytes / 2**30:.2f} GiB
  ({kv_note})
- copy bandwidth {fmt(copy_tbs, 2)} TB/s

Decode tok/s = B × (N − 1) / (t(N new) − t(1 new)), medians of {args.reps} runs for FlashDec
({args.baseline_reps} for transformers and FlashDec without graphs). The floor is the
bytes one step must read (weights + that step's KV) over the copy bandwidth.

{table}

Targets (ahead of vLLM):
{chr(10).join(targets) or "- (no target batch in this run)"}

Greedy agreement with transformers at B=1 over {agree["steps"]} steps: {agree["tokens_equal"]}
tokens equal, first divergence at step {agree["first_divergence"]}. Teacher-forced on
transformers' tokens, per-step logits against a float32 run of the same model (relative L2):
FlashDec max {agree["max_rel_err_flashdec_vs_fp32"]:.4f} / mean
{agree["mean_rel_err_flashdec_vs_fp32"]:.4f}, transformers' own bf16 max
{agree["max_rel_err_transformers_bf16_vs_fp32"]:.4f} / mean
{agree["mean_rel_err_transformers_bf16_vs_fp32"]:.4f}; {agree["argmax_equal_teacher_forced"]} of
{agree["steps"]} argmaxes agree with transformers'.

Memory (FlashDec: weights + KV pool + the most a run allocated on top, CUDA graphs
included): {memory}.

Poisson arrivals through the serving loop ({serve.config.num_requests} requests at
{serve.config.request_rate}/s, prompts {serve.config.min_prompt_len}–{serve.config.max_prompt_len},
{serve.config.max_new_tokens} new): TTFT p50 {lat["ttft_p50_ms"]:.1f} / p99
{lat["ttft_p99_ms"]:.1f} ms, TPOT p50 {lat["tpot_p50_ms"]:.2f} / p99 {lat["tpot_p99_ms"]:.2f} ms,
{lat["output_tok_s"]:,.0f} output tok/s.

{profile_table}
"""
    out_dir = Path(args.out_dir)
    payload = {
        "env": env,
        "rows": rows,
        "agreement": agree,
        "profile": profile_rows,
        "serve": lat,
        "vllm": vllm,
        "peak_bytes": peak,
        "weight_bytes": weight_bytes,
        "pool_bytes": pool_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_scale": args.kv_scale,
    }
    md, js = write_results(args.name, markdown, payload, out_dir)
    labels = [f"B={r['batch']}" for r in rows]
    bar_plot(
        out_dir / f"{args.name}.png",
        labels,
        {
            "FlashDec": [r["flashdec"]["tok_s"] for r in rows],
            "FlashDec (no graphs)": [r.get("flashdec_eager", {}).get("tok_s") for r in rows],
            "transformers": [r.get("transformers", {}).get("tok_s") for r in rows],
            "vLLM": [vllm_rows.get(r["batch"], {}).get("decode_tok_s") for r in rows],
        },
        "decode tokens / s",
        f"End-to-end decode, {args.model}",
    )
    print(markdown)
    print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
