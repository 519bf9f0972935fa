"""Speculative decoding (ngram prompt lookup) against plain decoding, end to end through
``flashdec.LLM.generate``.

Two workloads, each at batch 1 and 16, speculation off vs ``--speculative ngram``:
- the real model ``smollm2`` (SmolLM2-135M-Instruct) on input-grounded chat prompts (rewrite,
  fix typos, continue a list, edit code): the answer copies its input, so prompt lookup hits;
- the Llama-3-8B random shape on random prompts, EOS ignored: drafts almost never match, so
  this row is the cost of speculation when it does not pay (the adaptivity check).
Per row: generated tokens per second (median of ``--reps`` timed runs after one untimed warm-up,
CUDA-synchronised), drafts, acceptance rate, tokens per request step, whether the output equals
plain greedy token for token, and ngram / off.

On the GPU machine:
  PYTHONPATH=. python3 benchmarks/bench_speculative.py --out-dir $OUT
Locally, a check of the script itself (seconds): python3 benchmarks/bench_speculative.py --smoke
Writes speculative.md and speculative.json.
"""

from __future__ import annotations

import argparse
import gc
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
    p.add_argument("--real-model", default="smollm2", help="a built-in real model (chat)")
    p.add_argument("--random-model", default="llama3-8b-shape", help="a built-in shape")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new", type=int, default=256, help="tokens per request at most")
    p.add_argument("--random-prompt", type=int, default=512, help="random prompts' tokens")
    p.add_argument("--num-tokens", type=int, default=4, help="drafts per request per step")
    p.add_argument("--reps", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="speculative")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="seconds on the CPU: smollm2 at batch 1 when it loads here (else the tiny shape) "
        "and the tiny shape at batch 1 and 2, few tokens, one rep",
    )
    args = p.parse_args(argv)
    if args.smoke:
        from flashdec.models import REAL_MODELS, real_model_problem

        if args.real_model in REAL_MODELS and real_model_problem(args.real_model) is not None:
            args.real_model = "tiny"  # no tokenizer: random prompts stand in
        args.random_model, args.batch, args.new, args.random_prompt = "tiny", [1, 2], 8, 24
        args.reps = 1
    return args


def _prompts(loaded, batch: int, args) -> tuple[list[list[int]], bool]:
    """``batch`` prompts (the grounded chat turns, cycled, or seeded random ids) and whether
    EOS ends a request (real chat: yes; random weights: no, every request runs ``--new``)."""
    from flashdec.models import chat_prompt

    if loaded.tokenizer is not None:
        turns = [GROUNDED_PROMPTS[i % len(GROUNDED_PROMPTS)] for i in range(batch)]
        return [chat_prompt(loaded.tokenizer, t) for t in turns], False
    gen = torch.Generator().manual_seed(args.seed)
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, args.random_prompt), generator=gen)
    return ids.tolist(), True


def _measure(llm, prompts: list[list[int]], args, ignore_eos: bool) -> dict:
    """One untimed warm-up, then ``--reps`` timed ``generate`` calls."""
    device = llm.adapter.spec.device
    llm.generate(prompts, args.new, ignore_eos=ignore_eos)  # compiles, captures, caches
    rates, stats, outputs = [], [], None
    for _ in range(args.reps):
        sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, args.new, ignore_eos=ignore_eos)
        sync(device)
        elapsed = time.perf_counter() - start
        stats.append(llm.last_stats)
        rates.append(sum(map(len, outputs)) / elapsed)
    last = stats[-1]
    return {
        "tok_s": statistics.median(rates),
        "tok_s_reps": rates,
        "generated_tokens": last.generated_tokens,
        "draft_tokens": last.draft_tokens,
        "accepted_tokens": last.accepted_tokens,
        "acceptance_rate": last.acceptance_rate,
        "tokens_per_step": last.tokens_per_step,
        "outputs": [list(o) for o in outputs],
    }


