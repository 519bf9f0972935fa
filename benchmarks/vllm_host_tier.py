"""vLLM 0.24.0 on bench_host_tier.py's multi-turn chat trace, with its CPU offloading if the
installed vLLM can build it, else with prefix caching alone (the JSON's ``config`` says which).

The same requests as bench_host_tier.py (its ``chat_trace`` and ``serve_trace``: same flags,
same seed; the warm-up, round 0, then the measured rounds, one request at a time) served by
vLLM's offline engine in this process through vllm_prefix.py's adapter (``VllmRequests``: the
slice of ``flashdec.LLM``'s request API that the driver uses), so TTFT (first token on the host -
submission) is measured by the same code on both engines. The GPU pool is as many tokens as
FlashDec's: ``num_gpu_blocks_override = pool_tokens / block_size``, block size ``--block-size``
(16), ``enable_prefix_caching=True``; ``max_num_seqs`` and ``max_num_batched_tokens`` as
FlashDec's ``max_batch_size`` / ``max_num_batched_tokens``.

CPU offloading, tried in order until one builds (each failure is recorded in
``offload_errors``; ``--offload off`` skips them):
1. ``kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
   kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": <host tier bytes>,
   "block_size": <block size>})`` (the form vLLM's KV offloading guide gives for recent
   releases);
2. the same with ``{"num_cpu_blocks": <host tier blocks>, "block_size": ...}`` (the form of the
   0.11-era ``CPUOffloadingSpec``);
3. the engine arguments ``kv_offloading_size=<GiB>, kv_offloading_backend="native"``;
4. none: prefix caching alone, ``config = "prefix caching only (offloading connector
   unavailable: <the errors>)"``.
The host tier's size is FlashDec's (``--host-gib``). Hit tokens per turn are vLLM's
``RequestOutput.num_cached_tokens`` (GPU prefix-cache hits plus tokens its connector loaded, as
its scheduler counts them); a connector that built but never loads anything shows as a hit share
near 0.

Model: a built-in FlashDec shape given to vLLM as a config.json with ``load_format="dummy"``
(random weights), as vllm_prefix.py does (``vllm_model_config``).

On the GPU machine, after vLLM's install.sh (../shared/tools/vllm/README.md), from the repo root:
  python3 benchmarks/vllm_host_tier.py --json $OUT/vllm_host_tier.json
then bench_host_tier.py with the same trace flags and ``--vllm-json $OUT/vllm_host_tier.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_host_tier import (
    add_trace_arguments,
    chat_trace,
    kv_bytes_per_token,
    longest_sequence,
    resolve_sizes,
    serve_trace,
    ttft_summary,
)
from benchmarks.vllm_prefix import VllmRequests, vllm_model_config

VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_arguments(p)
    p.add_argument(
        "--offload",
        choices=("auto", "off"),
        default="auto",
        help="auto: CPU offloading if it builds, else prefix caching alone; off: the latter",
    )
    p.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM's gpu_memory_utilization")
    p.add_argument("--model-dir", default="/tmp/vllm-host-tier-model", help="config.json here")
    p.add_argument("--json", help="where to write the run (bench_host_tier.py --vllm-json)")
    return resolve_sizes(p.parse_args(argv))


def offload_attempts(args) -> list[tuple[str, Callable[[], dict]]]:
    """(config description, engine arguments) of each way to turn vLLM's CPU offloading on,
    in the order tried; the arguments are built lazily (they import vLLM)."""
    nbytes = int(args.host_gib * 2**30)
    blocks = nbytes // (kv_bytes_per_token(args.model, args.dtype) * args.block_size)
    size = f"{args.host_gib:.2f} GiB"

    def connector(extra: dict) -> Callable[[], dict]:
        def build() -> dict:
            from vllm.config import KVTransferConfig

            config = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={**extra, "block_size": args.block_size},
            )
            return {"kv_transfer_config": config}

        return build

    return [
        (
            f"OffloadingConnector (CPU, cpu_bytes_to_use {size}) + prefix caching",
            connector({"cpu_bytes_to_use": nbytes}),
        ),
        (
            f"OffloadingConnector (CPU, num_cpu_blocks {blocks}) + prefix caching",
            connector({"num_cpu_blocks": blocks}),
        ),
        (
            f"kv_offloading_size {size} (native backend) + prefix caching",
            lambda: {"kv_offloading_size": args.host_gib, "kv_offloading_backend": "native"},
        ),
    ]


def base_engine_args(args) -> dict:
    return {
        "load_format": "dummy",
        "dtype": VLLM_DTYPES[args.dtype],
        "gpu_memory_utilization": args.gpu_mem,
        "max_model_len": longest_sequence(args) + 64,
        "block_size": args.block_size,
        "num_gpu_blocks_override": args.pool_tokens // args.block_size,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "max_num_seqs": args.max_batch,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": 0,
    }


def _release_gpu() -> None:
    """What a failed (or finished) vLLM engine leaves in this process, freed for the next."""
    gc.collect()
    try:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception as exc:  # best effort: a later build says if something is left
        print(f"vLLM clean-up: {type(exc).__name__}: {exc}", flush=True)
    import torch

    gc.collect()
    torch.cuda.empty_cache()


PREFIX_ONLY = "prefix caching only"


def _error(description: str, exc: BaseException, when: str) -> str:
    return f"{description}: {when}: {type(exc).__name__}: {str(exc)[:300]}"


def build_llm(args, attempts: list, errors: list[str]):
    """vLLM's LLM with the first of ``attempts`` (offloading forms, taken off the list) that
    builds, else with prefix caching alone; appends the failures to ``errors``. Returns the
    engine, the config description and the engine arguments."""
    from vllm import LLM

    while True:
        description, extra = attempts.pop(0) if attempts else (None, dict)
        engine_args = base_engine_args(args)
        try:
            engine_args.update(extra())
            llm = LLM(model=args.model_dir, skip_tokenizer_init=True, **engine_args)
        except Exception as exc:
            if description is None:
                raise
            errors.append(_error(description, exc, "not built"))
            print(f"vLLM offloading: {errors[-1]}", flush=True)
        else:
            break
        _release_gpu()  # out of the except block: its traceback no longer holds the engine
    if description is None:
        why = "; ".join(errors) if errors else "--offload off"
        prefix = "offloading connector unavailable: " if errors else ""
        description = f"{PREFIX_ONLY} ({prefix}{why})"
    print(f"vLLM built: {description}", flush=True)
    return llm, description, engine_args


def measure(requests, args, vocab: int) -> dict:
    """bench_host_tier's trace through ``requests`` (a ``VllmRequests``): the per-turn records
    and the measured rounds' TTFT percentiles and hit share."""
    trace = chat_trace(args, vocab)
    records, before, after, wall_s = serve_trace(requests, args, trace, vocab, "vLLM")
    queried = after["queried_tokens"] - before["queried_tokens"]
    hit = after["hit_tokens"] - before["hit_tokens"]
    summary = {
        **ttft_summary(records),
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_share": hit / queried if queried else 0.0,
        "measured_wall_s": wall_s,
    }
    return {"records": records, "summary": summary}


