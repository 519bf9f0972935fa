"""Would FP8 tensor-core dots keep the FP8 KV cache's accuracy? The error of attention's dots
in FP8 (e4m3 q quantized per head, then optionally P too), beside today's paths, on a real
model's own q, K and V (issue 41: "FP8 tensor-core dots with q quantised per head, if the error
stays within bf16's").

Each layer's post-RoPE q, K, V come from the model's own transformers forward over a fixed
text (an attention hook captures them). Every variant computes the layer's causal attention
with its operands rounded as a kernel would round them, products and sums in float32 (tensor
cores accumulate in fp32), and is compared with a float64 reference over the unrounded
values:

- ``bf16 KV``: q, K, V in bf16 (the bf16 cache), P rounded to bf16 before P @ V;
- ``FP8 KV``: FlashDec's FP8 decode today: K/V stored e4m3 under the calibrated scales per
  layer and head; q times ``k_scale`` rounded to fp16, K and V widened to fp16 (exact), P in
  fp16, the output times ``v_scale``;
- ``FP8 dots, q per head``: as ``FP8 KV`` but q (times ``k_scale``) quantized to e4m3 with one
  scale per head (its max-abs over the step's tokens / 448), Q @ K^T on e4m3 operands;
- ``FP8 dots, q per row``: one scale per (token, head) row instead;
- ``FP8 dots + P``: q per head and P quantized to e4m3 too (as ``P x 448``), P @ V on e4m3.

The question is the dots' own error: each FP8-dot variant is also compared with ``FP8 KV``
(same cache, different dots), and that error is judged against the bf16 path's own error
(bf16 KV against float64). Runs on the CPU (numerics only: no kernel is timed).

  .venv/bin/python benchmarks/fp8_dot_error.py --out-dir benchmarks/results
Writes fp8_dot_error.md and fp8_dot_error.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    environment,
    environment_markdown,
    goal,
    goals_section,
    markdown_table,
    write_results,
)
from benchmarks.bench_fp8_accuracy import TEXT_PATH, load, resolve_device, text_tokens
from flashdec._checks import FP8_MAX
from flashdec.kv_scales import calibrate_kv_scales

FP8 = torch.float8_e4m3fn
VARIANTS = ("bf16 KV", "FP8 KV", "FP8 dots, q per head", "FP8 dots, q per row", "FP8 dots + P")
FP8_DOTS = VARIANTS[2:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, a built-in shape or a directory")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="the model's dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (numerics only)")
    p.add_argument("--tokens", type=int, default=512, help="text tokens of the forward")
    p.add_argument("--text", default=str(TEXT_PATH), help="the text (with a tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="random ids/weights without a tokenizer")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default="fp8_dot_error", help="results file stem")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be >= 2")
    return args


# ------------------------------------------------------------------ rounding, as kernels round
def e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x`` stored as e4m3 under ``scale`` (saturating) and read back, in float32."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def per_head_scale(q: torch.Tensor) -> torch.Tensor:
    """``q [H, T, D]``: one e4m3 scale per head, its max-abs over the tokens / 448."""
    amax = q.abs().amax(dim=(1, 2), keepdim=True)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def per_row_scale(q: torch.Tensor) -> torch.Tensor:
    """``q [H, T, D]``: one e4m3 scale per (head, token) row."""
    amax = q.abs().amax(dim=2, keepdim=True)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, round_p: Callable
) -> torch.Tensor:
    """Causal attention of ``q [H, T, D]`` over ``k, v [H, T, D]`` (heads already expanded for
    GQA) in q's float dtype, with ``round_p`` applied to the softmax probabilities before
    P @ V (the operand a kernel rounds)."""
    t = q.shape[1]
    scores = (q @ k.transpose(1, 2)) * sm_scale
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    p = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return round_p(p) @ v


def variant_outputs(q, k, v, k_scale, v_scale, sm_scale: float) -> dict[str, torch.Tensor]:
    """Each variant's attention output ``[Hq, T, D]`` (float32) and the float64 reference, for
    one layer: ``q [Hq, T, D]``, ``k, v [Hkv, T, D]`` (the model's own, post-RoPE), the
    layer's calibrated ``k_scale, v_scale [Hkv]``."""
    group = q.shape[0] // k.shape[0]

    def expand(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(group, dim=0)

    ks, vs = expand(k_scale.view(-1, 1, 1)), expand(v_scale.view(-1, 1, 1))
    k_stored, v_stored = e4m3(expand(k), ks) / ks, e4m3(expand(v), vs) / vs  # e4m3 values
    out = {
        "reference": causal_attention(
            q.double(), expand(k).double(), expand(v).double(), sm_scale, lambda p: p
        )
    }
    bf = torch.bfloat16
    out["bf16 KV"] = causal_attention(
        q.to(bf).float(),
        expand(k).to(bf).float(),
        expand(v).to(bf).float(),
        sm_scale,
        lambda p: p.to(bf).float(),
    )
    q_folded = q.float() * ks  # the kernel folds k_scale into q: stored K is read as is
    half = torch.float16
    out["FP8 KV"] = vs * causal_attention(
        q_folded.to(half).float(), k_stored, v_stored, sm_scale, lambda p: p.to(half).float()
    )
    for name, scale in (
        ("FP8 dots, q per head", per_head_scale(q_folded)),
        ("FP8 dots, q per row", per_row_scale(q_folded)),
    ):
        out[name] = vs * causal_attention(
            e4m3(q_folded, scale), k_stored, v_stored, sm_scale, lambda p: p.to(half).float()
        )
    out["FP8 dots + P"] = vs * causal_attention(
        e4m3(q_folded, per_head_scale(q_folded)),
        k_stored,
        v_stored,
        sm_scale,
        lambda p: e4m3(p, 1.0 / FP8_MAX),
    )
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm()).item()


def layer_errors(outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each variant's error against the reference, and each FP8-dot variant's against FP8 KV
    (``<variant> vs FP8 KV``: the dots' own error, the cache being the same)."""
    errors = {name: relative_error(outputs[name], outputs["reference"]) for name in VARIANTS}
    for name in FP8_DOTS:
        errors[f"{name} vs FP8 KV"] = relative_error(outputs[name], outputs["FP8 KV"])
    return errors


# ------------------------------------------------------------------ the model's own q, K, V
def capture_qkv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q [Hq, T, D], k, v [Hkv, T, D])`` as the model's attention receives them
    (post-RoPE, post head norms), from one forward of ``ids``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query[0].detach(), key[0].detach(), value[0].detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("flashdec_capture", capture)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = "flashdec_capture"
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
    finally:
        config._attn_implementation = before
    return [captured[i] for i in range(config.num_hidden_layers)]


def run(args) -> dict:
    device = resolve_device(args.device)
    model, tokenizer, description = load(args, device)
    vocab = model.config.vocab_size
    ids, text = text_tokens(tokenizer, args.text, args.tokens, vocab, args.seed)
    scales = calibrate_kv_scales(model, ids)  # the dynamic scales an LLM would calibrate
    head_dim = getattr(model.config, "head_dim", None) or (
        model.config.hidden_size // model.config.num_attention_heads
    )
    sm_scale = head_dim**-0.5
    per_layer = []
    for layer, (q, k, v) in enumerate(capture_qkv(model, ids)):
        outputs = variant_outputs(
            q.float().cpu(),
            k.float().cpu(),
            v.float().cpu(),
            scales.k[layer],
            scales.v[layer],
            sm_scale,
        )
        per_layer.append(layer_errors(outputs))
        print(f"layer {layer}: " + ", ".join(f"{n} {e:.2e}" for n, e in per_layer[-1].items()))
    return {
        "name": args.model,
        "model": description,
        "text": text,
        "tokens": len(ids),
        "layers": per_layer,
        "summary": summarize(per_layer),
    }


def summarize(per_layer: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per error column: median, mean and max over layers."""
    return {
        name: {
            "median": statistics.median(e[name] for e in per_layer),
            "mean": statistics.fmean(e[name] for e in per_layer),
            "max": max(e[name] for e in per_layer),
        }
        for name in per_layer[0]
    }


def targets(summary: dict) -> list[dict]:
    """Each FP8-dot variant's own error (against FP8 KV, median over layers) within the bf16
    path's own error (bf16 KV against float64, median over layers)."""
    bar = summary["bf16 KV"]["median"]
    goals = []
    for name in FP8_DOTS:
        value = summary[f"{name} vs FP8 KV"]["median"]
        goals.append(
            goal(
                f"{name}: its own error <= bf16's (median over layers)",
                value,
                bar,
                value <= bar,
                f"{value / bar:.2f}x bf16's",
                f"{value:.2e}",
            )
        )
    return goals


def increases(summary: dict) -> list[str]:
    """What each FP8-dot variant adds to the FP8 cache's own error (medians over layers)."""
    base = summary["FP8 KV"]["median"]
    return [
        f"- {name}: error {summary[name]['median']:.2e} against FP8 KV's {base:.2e} "
        f"({summary[name]['median'] / base - 1:+.0%}); bf16 KV's is "
        f"{summary['bf16 KV']['median']:.2e}"
        for name in FP8_DOTS
    ]


def report(env: dict, results: dict) -> str:
    summary = results["summary"]
    rows = [
        [name, *(f"{summary[name][s]:.2e}" for s in ("median", "mean", "max"))] for name in summary
    ]
    return "\n".join(
        [
            f"# FP8 tensor-core dots: their error on a model's own attention ({results['name']})",
            "",
            environment_markdown(env),
            f"- model: {results['model']}",
            f"- input: {results['text']}, its first {results['tokens']} tokens, one causal "
            "forward; q, K, V of every layer as its attention receives them (post-RoPE)",
            "- FP8 scales: calibrated on the same tokens (`calibrate_kv_scales`: per layer and "
            "KV head, max-abs x 2 / 448)",
            "- error: ||out - ref|| / ||ref|| of the layer's attention output; ref in float64 "
            "over the unrounded q, K, V; `X vs FP8 KV`: against today's FP8 path (same cache)",
            "",
            "## Error over the layers",
            "",
            markdown_table(["variant", "median", "mean", "max"], rows),
            "",
            "What the FP8 dots add to the FP8 cache's error (against float64):",
            "",
            *increases(summary),
            "",
            "## Targets",
            "",
            *goals_section(targets(summary)),
            "",
            "## Notes",
            "",
            "- Numerics only, on the CPU: the operands are rounded as a kernel would round them "
            "and the math is float32 (tensor cores accumulate in fp32); nothing is timed. A "
            "kernel's own summation order adds rounding of the order of float32's.",
            "- `FP8 dots + P` stores P x 448 as e4m3 (P <= 1), so P below about 2^-18 flushes "
            "to zero, as an FP8 P @ V does.",
        ]
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    env = environment()
    results = run(args)
    markdown = report(env, results)
    payload = {
        "environment": env,
        "args": vars(args),
        **results,
        "targets": targets(results["summary"]),
    }
    md_path, json_path = write_results(args.name, markdown, payload, Path(args.out_dir))
    print(markdown)
    print(f"wrote {md_path}, {json_path}")
    return payload


if __name__ == "__main__":
    main()
