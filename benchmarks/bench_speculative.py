"""Speculative decoding (ngram prompt lookup) against plain decoding (issue 23): the
mechanism's cost, then end to end through ``flashdec.LLM.generate``, with vLLM beside it.

Sections (``--sections``, all by default):
- ``mechanism``: on the Llama-3-8B shape (random weights), a verification step of n = 2, 4, 8
  tokens per request at B = 1, 8, 64 against the one-token step of the same batch, each as
  ``flashdec.LLM`` runs it (benchmarks/spec_mechanism.py: the one-token step replays its CUDA
  graph; the LLM speculates ``n = 4`` tokens a step (3 drafts), so that width's verification
  step replays its graph too, the others run packed and eager; both aborted, contexts of
  ``--mechanism-context`` tokens); medians of CUDA-event timings. ``--reuse-json F`` takes these
  rows from an earlier run of this script instead (a device call of its own).
- ``real``: ``--real-model`` (SmolLM2-135M-Instruct, bf16 on a GPU) on input-grounded chat
  prompts (rewrite, fix typos, continue a list, edit code): the answer copies its input, so
  prompt lookup hits; at batch 1 every prompt runs alone, one ``generate`` call after another
  (:func:`generate_calls`), at larger batches the prompts are cycled to the batch;
- ``random``: the Llama-3-8B random shape on random prompts, EOS ignored: drafts almost never
  match, so this row is the cost of speculation when it does not pay (the adaptivity check).
Per end-to-end row: generated tokens per second (median of ``--reps`` timed runs after one
untimed warm-up, CUDA-synchronised), drafts, acceptance rate, tokens per request step, whether
the output equals plain greedy token for token, and ngram / off; ``ngram`` is the default
config (speculation held off where it measures slower than plain decoding: ``held plain``
steps), ``ngram-always`` speculates whenever drafts are found. With ``--vllm-json`` (files
from vllm_speculative.py: vLLM 0.24.0 off and ``ngram`` on the same prompts and weights) vLLM's
rows stand beside the real model's, and issue 23's targets are judged: the mechanism's at
B = 1, n = 4, and at B = 1 ngram >= 1.8x FlashDec's own plain tok/s and >= vLLM's ngram tok/s.

On the GPU machine (scripts/gpu_spec_lease.sh runs the whole lease):
  PYTHONPATH=. python3 benchmarks/bench_speculative.py --real-model /tmp/smollm2-bf16 \\
      --vllm-json $OUT/vllm_spec.json --out-dir $OUT
Locally, a check of the script itself (seconds): python3 benchmarks/bench_speculative.py --smoke
Writes speculative.md and speculative.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    RESULTS_DIR,
    environment,
    environment_markdown,
    markdown_table,
    sync,
    write_results,
)
from benchmarks.spec_mechanism import TARGET_WIDTH, measure_mechanism, mechanism_target

SECTIONS = ("mechanism", "real", "random")
# issue 23, at B = 1: ngram tok/s >= 1.8x FlashDec's plain tok/s, and >= vLLM's ngram tok/s
SPEEDUP_TARGET = 1.8
TARGET_BATCH = 1
# end-to-end modes -> SpeculativeConfig.min_speedup: "ngram" is what a user gets (speculation
# held off where it measures slower than plain decoding), "ngram-always" speculates whenever
# drafts are found (the mechanism's own gain or loss)
MODES = {"off": None, "ngram": 1.0, "ngram-always": None}

# Chat turns whose answers restate their input (what prompt lookup is for).
GROUNDED_PROMPTS = (
    "Rewrite this paragraph in a more formal tone, keeping every fact: The new library opened "
    "on Monday. It has three floors, a cafe and a big room for kids. People can borrow books, "
    "movies and laptops for free. The library is open every day from 9 to 9.",
    "Fix the typos in the following text and return the corrected text only: Teh quick brwon "
    "fox jumpd over the lazzy dog. It was a sunny day and the fox was verry happy becuase it "
    "had found a new freind in the forest.",
    "Continue this list with five more items in the same format:\n1. Apples - red, sweet\n"
    "2. Bananas - yellow, soft\n3. Cherries - red, small\n4. Dates - brown, sticky\n",
    "Rename the variable `x` to `total` in this Python function and return the whole "
    "function:\ndef add_all(values):\n    x = 0\n    for v in values:\n        x = x + v\n"
    "    return x\n",
    "Add type hints to this function and return the full code:\ndef greet(name, times):\n"
    "    for i in range(times):\n        print('Hello, ' + name)\n    return times\n",
    "Convert this list to a Markdown table with columns Name and Age: Alice 31, Bob 27, "
    "Carol 45, Dave 38, Erin 29, Frank 52.",
    "Summarize by repeating the key sentence of each paragraph: The sun is a star. It is very "
    "hot.\n\nThe moon orbits the earth. It has no light of its own.\n\nMars is a planet. It "
    "is red.",
    "Translate these variable names from camelCase to snake_case, one per line: userName, "
    "accountBalance, lastLoginDate, isActiveUser, maxRetryCount, defaultTimeoutSeconds.",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sections",
        nargs="*",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="what to measure now (none: only merge --reuse-json and --vllm-json)",
    )
    p.add_argument(
        "--real-model",
        default="smollm2",
        help="a built-in real model (chat) or a model directory (export_real_model.py's)",
    )
    p.add_argument("--random-model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new", type=int, default=256, help="tokens per request at most")
    p.add_argument("--random-prompt", type=int, default=512, help="random prompts' tokens")
    p.add_argument("--num-tokens", type=int, default=4, help="drafts per request per step")
    p.add_argument("--reps", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mechanism-model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--mechanism-batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--mechanism-n", type=int, nargs="+", default=[2, 4, 8], help="tokens/request")
    p.add_argument("--mechanism-context", type=int, default=512, help="context tokens")
    p.add_argument("--mechanism-reps", type=int, default=20, help="timed steps (median)")
    p.add_argument("--mechanism-warmup", type=int, default=3)
    p.add_argument(
        "--reuse-json",
        nargs="+",
        help="earlier runs' JSON (other sections, other device calls): their rows join these",
    )
    p.add_argument("--vllm-json", nargs="+", help="vllm_speculative.py's --json output(s)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="speculative")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds on the CPU: smollm2 at batch 1 when it loads here (else the tiny shape), "
        "the tiny shape at batch 1 and 2, few tokens, one rep; the mechanism on the tiny shape",
    )
    args = p.parse_args(argv)
    if args.smoke:
        from flashdec.models import REAL_MODELS, real_model_problem

        if args.real_model in REAL_MODELS and real_model_problem(args.real_model) is not None:
            args.real_model = "tiny"  # no tokenizer: random prompts stand in
        args.random_model, args.batch, args.new, args.random_prompt = "tiny", [1, 2], 8, 24
        args.reps = 1
        args.mechanism_model, args.mechanism_batch, args.mechanism_n = "tiny", [1, 2], [2, 4]
        args.mechanism_context, args.mechanism_reps, args.mechanism_warmup = 24, 2, 1
    return args


def _device_dtype() -> tuple[str, torch.dtype]:
    """bf16 on a GPU (issue 23's setting, real models included: they load as float32 by
    default); float32 on a CPU, where bf16 matmuls crawl."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def grounded_prompts(tokenizer, batch: int) -> list[list[int]]:
    """The grounded chat turns, cycled to ``batch``, in the tokenizer's chat template (the
    prompts vllm_speculative.py gives vLLM too)."""
    from flashdec.models import chat_prompt

    turns = [GROUNDED_PROMPTS[i % len(GROUNDED_PROMPTS)] for i in range(batch)]
    return [chat_prompt(tokenizer, t) for t in turns]


