"""vLLM 0.24.0 with ``enable_prefix_caching=True`` on bench_prefix.py's traces (issue 22).

The same requests as bench_prefix.py (its ``trace_passes``: the system-prompt, chat and plain
traces, same flags and seed) served by vLLM's offline engine in this process through
bench_prefix's own ``drive``: a small adapter gives ``vllm.LLM``'s ``llm_engine`` the slice of
``flashdec.LLM``'s request API that ``drive`` uses, so arrivals, follow-up turns, TTFT (first
token on the host - arrival) and output tok/s are measured by the same code on both engines.
The rows carry bench_prefix's keys; ``bench_prefix.py --vllm-json`` puts them beside FlashDec's
and judges issue 22's targets.

Model: a built-in FlashDec shape (``--model``: ``llama3-8b-shape`` or ``mistral-7b-window-shape``)
given to vLLM as a config.json in /tmp with ``load_format="dummy"`` (random weights), the way
/work/shared/tools/serve/serve_trace.py runs the Llama-3-8B shape; the geometry (and window)
comes from flashdec.models.BUILTIN_SHAPES, so both engines run the same sizes. One vLLM
engine serves every trace: before each measured pass a warm-up pass on another prefix, then
``reset_prefix_cache()`` (nothing of the measured trace cached, as for FlashDec's fresh LLM).

Hit tokens per request: ``RequestOutput.num_cached_tokens`` (vLLM 0.24.0: vllm/outputs.py; set
from the scheduler's ``PrefillStats`` of the request's first scheduled prefill in
vllm/v1/core/sched/scheduler.py and vllm/v1/engine/output_processor.py), looked-up tokens =
the prompt's length; hit rate = their ratio, as FlashDec's ``prefix_cache_stats``. A cross-check
from vLLM's Prometheus counters: ``LLM.get_metrics()`` (vllm/entrypoints/llm.py ->
vllm/v1/metrics/reader.py ``get_metrics_snapshot``; needs ``disable_log_stats=False``, the
offline LLM's default is True) with ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``
(vllm/v1/metrics/loggers.py, counted per lookup in vllm/v1/core/kv_cache_manager.py
``get_computed_blocks``: a request looked up again while it waits is counted again), reported
as ``metric_queried_tokens`` / ``metric_hit_tokens``. Read from the vLLM 0.24.0 wheel's source.

On the GPU machine, after vLLM's install.sh (../shared/tools/vllm/README.md), from the repo root:
  python3 benchmarks/vllm_prefix.py --rate 16 64 --json $OUT/vllm_prefix.json
  python3 benchmarks/vllm_prefix.py --model mistral-7b-window-shape --system 6144 \\
      --traces system --rate 16 --json $OUT/vllm_prefix_window.json
then bench_prefix.py with the same flags and ``--vllm-json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_prefix import (
    TracePass,
    add_trace_arguments,
    drive,
    longest_sequence,
    measured_row,
    system_trace,
    trace_passes,
)

PREFIX_METRICS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_arguments(p)
    p.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM's gpu_memory_utilization")
    p.add_argument("--model-dir", default="/tmp/vllm-prefix-model", help="config.json goes here")
    p.add_argument("--json", help="where to write the rows (bench_prefix.py --vllm-json)")
    return p.parse_args(argv)


def vllm_model_config(name: str, max_model_len: int) -> dict:
    """The config.json vLLM loads for the built-in shape ``name`` (random weights): the shape's
    geometry and window in serve_trace.py's Llama-3-8B layout. Llama-3's RoPE scaling is left
    out, as serve_trace.py does: it changes the rotary tables, not the work per token."""
    from flashdec.models import BUILTIN_SHAPES

    shape = BUILTIN_SHAPES.get(name)
    if shape is None:
        raise ValueError(f"unknown built-in shape {name!r}; known: {', '.join(BUILTIN_SHAPES)}")
    families = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
    if shape.family not in families:
        raise ValueError(f"{name} is a {shape.family} shape; vllm_prefix.py runs llama, mistral")
    c = shape.config
    config = {
        "architectures": [families[shape.family]],
        "model_type": shape.family,
        "rope_theta": c.get("rope_parameters", {}).get("rope_theta", 10000.0),
        "max_position_embeddings": max(8192, max_model_len),
        "rms_norm_eps": c.get("rms_norm_eps", 1e-5),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
    }
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ):
        config[key] = c[key]
    if c.get("sliding_window"):
        config["sliding_window"] = c["sliding_window"]
    return config


@dataclass(frozen=True)
class Timing:
    """What ``drive`` reads of a request (``flashdec.LLM.request_timing``'s two fields)."""

    first_token_at: float | None = None  # time.perf_counter() after the step that made it
    finished_at: float | None = None


class VllmRequests:
    """``add_request`` / ``step`` / ``has_unfinished`` / ``request_timing`` / ``release`` /
    ``prefix_cache_stats`` over vLLM's in-process ``LLMEngine``, as ``drive`` calls them on a
    ``flashdec.LLM``. Outputs are cumulative (SamplingParams' default), so a request's token
    list is whole in its finished output."""

    def __init__(self, llm, sampling_params=None) -> None:
        if sampling_params is None:
            from vllm import SamplingParams as sampling_params
        self.llm = llm
        self.engine = llm.llm_engine
        self._params = sampling_params  # vllm.SamplingParams (a stand-in in the CPU tests)
        self._next = 0
        self._timing: dict[str, Timing] = {}
        self._prompt_len: dict[str, int] = {}
        self._answers: dict[str, list[int]] = {}
        self._queried = self._hit = 0

    def add_request(self, prompt: list[int], max_new_tokens: int, *, ignore_eos: bool = False):
        rid = f"r{self._next}"
        self._next += 1
        params = self._params(max_tokens=max_new_tokens, temperature=0, ignore_eos=ignore_eos)
        # vLLM appends a random suffix to the id internally; its outputs carry ours
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
        self._timing[rid] = Timing()
        self._prompt_len[rid] = len(prompt)
        return rid

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.perf_counter()
        for o in outputs:
            timing = self._timing[o.request_id]
            tokens = list(o.outputs[0].token_ids) if o.outputs else []
            if tokens and timing.first_token_at is None:
                timing = replace(timing, first_token_at=now)
            if o.finished:
                if o.num_cached_tokens is None:
                    raise RuntimeError("vLLM's RequestOutput has no num_cached_tokens")
                timing = replace(timing, finished_at=now)
                self._answers[o.request_id] = tokens
                self._queried += self._prompt_len.pop(o.request_id)
                self._hit += o.num_cached_tokens
            self._timing[o.request_id] = timing

    def request_timing(self, rid: str) -> Timing:
        return self._timing[rid]

    def release(self, rid: str) -> list[int]:
        del self._timing[rid]
        return self._answers.pop(rid)

    def prefix_cache_stats(self) -> dict:
        # vLLM's eviction count is not exposed per run: None, shown as "—"
        return {"queried_tokens": self._queried, "hit_tokens": self._hit, "evicted_blocks": None}

    def metric_counters(self) -> dict[str, int]:
        """vLLM's own prefix-cache counters (summed over engine labels)."""
        totals = dict.fromkeys(PREFIX_METRICS, 0)
        for metric in self.llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += metric.value
        return totals


def measured(requests: VllmRequests, args, vocab: int, run: TracePass) -> dict:
    """A warm-up pass on another prefix, an empty prefix cache, then ``run`` through ``drive``
    with vLLM's counters read around it."""
    warmup = system_trace(args, vocab, args.rate[0], args.seed + 1000)[: args.warmup]
    drive(requests, warmup, args.new)
    if not requests.llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache (blocks still held)")
    before = requests.metric_counters()
    result = drive(requests, run.starts, run.new, run.next_turn)
    after = requests.metric_counters()
    result["metric_queried_tokens"] = after[PREFIX_METRICS[0]] - before[PREFIX_METRICS[0]]
    result["metric_hit_tokens"] = after[PREFIX_METRICS[1]] - before[PREFIX_METRICS[1]]
    return result


def run(args) -> dict:
    import torch
    import vllm
    from vllm import LLM

    max_len = longest_sequence(args) + 64
    config = vllm_model_config(args.model, max_len)
    os.makedirs(args.model_dir, exist_ok=True)
    Path(args.model_dir, "config.json").write_text(json.dumps(config))
    engine_args = {
        "load_format": "dummy",
        "dtype": "bfloat16",
        "gpu_memory_utilization": args.gpu_mem,
        "max_model_len": max_len,
        "enable_prefix_caching": True,
        "max_num_seqs": args.max_batch,
        "seed": 0,
        "disable_log_stats": False,  # LLM.get_metrics() needs the stat loggers
    }
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, **engine_args)
    requests = VllmRequests(llm)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    vocab = config["vocab_size"]
    rows = [
        measured_row(args, run_, True, measured(requests, args, vocab, run_), block_size)
        for run_ in trace_passes(args, vocab)
    ]
    return {
        "engine": "vllm",
        "version": vllm.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "block_size": block_size,
        "engine_args": engine_args,
        "model_config": config,
        "args": vars(args),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
