"""``flashdec generate``: a real (or random-weight) model generating through FlashDec.

Loads a built-in shape or a local model directory, generates for a text prompt or a batch of
random prompts, and reports what a user asks first: tokens per second, time to first token, time
per output token — and, with ``compare``, whether the tokens are exactly transformers' own greedy
ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashdec.workloads.config import GenerateConfig, ModelRunConfig
from flashdec.workloads.stats import LatencyStats


def load_llm(config: ModelRunConfig):
    """The model of ``config`` (a built-in shape with seeded random weights, or a directory)
    wrapped in :class:`flashdec.LLM`."""
    from flashdec.llm import LLM
    from flashdec.models import resolve_model

    loaded = resolve_model(
        config.model, dtype=config.torch_dtype(), device=config.torch_device(), seed=config.seed
    )
    llm = LLM(
        loaded.model,
        tokenizer=loaded.tokenizer,
        max_batch_size=config.max_batch_size,
        cuda_graphs=config.graphs(),
        kv_cache_dtype=config.kv_cache_dtype,
    )
    return llm


@dataclass(frozen=True)
class GenerateResult:
    config: GenerateConfig
    device: str
    dtype: str
    cuda_graphs: bool
    num_prompts: int
    prompt_tokens: int
    generated: tuple[tuple[int, ...], ...]  # per prompt, the new ids only
    text: str | None  # the first output decoded, when the model has a tokenizer
    elapsed_s: float  # submission of the first prompt to the last token
    ttft: LatencyStats
    tpot: LatencyStats
    matches_transformers: int | None  # prompts whose tokens equal transformers' (compare)
    tokens_equal: int | None  # positions equal to transformers' over all prompts (compare)
    # per prompt, the first step where the tokens differ from transformers' (None: identical)
    first_divergence: tuple[int | None, ...] | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(g) for g in self.generated)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        rows = [
            (
                "model",
                f"{self.config.model} on {self.device} ({self.dtype}), "
                f"CUDA graphs {'on' if self.cuda_graphs else 'off'}",
            ),
            ("prompts / prompt tokens", f"{self.num_prompts} / {self.prompt_tokens}"),
            ("generated tokens", str(self.generated_tokens)),
            ("tokens/s (whole run)", f"{self.tokens_per_s:,.1f}"),
            ("TTFT p50 / max", f"{self.ttft.p50_ms:.1f} / {self.ttft.max_ms:.1f} ms"),
            ("TPOT p50 / max", f"{self.tpot.p50_ms:.2f} / {self.tpot.max_ms:.2f} ms"),
        ]
        if self.config.warmup_run:
            rows.append(("timings", "after an untimed warm-up run of the same generation"))
        if self.matches_transformers is not None:
            total = self.generated_tokens
            rows.append(
                (
                    "agreement with transformers",
                    f"{self.matches_transformers}/{self.num_prompts} prompts identical, "
                    f"{self.tokens_equal}/{total} tokens ({100 * self.tokens_equal / total:.1f}%)",
                )
            )
            parted = sorted(d for d in self.first_divergence or () if d is not None)
            if parted:
                rows.append(
                    (
                        "first divergence (step)",
                        f"median {parted[len(parted) // 2]}, earliest {parted[0]}",
                    )
                )
            if parted and self.dtype != "float32":
                # two correct low-precision runs round differently; the first near-tie of the
                # top two logits then parts the greedy sequences for good
                rows.append(
                    (
                        "note",
                        f"{self.dtype} rounding differs between any two implementations: greedy "
                        "sequences part at the first near-tie of the top logits (random weights "
                        "have many); float32 (the CPU demo) is token-exact",
                    )
                )
        if self.text is not None:
            rows.append(("first output", repr(self.text)[:200]))
        else:
            rows.append(("first output ids", str(list(self.generated[0][:16]))))
        return rows


def _prompts(config: GenerateConfig, llm) -> list:
    if config.prompt:
        return [config.prompt]
    gen = torch.Generator().manual_seed(config.seed)
    vocab = llm.adapter.spec.vocab_size
    return torch.randint(0, vocab, (config.batch, config.prompt_len), generator=gen).tolist()


def run_generate(
    config: GenerateConfig | None = None,
    *,
    llm=None,
    progress: Callable[[int, int], None] | None = None,
) -> GenerateResult:
    """Generate with ``config`` (``llm``: an already loaded model to reuse)."""
    config = config or GenerateConfig()
    llm = llm or load_llm(config)
    prompts = _prompts(config, llm)

    def generate(progress=None):
        return llm.generate(
            prompts,
            config.max_new_tokens,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            seed=config.seed if config.temperature > 0 else None,
            progress=progress,
        )

    if config.warmup_run:
        generate()
    generated = generate(progress)
    stats = llm.last_stats
    matches = equal = divergence = None
    if config.compare:
        ids = [p if isinstance(p, list) else list(llm.tokenizer(p)["input_ids"]) for p in prompts]
        expected = _transformers_greedy(llm.model, ids, config.max_new_tokens, config.ignore_eos)
        pairs = list(zip(generated, expected, strict=True))
        matches = sum(g == e for g, e in pairs)
        equal = sum(a == b for g, e in pairs for a, b in zip(g, e, strict=False))
        divergence = tuple(_first_difference(g, e) for g, e in pairs)
    tokenizer = llm.tokenizer
    spec = llm.adapter.spec
    return GenerateResult(
        config=config,
        device=str(spec.device),
        dtype=str(spec.dtype).replace("torch.", ""),
        cuda_graphs=llm.cuda_graphs,
        num_prompts=stats.num_requests,
        prompt_tokens=stats.prompt_tokens,
        generated=tuple(tuple(g) for g in generated),
        text=tokenizer.decode(generated[0]) if tokenizer is not None else None,
        elapsed_s=stats.elapsed_s,
        ttft=LatencyStats.from_seconds(stats.ttft_s),
        tpot=LatencyStats.from_seconds([t for t in stats.tpot_s if t > 0]),
        matches_transformers=matches,
        tokens_equal=equal,
        first_divergence=divergence,
    )


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first step where two generations differ (a length difference counts)."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return step
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _transformers_greedy(model, prompts: list[list[int]], new: int, ignore_eos: bool):
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        extra = {"min_new_tokens": new} if ignore_eos else {}
        tokens = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )[0, len(prompt) :].tolist()
        out.append(tokens)
    return out