def _prompts(loaded, batch: int, args) -> tuple[list[list[int]], bool]:
    """``batch`` prompts (the grounded chat turns, cycled, or seeded random ids) and whether
    EOS is ignored (real chat: no; random weights: yes, every request runs ``--new``)."""
    if loaded.tokenizer is not None:
        return grounded_prompts(loaded.tokenizer, batch), False
    gen = torch.Generator().manual_seed(args.seed)
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, args.random_prompt), generator=gen)
    return ids.tolist(), True


def generate_calls(prompts: list[list[int]], batch: int, real: bool) -> list[list[list[int]]]:
    """The ``generate`` calls of one timed run: on the real model at batch 1, every grounded turn
    alone, one after another (one chat answer alone is too short to time, and its prefill would
    weigh in); otherwise one call of the ``batch`` prompts. vllm_speculative.py runs the same."""
    if real and batch == 1:
        return [[p] for p in prompts]
    return [prompts]


def _measure(llm, calls: list[list[list[int]]], args, ignore_eos: bool) -> dict:
    """One untimed warm-up of every call, then ``--reps`` timed runs of them all; drafts,
    acceptance and tokens per step from the runner's counters over the last run."""
    device = llm.adapter.spec.device
    for prompts in calls:  # compiles, captures, caches
        llm.generate(prompts, args.new, ignore_eos=ignore_eos)
    counters = llm._runner.counters  # read-only: running totals of drafts and steps
    rates, outputs, counts = [], [], {}
    for _ in range(args.reps):
        before = dict(counters)
        sync(device)
        start = time.perf_counter()
        outputs = [
            o for prompts in calls for o in llm.generate(prompts, args.new, ignore_eos=ignore_eos)
        ]
        sync(device)
        elapsed = time.perf_counter() - start
        counts = {k: counters[k] - before[k] for k in counters}
        rates.append(sum(map(len, outputs)) / elapsed)
    drafts, accepted = counts["draft_tokens"], counts["accepted_tokens"]
    return {
        "tok_s": statistics.median(rates),
        "tok_s_reps": rates,
        "generate_calls": len(calls),
        "generated_tokens": sum(map(len, outputs)),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "tokens_per_step": counts["step_tokens"] / max(1, counts["request_steps"]),
        "held_steps": counts["held_steps"],
        "outputs": [list(o) for o in outputs],
    }


