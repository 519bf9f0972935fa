"""vLLM 0.24.0 with and without its ``ngram`` speculative method on bench_speculative.py's
grounded chat prompts (issue 23), for ``bench_speculative.py --vllm-json``.

The same requests as bench_speculative.py's real-model rows: GROUNDED_PROMPTS in the model's
chat template (flashdec.models.chat_prompt, the tokenizer saved beside the weights), cycled to
the batch, greedy, up to ``--new`` tokens, EOS ends a request; ``vllm.LLM.generate`` in this
process (one untimed warm-up, then the median of ``--reps`` timed calls), at every ``--batch``.
Speculation: ``speculative_config={"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_max": max_ngram, "prompt_lookup_min": min_ngram}`` with FlashDec's
``SpeculativeConfig`` defaults (vLLM's own are 5 and 5; vllm/config/speculative.py).

Acceptance from vLLM's Prometheus counters (``LLM.get_metrics()``, vllm/v1/metrics/reader.py;
needs ``disable_log_stats=False``): ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` (vllm/v1/spec_decode/metrics.py ``SpecDecodingProm``), read around
the last timed call. Tokens per request step = decode tokens / (decode tokens - accepted): each
request step emits its accepted drafts plus one token, and a request's first token comes from
its prefill (FlashDec's ``tokens_per_step`` counts the same way). Read from the vLLM 0.24.0
wheel's source.

Model: a plain transformers directory (``--model-dir``, bf16, tokenizer included) that
export_real_model.py writes from SmolLM2's GGUF; FlashDec's rows load the same directory.

On the GPU machine, after vLLM's install.sh (../shared/tools/vllm/README.md):
  python3 benchmarks/vllm_speculative.py --model-dir /tmp/smollm2-bf16 --json $OUT/vllm_spec.json
Importing this module does not import vLLM.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdec.speculative import SpeculativeConfig

SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
MODES = ("off", "ngram")
# what bench_speculative.py's --vllm-json checks against its own run
COMPARED_ARGS = ("new", "num_tokens", "min_ngram", "max_ngram")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = SpeculativeConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", default="/tmp/smollm2-bf16", help="weights + tokenizer")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--new", type=int, default=256, help="tokens per request at most")
    p.add_argument("--num-tokens", type=int, default=defaults.num_tokens)
    p.add_argument("--min-ngram", type=int, default=defaults.min_ngram)
    p.add_argument("--max-ngram", type=int, default=defaults.max_ngram)
    p.add_argument("--reps", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--gpu-mem", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", help="where to write the rows (bench_speculative.py --vllm-json)")
    return p.parse_args(argv)


def speculative_config(args) -> dict:
    """vLLM's ngram speculation with FlashDec's settings."""
    return {
        "method": "ngram",
        "num_speculative_tokens": args.num_tokens,
        "prompt_lookup_max": args.max_ngram,
        "prompt_lookup_min": args.min_ngram,
    }


def engine_args(args, mode: str) -> dict:
    kwargs = {
        "dtype": "bfloat16",
        "gpu_memory_utilization": args.gpu_mem,
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(args.batch),
        "seed": 0,
        "disable_log_stats": False,  # LLM.get_metrics() needs the stat loggers
    }
    if mode == "ngram":
        kwargs["speculative_config"] = speculative_config(args)
    return kwargs


def spec_counters(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters, summed over engine labels (zero when off)."""
    totals = dict.fromkeys(SPEC_METRICS, 0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals


def measure(
    llm,
    calls: list[list[list[int]]],
    params,
    reps: int,
    sync: Callable[[], None] = lambda: None,
) -> dict:
    """One untimed warm-up of every ``generate`` call (a list of prompts each: bench_speculative's
    ``generate_calls``), then ``reps`` timed runs of them all; the counters of the last run."""
    requests = [[{"prompt_token_ids": list(p)} for p in prompts] for prompts in calls]
    for call in requests:
        llm.generate(call, params, use_tqdm=False)
    rates, outputs, counts = [], None, None
    for _ in range(reps):
        before = spec_counters(llm)
        sync()
        start = time.perf_counter()
        results = [r for call in requests for r in llm.generate(call, params, use_tqdm=False)]
        sync()
        elapsed = time.perf_counter() - start
        after = spec_counters(llm)
        counts = {k: after[k] - before[k] for k in SPEC_METRICS}
        outputs = [list(r.outputs[0].token_ids) for r in results]
        rates.append(sum(map(len, outputs)) / elapsed)
    generated = sum(map(len, outputs))
    drafts, draft_tokens, accepted = (counts[k] for k in SPEC_METRICS)
    decode = generated - sum(1 for o in outputs if o)  # first tokens come from the prefill
    return {
        "tok_s": statistics.median(rates),
        "tok_s_reps": rates,
        "generate_calls": len(calls),
        "generated_tokens": generated,
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "tokens_per_step": decode / (decode - accepted) if decode > accepted else 1.0,
        "outputs": outputs,
    }


def run(args, llm_class=None, sampling_params=None, tokenizer=None) -> dict:
    """Every mode at every batch; one vLLM engine per mode (speculation is an engine setting).
    The classes are vLLM's unless given (stand-ins in the CPU tests)."""
    from benchmarks.bench_speculative import GROUNDED_PROMPTS, generate_calls, grounded_prompts

    if llm_class is None:
        from vllm import LLM as llm_class
    if sampling_params is None:
        from vllm import SamplingParams as sampling_params
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rows, settings = [], {}
    for mode in args.modes:
        settings[mode] = engine_args(args, mode)
        # a copy: vLLM writes its ModelConfig into the speculative_config dict it is given
        llm = llm_class(model=args.model_dir, **copy.deepcopy(settings[mode]))
        params = sampling_params(temperature=0, max_tokens=args.new)
        for batch in args.batch:
            count = len(GROUNDED_PROMPTS) if batch == 1 else batch  # as bench_speculative
            calls = generate_calls(grounded_prompts(tokenizer, count), batch, real=True)
            result = measure(llm, calls, params, args.reps, sync)
            rows.append({"engine": "vllm", "batch": batch, "mode": mode, **result})
            print({k: v for k, v in rows[-1].items() if k != "outputs"}, flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {
        "engine": "vllm",
        "version": _version("vllm"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "engine_args": settings,
        "args": vars(args),
        "rows": rows,
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