def run(args) -> dict:
    import torch
    import vllm

    config = vllm_model_config(args.model, longest_sequence(args) + 64)
    os.makedirs(args.model_dir, exist_ok=True)
    Path(args.model_dir, "config.json").write_text(json.dumps(config))
    attempts = offload_attempts(args) if args.offload == "auto" else []
    errors: list[str] = []
    while True:  # an offloading form that fails while serving: the next one, from the start
        start = time.perf_counter()
        llm, description, engine_args = build_llm(args, attempts, errors)
        build_s = time.perf_counter() - start
        cache_config = llm.llm_engine.vllm_config.cache_config
        try:
            result = measure(VllmRequests(llm), args, config["vocab_size"])
        except Exception as exc:
            if description.startswith(PREFIX_ONLY):
                raise
            errors.append(_error(description, exc, "failed while serving"))
            print(f"vLLM offloading: {errors[-1]}", flush=True)
        else:
            break
        del llm, cache_config
        _release_gpu()
    print(f"vLLM ({description}): {json.dumps(result['summary'])}", flush=True)
    return {
        "engine": "vllm",
        "version": vllm.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "config": description,
        "offloading": not description.startswith(PREFIX_ONLY),
        "offload_errors": errors,
        "block_size": cache_config.block_size,
        "num_gpu_blocks": getattr(cache_config, "num_gpu_blocks", None),
        "build_s": build_s,
        "engine_args": {k: str(v) for k, v in engine_args.items()},
        "model_config": config,
        "args": vars(args),
        **result,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