def run_model(name: str, kind: str, args) -> list[dict]:
    """Both modes at every batch for one model; one ``flashdec.LLM`` alive at a time (each
    sizes a KV pool of its own)."""
    import flashdec
    from flashdec.models import resolve_model

    device, dtype = _device_dtype()
    loaded = resolve_model(name, dtype=dtype, device=device, seed=args.seed)
    rows = []
    batches = args.batch if loaded.tokenizer is None or not args.smoke else args.batch[:1]
    for batch in batches:
        real = loaded.tokenizer is not None
        prompts, ignore_eos = _prompts(
            loaded, len(GROUNDED_PROMPTS) if real and batch == 1 else batch, args
        )
        calls = generate_calls(prompts, batch, real)
        longest = max(map(len, prompts)) + args.new
        plain = None
        for mode, gate in MODES.items():
            speculative = None
            if mode != "off":
                speculative = flashdec.SpeculativeConfig(
                    num_tokens=args.num_tokens, min_speedup=gate
                )
            llm = flashdec.LLM(
                loaded.model,
                tokenizer=loaded.tokenizer,
                max_batch_size=batch,
                max_model_len=longest,
                num_blocks=batch * (longest // 16 + 2) + 16,
                speculative=speculative,
            )
            result = _measure(llm, calls, args, ignore_eos)
            verify = llm._runner.verify_graphs  # read-only: how its verification steps ran
            result["verify_graph_replays"] = 0 if verify is None else verify.replays
            outputs = result["outputs"]
            if plain is None:
                plain = outputs
            rows.append(
                {
                    "model": name,
                    "kind": kind,
                    "batch": batch,
                    "mode": mode,
                    "cuda_graphs": llm.cuda_graphs,
                    "dtype": str(loaded.model.dtype).removeprefix("torch."),
                    "identical_to_off": outputs == plain,
                    **result,
                }
            )
            print({k: v for k, v in rows[-1].items() if k != "outputs"}, flush=True)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    del loaded
    gc.collect()
    return rows


def run_mechanism(args) -> list[dict]:
    """The mechanism rows (spec_mechanism.py) on ``--mechanism-model``: one LLM sized for the
    largest batch, graphs as ``flashdec.LLM`` decides (on a GPU: captured), speculating the
    target's width (its verification graphs are of ``n = TARGET_WIDTH``)."""
    import flashdec
    from flashdec.models import resolve_model

    device, dtype = _device_dtype()
    loaded = resolve_model(args.mechanism_model, dtype=dtype, device=device, seed=args.seed)
    batch = max(args.mechanism_batch)
    longest = args.mechanism_context + 160  # the prefill's decodes and the widest step fit
    llm = flashdec.LLM(
        loaded.model,
        max_batch_size=batch,
        max_model_len=longest,
        num_blocks=batch * (longest // 16 + 2) + 16,
        speculative=flashdec.SpeculativeConfig(num_tokens=TARGET_WIDTH - 1, min_speedup=None),
    )
    rows = measure_mechanism(
        llm,
        args.mechanism_batch,
        args.mechanism_n,
        context=args.mechanism_context,
        reps=args.mechanism_reps,
        warmup=args.mechanism_warmup,
        seed=args.seed,
    )
    for r in rows:
        r["model"] = args.mechanism_model
    del llm, loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


SECTION_OF_KIND = {"grounded chat": "real", "random weights": "random"}


def load_reused(paths: list[str], sections: list[str]) -> tuple[list, list, dict]:
    """Mechanism rows, end-to-end rows and the environment of earlier runs of this script, for
    sections not measured now (ValueError for another file, or a section measured twice)."""
    mechanism, rows, env = [], [], None
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not all(isinstance(data.get(k), list) for k in ("mechanism", "rows")):
            raise ValueError(f"{path} is not bench_speculative.py's JSON (no mechanism/rows)")
        found = _sections_of(data["mechanism"], data["rows"])
        twice = sorted(found & (set(sections) | _sections_of(mechanism, rows)))
        if twice:
            raise ValueError(f"{path}: section(s) {', '.join(twice)} measured twice")
        mechanism += data["mechanism"]
        rows += data["rows"]
        env = env or data.get("environment")
    return mechanism, rows, env


def _sections_of(mechanism: list, rows: list) -> set:
    return {SECTION_OF_KIND.get(r.get("kind")) for r in rows} | (
        {"mechanism"} if mechanism else set()
    )


def load_vllm(paths: list[str], args) -> dict:
    """vllm_speculative.py's JSON files (one per mode when they ran apart), checked to have
    served what this run serves: the same settings and, for a model directory, the same one."""
    from benchmarks.vllm_speculative import COMPARED_ARGS

    merged = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data.get("rows"), list) or not isinstance(data.get("args"), dict):
            raise ValueError(f"{path} is not vllm_speculative.py's --json output (no rows/args)")
        theirs = data["args"]
        ours = {**vars(args), **_speculative_defaults(args)}
        differ = [
            f"{k}: ours {ours[k]!r}, vLLM's {theirs.get(k)!r}"
            for k in COMPARED_ARGS
            if theirs.get(k) != ours[k]
        ]
        if Path(args.real_model).is_dir() and theirs.get("model_dir") != args.real_model:
            differ.append(f"model: ours {args.real_model}, vLLM's {theirs.get('model_dir')}")
        if differ:
            raise ValueError(f"{path} served other requests than this run: " + "; ".join(differ))
        if merged is None:
            merged = {**data, "rows": list(data["rows"]), "engine_args": dict(data["engine_args"])}
        else:
            merged["rows"] += data["rows"]
            merged["engine_args"].update(data["engine_args"])
    return merged


def _speculative_defaults(args) -> dict:
    """The ngram lengths FlashDec's rows run with (SpeculativeConfig's defaults)."""
    from flashdec.speculative import SpeculativeConfig

    config = SpeculativeConfig(num_tokens=args.num_tokens)
    return {"min_ngram": config.min_ngram, "max_ngram": config.max_ngram}


def _goal(target: str, value, bar, met, margin: str) -> dict:
    return {"target": target, "value": value, "bar": bar, "met": met, "margin": margin}


def targets(rows: list[dict], mechanism: list[dict], vllm: dict | None) -> list[dict]:
    """Issue 23's targets, each met (True), missed (False) or not measured (None), with the
    margin: the mechanism's, then the real model's at B = 1 against FlashDec's plain decoding
    and vLLM's ngram."""
    goals = [mechanism_target(mechanism)] if mechanism else []
    real = {(r["batch"], r["mode"]): r for r in rows if r["kind"] == "grounded chat"}
    off, ngram = real.get((TARGET_BATCH, "off")), real.get((TARGET_BATCH, "ngram"))
    name = f"B = {TARGET_BATCH}: ngram tok/s >= {SPEEDUP_TARGET}x FlashDec without speculation"
    if off is None or ngram is None:
        goals.append(_goal(name, None, SPEEDUP_TARGET, None, "no real-model rows"))
    else:
        speedup = ngram["tok_s"] / off["tok_s"]
        margin = f"{speedup:.2f}x ({speedup - SPEEDUP_TARGET:+.2f}x)"
        goals.append(_goal(name, speedup, SPEEDUP_TARGET, speedup >= SPEEDUP_TARGET, margin))
    name = f"B = {TARGET_BATCH}: ngram tok/s >= vLLM's ngram tok/s"
    peer = {(r["batch"], r["mode"]): r for r in (vllm or {}).get("rows", [])}
    theirs = peer.get((TARGET_BATCH, "ngram"))
    if ngram is None or theirs is None:
        missing = "no real-model rows" if ngram is None else "no vLLM ngram row at B = 1"
        missing = missing if vllm or ngram is None else "no --vllm-json"
        goals.append(_goal(name, None if ngram is None else ngram["tok_s"], None, None, missing))
    else:
        diff = ngram["tok_s"] - theirs["tok_s"]
        margin = f"{diff:+.0f} tok/s ({diff / theirs['tok_s']:+.1%}) vs vLLM"
        met = ngram["tok_s"] >= theirs["tok_s"]
        goals.append(_goal(name, ngram["tok_s"], theirs["tok_s"], met, margin))
    return goals


def _verdict(met) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def _mechanism_lines(mechanism: list[dict]) -> list[str]:
    if not mechanism:
        return []
    table = [
        [
            r["batch"],
            r["n"],
            f"{r['context_min']}..{r['context_max']}",
            f"{r['one_token_ms']:.3f}",
            f"{r['verify_ms']:.3f}",
            f"{r['ratio']:.2f}x",
            "graph" if r["one_token_graph"] else "eager",
            {True: "graph", False: "eager", None: "eager (before graphs)"}[r.get("verify_graph")],
        ]
        for r in mechanism
    ]
    columns = ["B", "n", "context", "one-token step (ms)", "verify step (ms)", "ratio"]
    columns += ["one-token step ran", "verify step ran"]
    reps = len(mechanism[0]["verify_ms_reps"])
    return [
        f"## Mechanism cost ({mechanism[0].get('model', '?')}, random weights)",
        "",
        f"A verification step of n tokens per request against the one-token step of the same "
        f"batch, as flashdec.LLM runs each (the verification step of the LLM's own width "
        f"replays its CUDA graph, other widths run packed and eager; logits for all B x n rows "
        f"and their argmax read back); both aborted, nothing committed. "
        f"Medians of {reps} timings per step (CUDA events on a GPU), interleaved.",
        "",
        markdown_table(columns, table),
        "",
    ]


def _speculation_cells(r: dict) -> list:
    """A row's speculation mode, tok/s, drafts, acceptance and tokens per step (either engine)."""
    spec = r["mode"] != "off"
    return [
        r["mode"],
        r["tok_s"],
        f"{r['draft_tokens']:,}" if spec else "—",
        f"{100 * r['acceptance_rate']:.1f}%" if spec else "—",
        f"{r['tokens_per_step']:.2f}",
    ]


def _vllm_lines(rows: list[dict], vllm: dict | None) -> list[str]:
    if not vllm:
        return []
    base = {r["batch"]: r for r in rows if r["kind"] == "grounded chat" and r["mode"] == "off"}
    table = []
    for r in vllm["rows"]:
        mine = base.get(r["batch"])
        same = "—"
        if mine is not None:
            pairs = zip(mine["outputs"], r["outputs"], strict=True)
            same = f"{sum(a == b for a, b in pairs)}/{len(r['outputs'])}"
        table.append(
            [
                r["batch"],
                *_speculation_cells(r),
                f"{r['generated_tokens']:,}",
                "—" if mine is None else f"{r['tok_s'] / mine['tok_s']:.2f}",
                same,
            ]
        )
    columns = ["batch", "speculation", "tok/s (median)", "drafts", "accepted", "tokens/step"]
    columns += ["tokens", "vs FlashDec off", "requests = FlashDec off"]
    settings = vllm.get("engine_args", {}).get("ngram", {}).get("speculative_config")
    return [
        f"## vLLM {vllm.get('version', '?')} on the same prompts and weights",
        "",
        f"- {vllm.get('gpu')}; `vllm.LLM.generate` in one process, greedy, the same chat "
        f"prompts and max tokens; speculation: `{settings}`",
        "- acceptance from `vllm:spec_decode_num_draft_tokens` / `..._num_accepted_tokens` "
        "(the last timed call); tokens/step = decode tokens / (decode tokens - accepted)",
        "- `requests = FlashDec off`: answers identical token for token to FlashDec's plain "
        "greedy ones (bf16 kernels differ: a near tie can flip a token)",
        "",
        markdown_table(columns, table),
        "",
    ]


def report(
    args,
    env: dict,
    rows: list[dict],
    mechanism: list[dict] | None = None,
    vllm: dict | None = None,
) -> str:
    mechanism = mechanism or []
    off = {(r["model"], r["batch"]): r for r in rows if r["mode"] == "off"}
    table = []
    for r in rows:
        base = off[(r["model"], r["batch"])]
        spec = r["mode"] != "off"
        table.append(
            [
                f"{r['model']} ({r['kind']})",
                r["batch"],
                *_speculation_cells(r),
                f"{r['tok_s'] / base['tok_s']:.2f}" if spec else "1.00",
                "yes" if r["identical_to_off"] else "NO",
                r.get("verify_graph_replays", "—") if spec else "—",
                f"{r['held_steps']:,}" if spec and "held_steps" in r else "—",
            ]
        )
    columns = ["model", "batch", "speculation", "tok/s (median)", "drafts", "accepted"]
    columns += ["tokens/step", "vs off", "output = off", "graphed verify steps", "held plain"]
    goals = targets(rows, mechanism, vllm)
    lines = [
        "# Speculative decoding (ngram prompt lookup) vs plain decoding",
        "",
        environment_markdown(env),
        *([f"- merged by: `{env['merged_by']}`"] if env.get("merged_by") else []),
        "",
        "## Targets (issue 23)",
        "",
        markdown_table(
            ["target", "verdict", "margin"],
            [[g["target"], _verdict(g["met"]), g["margin"]] for g in goals],
        ),
        "",
        *_mechanism_lines(mechanism),
    ]
    if rows:
        dtypes = ", ".join(sorted({f"{r['model']}: {r['dtype']}" for r in rows}))
        lines += [
            "## End to end (flashdec.LLM.generate)",
            "",
            f"- {args.num_tokens} drafts per request per step at most; greedy; one untimed "
            f"warm-up, then the median of {args.reps} timed `LLM.generate` calls "
            f"(CUDA-synchronised); {dtypes}",
            f"- {args.real_model}: the built-in grounded chat prompts (at batch 1 each of the "
            f"{len(GROUNDED_PROMPTS)} alone, one `generate` call after another; at larger "
            f"batches cycled to the batch, one call), up "
            f"to {args.new} new tokens, EOS ends a request; {args.random_model}: random prompts "
            f"of {args.random_prompt} tokens, {args.new} new tokens, EOS ignored",
            "- plain steps replay decode graphs on a GPU; a verification step replays its graph "
            "when every row may take the full draft count and no prompt chunk rides along "
            "(`graphed verify steps`: replays over the warm-up and the timed runs), else runs "
            "packed and eager",
            "",
            markdown_table(columns, table),
            "",
            "`vs off`: tok/s with speculation / without (above 1: speculation pays). On random "
            "weights drafts rarely match: that row is the cost of trying. `ngram` is the "
            "default config: a batch size whose verification steps measure slower than plain "
            "ones runs plain for a while (`held plain`: steps); `ngram-always` never holds.",
        ]
        wrong = [f"{r['model']} batch {r['batch']}" for r in rows if not r["identical_to_off"]]
        lines += ["", f"Outputs that differ from plain greedy: {', '.join(wrong) or 'none'}.", ""]
    lines += _vllm_lines(rows, vllm)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm = load_vllm(args.vllm_json, args) if args.vllm_json else None  # before the runs
    env = environment()
    mechanism, rows = [], []
    if args.reuse_json:
        mechanism, rows, first = load_reused(args.reuse_json, args.sections)
        if not args.sections and first:  # a merge: the measurements' machine, not this one
            env = {**first, "merged_by": env["command"]}
    if "mechanism" in args.sections:
        mechanism = run_mechanism(args)
    if "real" in args.sections:
        rows += run_model(args.real_model, "grounded chat", args)
    if "random" in args.sections:
        rows += run_model(args.random_model, "random weights", args)
    rows.sort(key=lambda r: list(SECTION_OF_KIND).index(r["kind"]))  # real, then random
    markdown = report(args, env, rows, mechanism, vllm)
    payload = {
        "environment": env,
        "args": vars(args),
        "targets": targets(rows, mechanism, vllm),
        "mechanism": mechanism,
        "rows": rows,
        "vllm": vllm,
    }
    md_path, _ = write_results(args.name, markdown, payload, Path(args.out_dir))
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
