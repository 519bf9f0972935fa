"""FlashDec inside vLLM 0.24.0 (issue 12): token agreement and decode tok/s against vLLM's default.

Run on the GPU machine after the vLLM recipe (``source .vllm/install.sh .vllm/c4``). Each phase
writes JSON under ``--out`` and finishes well inside 9 minutes; every engine runs in a fresh
subprocess (vLLM does not free GPU memory between two ``LLM`` objects in one process).

  python3 benchmarks/bench_vllm_plugin.py --phase tokens --models llama --out $OUT
  python3 benchmarks/bench_vllm_plugin.py --phase tokens --models qwen2 --out $OUT
  python3 benchmarks/bench_vllm_plugin.py --phase speed --backends default --profile --out $OUT
  python3 benchmarks/bench_vllm_plugin.py --phase speed --backends CUSTOM --profile --out $OUT
  python3 benchmarks/bench_vllm_plugin.py --phase tokens --tp 2 --out $OUT     # 2-GPU machine
  python3 benchmarks/bench_vllm_plugin.py --report DIR   # anywhere, on the fetched JSON files
      # -> benchmarks/results/vllm_plugin.{md,json} (--results-dir to write elsewhere)

tokens: a tiny random-weight Llama (head_dim 128, GQA 2) and Qwen2 (head_dim 64, GQA 4, QKV
bias) saved with ``save_pretrained`` under /tmp; prompts of several lengths as token ids (no
tokenizer); greedy 64 tokens with vLLM's default backend and with ``CUSTOM`` (FlashDec), CUDA
graphs on. Reports token agreement, the first divergence, and per-step log-probability
differences of the top-5 tokens both runs returned. The CUSTOM run counts FlashDec's decode
launches on the device (``FLASHDEC_VLLM_COUNT=1``): a run that went through FlashDec shows
``layers x (new_tokens - 1)`` launches after the reset that precedes generation.

speed: the Llama-3-8B shape with random weights (``load_format="dummy"``), bf16, prompt 1024,
greedy, the same method as ``../shared/tools/vllm/vllm_anchor.py``: decode rate = batch x
(new - 1) / (time(new) - time(1)), median of 3. ``--profile`` adds the attention share of a
decode step from ``torch.profiler`` (kernel times of a 33-token run minus a 1-token run).

The plugin is found through its ``vllm.general_plugins`` entry point. Where flashdec is not
pip-installed (the GPU machine has no registry), the script writes the same entry point as a
minimal ``.dist-info`` under /tmp and puts it on the children's ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402
    environment,
    environment_markdown,
    fmt,
    markdown_table,
    module_version,
    write_results,
)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_DIR = Path("/tmp/flashdec-vllm-entry-point")
CHILD_TIMEOUT_S = 540

TINY_MODELS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=2048,
        rope_theta=10000.0,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
        rope_theta=10000.0,
    ),
}
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    head_dim=128,
    rope_theta=500000.0,
)
COMMON_CONFIG = dict(
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
TOKEN_PROMPT_LENS = (5, 31, 100, 257, 600)
# kernels counted as attention in the profile (FlashAttention 3/2, FlashDec, the K/V write)
ATTENTION_KERNELS = (
    "flash_fwd",
    "flashattn",
    "_decode_kernel",
    "_merge_splits_kernel",
    "reshape_and_cache",
)


# ------------------------------------------------------------------------------------------
# set-up shared by the phases (parent process)
# ------------------------------------------------------------------------------------------
def require_vllm() -> str:
    version = module_version("vllm")
    if version is None:
        sys.exit(
            "bench_vllm_plugin: vLLM is not importable. On the GPU machine, first run the recipe "
            "of ../shared/tools/vllm/README.md (source .vllm/install.sh .vllm/c4)."
        )
    return version


def plugin_entry_point_env() -> dict[str, str]:
    """Environment for children in which vLLM finds flashdec's general-plugin entry point."""
    from importlib.metadata import entry_points

    env = dict(os.environ)
    paths = [str(ROOT)]
    if not any(e.name == "flashdec" for e in entry_points(group=ENTRY_POINT_GROUP)):
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        entries = project["entry-points"][ENTRY_POINT_GROUP]
        info = ENTRY_POINT_DIR / f"flashdec-{project['version']}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: flashdec\nVersion: {project['version']}\n"
        )
        lines = [f"[{ENTRY_POINT_GROUP}]", *(f"{k} = {v}" for k, v in entries.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        paths.append(str(ENTRY_POINT_DIR))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["VLLM_PLUGINS"] = "flashdec"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def run_child(spec: dict, env: dict[str, str], out_dir: Path) -> dict:
    """One engine in a fresh process; returns what it wrote (or the failure)."""
    name = f"{spec['phase']}-{spec['model']}-{spec['backend']}-tp{spec['tp']}"
    result_path = out_dir / f"{name}.child.json"
    log_path = out_dir / f"{name}.log"
    spec = dict(spec, result=str(result_path))
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    wall = time.time() - t0
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text()[-3000:]
        print(f"[{name}] FAILED rc={proc.returncode} after {wall:.0f}s\n{tail}", flush=True)
        return dict(spec, ok=False, rc=proc.returncode, wall_s=wall, log_tail=tail)
    result = json.loads(result_path.read_text())
    print(f"[{name}] ok in {wall:.0f}s", flush=True)
    return dict(result, ok=True, wall_s=wall)


def save_tiny_model(name: str) -> str:
    """Random bf16 weights (fixed seed) saved once; both backends load the same files."""
    import torch
    import transformers

    path = Path(f"/tmp/flashdec-vllm-{name}")
    if (path / "config.json").exists():
        return str(path)
    fields = dict(COMMON_CONFIG, **TINY_MODELS[name])
    fields.pop("architectures")
    model_type = fields.pop("model_type")
    # wider initialisation than HF's 0.02: peaked logits, so greedy ties are rarer
    config = transformers.AutoConfig.for_model(model_type, initializer_range=0.1, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


def config_only_model(name: str, fields: dict) -> str:
    path = Path(f"/tmp/flashdec-vllm-{name}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(COMMON_CONFIG, **fields)))
    return str(path)


# ------------------------------------------------------------------------------------------
# child: one vLLM engine
# ------------------------------------------------------------------------------------------
def child_main(spec: dict) -> None:
    import random

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    import flashdec.vllm_plugin as plugin

    kwargs = dict(
        model=spec["model_dir"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        max_model_len=4096,
        enable_prefix_caching=False,
        tensor_parallel_size=spec["tp"],
    )
    if spec["phase"] == "speed":
        kwargs["load_format"] = "dummy"
    if spec["backend"] == "CUSTOM":
        kwargs["attention_config"] = {"backend": "CUSTOM"}
    t0 = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - t0
    model_config = llm.llm_engine.model_config
    result = dict(
        spec,
        vllm=vllm.__version__,
        torch=torch.__version__,
        init_s=init_s,
        gpu=torch.cuda.get_device_name(0),
        num_layers=model_config.hf_config.num_hidden_layers,
    )

    def stats(reset: bool = False):
        try:
            fn = plugin.reset_stats if reset else plugin.collect_stats
            return llm.collective_rpc(fn)
        except Exception as exc:  # stats are evidence, not the measurement
            return [dict(error=f"{type(exc).__name__}: {exc}")]

    vocab = model_config.get_vocab_size()
    rng = random.Random(0)
    if spec["phase"] == "tokens":
        prompts = [
            {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(n)]}
            for n in TOKEN_PROMPT_LENS
        ]
        params = SamplingParams(
            max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True, logprobs=5
        )
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        stats(reset=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["stats"] = stats()
        result["outputs"] = [
            dict(
                prompt_len=len(p["prompt_token_ids"]),
                tokens=list(o.outputs[0].token_ids),
                logprobs=[
                    {str(t): lp.logprob for t, lp in (step or {}).items()}
                    for step in o.outputs[0].logprobs or []
                ],
            )
            for p, o in zip(prompts, outs, strict=True)
        ]
    else:
        result["rows"] = speed_rows(llm, spec, vocab, rng)
        result["stats"] = stats()
    Path(spec["result"]).write_text(json.dumps(result))


def speed_rows(llm, spec: dict, vocab: int, rng) -> list[dict]:
    import torch
    from vllm import SamplingParams

    def make_prompts(bs):
        return [
            {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(spec["prompt_len"])]}
            for _ in range(bs)
        ]

    def timed(bs, new):
        prompts = make_prompts(bs)
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return time.perf_counter() - t0

    for bs in spec["batches"]:
        timed(bs, 4)  # warm-up
    rows, reps, new = [], spec["reps"], spec["new_tokens"]
    for bs in spec["batches"]:
        t1 = statistics.median(timed(bs, 1) for _ in range(reps))
        tn = statistics.median(timed(bs, new) for _ in range(reps))
        row = dict(
            batch=bs,
            decode_tok_s=bs * (new - 1) / (tn - t1),
            step_ms=(tn - t1) / (new - 1) * 1e3,
            ttft_s=t1,
            total_s=tn,
        )
        if spec.get("profile"):
            row["attention_share"] = attention_share(lambda n, bs=bs: timed(bs, n))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def attention_share(run) -> dict:
    """Attention's share of decode-step GPU time: per-kernel time of a 33-token generation
    minus a 1-token one (the prefill cancels), attention kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    def kernel_us(new):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(new)
        return {e.key: e.device_time_total for e in prof.key_averages()}

    try:
        one, many = kernel_us(1), kernel_us(33)
    except Exception as exc:
        return dict(error=f"{type(exc).__name__}: {exc}")
    diff = {k: many[k] - one.get(k, 0.0) for k in many}
    diff = {k: v for k, v in diff.items() if v > 0}
    total = sum(diff.values())
    attn = {k: v for k, v in diff.items() if any(p in k.lower() for p in ATTENTION_KERNELS)}
    top = sorted(attn.items(), key=lambda kv: -kv[1])[:6]
    return dict(
        share=sum(attn.values()) / total if total else None,
        attention_us_per_step=sum(attn.values()) / 32,
        total_us_per_step=total / 32,
        kernels={k: v / 32 for k, v in top},
    )


# ------------------------------------------------------------------------------------------
# phases (parent process)
# ------------------------------------------------------------------------------------------
def compare_tokens(default: dict, custom: dict) -> list[dict]:
    rows = []
    for a, b in zip(default["outputs"], custom["outputs"], strict=True):
        ta, tb = a["tokens"], b["tokens"]
        first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
        diffs = []  # per step up to the divergence: top-5 tokens both runs returned
        for i, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            if first is not None and i > first:
                break
            common = la.keys() & lb.keys()
            if common:
                diffs.append(max(abs(la[t] - lb[t]) for t in common))
        rows.append(
            dict(
                prompt_len=a["prompt_len"],
                new_tokens=len(ta),
                agree=sum(x == y for x, y in zip(ta, tb, strict=True)),
                identical=ta == tb,
                first_divergence=first,
                max_logprob_diff=max(diffs) if diffs else None,
                mean_logprob_diff=statistics.fmean(diffs) if diffs else None,
            )
        )
    return rows


def phase_tokens(args, env, out_dir: Path) -> dict:
    env = dict(env, FLASHDEC_VLLM_COUNT="1")
    models = {}
    for name in args.models:
        spec = dict(
            phase="tokens",
            model=name,
            model_dir=save_tiny_model(name),
            tp=args.tp,
            new_tokens=64,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        runs = {b: run_child(dict(spec, backend=b), env, out_dir) for b in ("default", "CUSTOM")}
        entry = dict(
            runs={b: {k: v for k, v in r.items() if k != "outputs"} for b, r in runs.items()}
        )
        if all(r["ok"] for r in runs.values()):
            entry["prompts"] = compare_tokens(runs["default"], runs["CUSTOM"])
            layers = runs["CUSTOM"]["num_layers"]
            entry["expected_device_launches_per_worker"] = layers * (spec["new_tokens"] - 1)
        models[name] = entry
    return dict(phase="tokens", tp=args.tp, models=models)


def phase_speed(args, env, out_dir: Path) -> dict:
    model_dir = config_only_model("llama3-8b", LLAMA3_8B)
    spec = dict(
        phase="speed",
        model="llama3-8b",
        model_dir=model_dir,
        tp=args.tp,
        batches=args.batches,
        prompt_len=1024,
        new_tokens=128,
        reps=3,
        profile=args.profile,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    runs = {b: run_child(dict(spec, backend=b), env, out_dir) for b in args.backends}
    return dict(phase="speed", tp=args.tp, runs=runs)


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
TOKEN_COLUMNS = ["prompt", "agree", "first divergence", "max abs Δ logprob", "mean abs Δ logprob"]
SPEED_COLUMNS = [
    "batch",
    "default tok/s",
    "default ms/step",
    "CUSTOM tok/s",
    "CUSTOM ms/step",
    "CUSTOM / default",
    "attn share default",
    "attn share CUSTOM",
]


def tokens_markdown(ph: dict) -> list[str]:
    lines = [f"## Greedy tokens, CUSTOM vs default (TP={ph['tp']}, 64 new tokens)", ""]
    for name, entry in ph["models"].items():
        stats = entry["runs"].get("CUSTOM", {}).get("stats")
        expected = entry.get("expected_device_launches_per_worker")
        lines += [
            f"**{name}**: FlashDec counters per worker `{json.dumps(stats)}`; expected device "
            f"launches per worker: {expected}",
            "",
        ]
        rows = [
            [
                r["prompt_len"],
                f"{r['agree']}/{r['new_tokens']}",
                fmt(r["first_divergence"]),
                fmt(r["max_logprob_diff"], 4),
                fmt(r["mean_logprob_diff"], 4),
            ]
            for r in entry.get("prompts", [])
        ]
        lines += [markdown_table(TOKEN_COLUMNS, rows), ""]
    return lines


def speed_markdown(ph: dict) -> list[str]:
    lines = [f"## Decode tok/s, Llama-3-8B shape, random weights (TP={ph['tp']})", ""]
    by_backend = {b: {r["batch"]: r for r in run.get("rows", [])} for b, run in ph["runs"].items()}
    rows = []
    for bs in sorted({b for rows in by_backend.values() for b in rows}):
        d = by_backend.get("default", {}).get(bs) or {}
        c = by_backend.get("CUSTOM", {}).get(bs) or {}
        ratio = c["decode_tok_s"] / d["decode_tok_s"] if c and d else None
        rows.append(
            [
                bs,
                d.get("decode_tok_s"),
                d.get("step_ms"),
                c.get("decode_tok_s"),
                c.get("step_ms"),
                fmt(ratio, 3),
                fmt((d.get("attention_share") or {}).get("share"), 3),
                fmt((c.get("attention_share") or {}).get("share"), 3),
            ]
        )
    return [*lines, markdown_table(SPEED_COLUMNS, rows), ""]


def merge_speed(phases: list[dict]) -> list[dict]:
    """Speed phases of one TP size run as separate calls (one backend each) become one."""
    merged: dict[int, dict] = {}
    for ph in phases:
        if ph["phase"] == "speed":
            merged.setdefault(ph["tp"], dict(phase="speed", tp=ph["tp"], runs={}))
            merged[ph["tp"]]["runs"].update(ph["runs"])
    return list(merged.values())


def tokens_phases_from_children(in_dir: Path, skip_tp: set[int]) -> list[dict]:
    """Token phases rebuilt from the engines' own ``*.child.json`` files, for runs whose
    phase file did not come back (the device returns at most 8 files); TP sizes in
    ``skip_tp`` have their phase file."""
    children = [json.loads(p.read_text()) for p in sorted(in_dir.glob("**/tokens-*.child.json"))]
    by_tp: dict[int, dict] = {}
    for child in children:
        if child["tp"] in skip_tp:
            continue
        phase = by_tp.setdefault(child["tp"], dict(phase="tokens", tp=child["tp"], models={}))
        entry = phase["models"].setdefault(child["model"], dict(runs={}, outputs={}))
        entry["outputs"][child["backend"]] = child
        entry["runs"][child["backend"]] = {k: v for k, v in child.items() if k != "outputs"}
    for phase in by_tp.values():
        for entry in phase["models"].values():
            outputs = entry.pop("outputs")
            if {"default", "CUSTOM"} <= outputs.keys() and all(
                r.get("outputs") for r in outputs.values()
            ):
                entry["prompts"] = compare_tokens(outputs["default"], outputs["CUSTOM"])
                entry["expected_device_launches_per_worker"] = outputs["CUSTOM"]["num_layers"] * (
                    outputs["CUSTOM"]["new_tokens"] - 1
                )
    return list(by_tp.values())


def report(in_dir: Path, results_dir: Path | None = None) -> None:
    phases = [json.loads(p.read_text()) for p in sorted(in_dir.glob("**/vllm_plugin_*.json"))]
    phases += tokens_phases_from_children(
        in_dir, {ph["tp"] for ph in phases if ph["phase"] == "tokens"}
    )
    if not phases:
        sys.exit(f"no vllm_plugin_*.json under {in_dir}")
    # the GPU run's environment (the report itself may run anywhere)
    env = next((ph["environment"] for ph in phases if ph.get("environment")), environment())
    runs = [r for ph in phases for r in (ph.get("runs") or {}).values()]
    runs += [
        r for ph in phases for m in (ph.get("models") or {}).values() for r in m["runs"].values()
    ]
    vllm_version = next((r["vllm"] for r in runs if r.get("vllm")), None)
    lines = ["# FlashDec under vLLM (CUSTOM attention backend)", ""]
    lines += [environment_markdown(env), f"- vLLM: {vllm_version}", ""]
    lines.append(
        "Commands of the phases: "
        + "; ".join(f"`{ph['environment']['command']}`" for ph in phases if ph.get("environment"))
    )
    lines.append("")
    for ph in [p for p in phases if p["phase"] == "tokens"]:
        lines += tokens_markdown(ph)
    for ph in merge_speed(phases):
        lines += speed_markdown(ph)
    payload = dict(environment=env, vllm=vllm_version, phases=phases)
    write_results("vllm_plugin", "\n".join(lines), payload, results_dir)
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--phase", choices=("tokens", "speed"))
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument(
        "--backends", nargs="+", default=["default", "CUSTOM"], choices=("default", "CUSTOM")
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=list(TINY_MODELS),
        choices=list(TINY_MODELS),
        help="tokens: which tiny models",
    )
    p.add_argument("--profile", action="store_true", help="speed: attention share of a step")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--out", default="benchmarks/results/vllm_plugin_raw")
    p.add_argument("--report", metavar="DIR", help="write benchmarks/results/vllm_plugin.*")
    p.add_argument("--results-dir", help="--report: where vllm_plugin.{md,json} go")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return
    if args.report:
        report(Path(args.report), Path(args.results_dir) if args.results_dir else None)
        return
    if not args.phase:
        p.error("give --phase tokens|speed or --report DIR")
    print(f"vLLM {require_vllm()}", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = plugin_entry_point_env()
    result = (phase_tokens if args.phase == "tokens" else phase_speed)(args, env, out_dir)
    result["environment"] = environment()
    parts = args.models if args.phase == "tokens" else args.backends
    path = out_dir / f"vllm_plugin_{args.phase}_tp{args.tp}_{'-'.join(parts)}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