def run_model(name: str, kind: str, args) -> list[dict]:
    """Both modes at every batch for one model; one ``flashdec.LLM`` alive at a time (each
    sizes a KV pool of its own)."""
    import flashdec
    from flashdec.models import resolve_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = None if device == "cuda" else torch.float32  # bf16 matmuls crawl on a CPU
    loaded = resolve_model(name, dtype=dtype, device=device, seed=args.seed)
    rows = []
    batches = args.batch if loaded.tokenizer is None or not args.smoke else args.batch[:1]
    for batch in batches:
        prompts, ignore_eos = _prompts(loaded, batch, args)
        longest = max(map(len, prompts)) + args.new
        plain = None
        for mode in ("off", "ngram"):
            speculative = None
            if mode == "ngram":
                speculative = flashdec.SpeculativeConfig(num_tokens=args.num_tokens)
            llm = flashdec.LLM(
                loaded.model,
                tokenizer=loaded.tokenizer,
                max_batch_size=batch,
                max_model_len=longest,
                num_blocks=batch * (longest // 16 + 2) + 16,
                speculative=speculative,
            )
            result = _measure(llm, prompts, args, ignore_eos)
            outputs = result.pop("outputs")
            if plain is None:
                plain = outputs
            rows.append(
                {
                    "model": name,
                    "kind": kind,
                    "batch": batch,
                    "mode": mode,
                    "cuda_graphs": llm.cuda_graphs,
                    "identical_to_off": outputs == plain,
                    **result,
                }
            )
            print(rows[-1], flush=True)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    del loaded
    gc.collect()
    return rows


def report(args, env: dict, rows: list[dict]) -> str:
    off = {(r["model"], r["batch"]): r for r in rows if r["mode"] == "off"}
    table = []
    for r in rows:
        base = off[(r["model"], r["batch"])]
        spec = r["mode"] != "off"
        table.append(
            [
                f"{r['model']} ({r['kind']})",
                r["batch"],
                r["mode"],
                r["tok_s"],
                f"{r['draft_tokens']:,}" if spec else "—",
                f"{100 * r['acceptance_rate']:.1f}%" if spec else "—",
                f"{r['tokens_per_step']:.2f}",
                f"{r['tok_s'] / base['tok_s']:.2f}" if spec else "1.00",
                "yes" if r["identical_to_off"] else "NO",
            ]
        )
    columns = ["model", "batch", "speculation", "tok/s (median)", "drafts", "accepted"]
    columns += ["tokens/step", "vs off", "output = off"]
    lines = [
        "# Speculative decoding (ngram prompt lookup) vs plain decoding",
        "",
        environment_markdown(env),
        f"- {args.num_tokens} drafts per request per step at most; greedy; one untimed warm-up, "
        f"then the median of {args.reps} timed `LLM.generate` calls (CUDA-synchronised)",
        f"- {args.real_model}: the built-in grounded chat prompts (cycled to the batch), up to "
        f"{args.new} new tokens, EOS ends a request; {args.random_model}: random prompts of "
        f"{args.random_prompt} tokens, {args.new} new tokens, EOS ignored",
        "- verification steps run eagerly (no CUDA graph); plain steps replay graphs on a GPU",
        "",
        markdown_table(columns, table),
        "",
        "`vs off`: tok/s with speculation / without (above 1: speculation pays). On random "
        "weights drafts rarely match: that row is the cost of trying.",
    ]
    wrong = [f"{r['model']} batch {r['batch']}" for r in rows if not r["identical_to_off"]]
    lines += ["", f"Outputs that differ from plain greedy: {', '.join(wrong) or 'none'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = environment()
    rows = run_model(args.real_model, "grounded chat", args)
    rows += run_model(args.random_model, "random weights", args)
    markdown = report(args, env, rows)
    payload = {"environment": env, "args": vars(args), "rows": rows}
    md_path, _ = write_results(args.name, markdown, payload, Path(args.out_dir))
    print(markdown)
    print(f"wrote {md_path}")


if __name__ == "__main__":
    main()
