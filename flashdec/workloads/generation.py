"""``flashdec generate``: a real (or random-weight) model generating through FlashDec.

Loads a built-in shape, the built-in real model or a local model directory, generates for text
prompts (optionally in the chat template) or a batch of random prompts, and reports what a user
asks first: the text, tokens per second, time to first token, time per output token — and, with
``compare``, whether the tokens are exactly transformers' own greedy ones. :class:`ChatDemo` is
``flashdec demo``'s real-model part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flashdec.workloads.model_config import GenerateConfig, ModelRunConfig
from flashdec.workloads.stats import LatencyStats, SpeculationStats

# `flashdec demo`'s chat turns: short answers, a list, a poem (tests keep their own)
DEMO_CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a short poem about the sea.",
    "Explain in one sentence what a CPU does.",
)
DEMO_CHAT_NEW_TOKENS = 28


def load_llm(config: ModelRunConfig, loaded=None, *, max_model_len: int | None = None):
    """The model of ``config`` (a built-in shape with seeded random weights, a built-in real
    model, or a directory; ``loaded``: already loaded) wrapped in :class:`flashdec.LLM`, its KV
    pool sized for the requests ``config`` runs at once."""
    from flashdec.llm import LLM
    from flashdec.models import resolve_model

    if loaded is None:
        loaded = resolve_model(
            config.model, dtype=config.torch_dtype(), device=config.torch_device(), seed=config.seed
        )
    max_batch_size = config.max_batch_size
    if isinstance(config, GenerateConfig):  # its prompts all run at once: no larger pool
        max_batch_size = min(max_batch_size, 1 if config.prompt else config.batch)
    return LLM(
        loaded.model,
        tokenizer=loaded.tokenizer,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        cuda_graphs=config.graphs(),
        kv_cache_dtype=config.kv_cache_dtype,
        kv_scales=config.kv_scales if config.kv_cache_dtype == "fp8" else None,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.prefix_caching,
        host_kv_cache_gib=config.host_kv_gib,
        speculative=config.speculative_config(),
    )


@dataclass(frozen=True)
class GenerateResult:
    config: GenerateConfig
    device: str
    dtype: str
    cuda_graphs: bool
    num_prompts: int
    prompt_tokens: int
    generated: tuple[tuple[int, ...], ...]  # per prompt, the new ids only
    # per prompt, the new ids decoded (special tokens left out), when the model has a tokenizer
    texts: tuple[str, ...] | None
    elapsed_s: float  # submission of the first prompt to the last token
    ttft: LatencyStats
    tpot: LatencyStats
    matches_transformers: int | None  # prompts whose tokens equal transformers' (compare)
    tokens_equal: int | None  # positions equal to transformers' over all prompts (compare)
    # per prompt, the first step where the tokens differ from transformers' (None: identical)
    first_divergence: tuple[int | None, ...] | None = None
    speculation: SpeculationStats | None = None  # with speculative decoding on

    @property
    def text(self) -> str | None:
        """The first output decoded."""
        return self.texts[0] if self.texts else None

    @property
    def generated_tokens(self) -> int:
        return sum(len(g) for g in self.generated)

    @property
    def exact(self) -> bool:
        """Whether every prompt's tokens equal transformers' (False without ``compare``)."""
        return self.matches_transformers == self.num_prompts

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
        if self.speculation is not None:
            rows += self.speculation.rows()
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
        if config.chat:
            from flashdec.models import chat_prompt

            return [chat_prompt(llm.tokenizer, config.prompt)]
        return [config.prompt]
    gen = torch.Generator().manual_seed(config.seed)
    vocab = llm.adapter.spec.vocab_size
    return torch.randint(0, vocab, (config.batch, config.prompt_len), generator=gen).tolist()


class TextStream:
    """Hands a growing output's decoded text to ``emit`` piece by piece, holding a piece back
    while it ends inside a multi-byte character (decoded as U+FFFD until its last byte)."""

    def __init__(self, tokenizer, emit: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.emit = emit
        self.text = ""  # emitted so far

    def update(self, tokens: Sequence[int], final: bool = False) -> None:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if (text.endswith("\ufffd") and not final) or not text.startswith(self.text):
            return
        if len(text) > len(self.text):
            self.emit(text[len(self.text) :])
            self.text = text


def run_generate(
    config: GenerateConfig | None = None,
    *,
    llm=None,
    progress: Callable[[int, int], None] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> GenerateResult:
    """Generate with ``config`` (``llm``: an already loaded model to reuse; ``prompts``: token-id
    lists to run instead of the config's prompt; ``on_text``: receives the first output's text
    piece by piece as it is generated)."""
    config = config or GenerateConfig()
    llm = llm or load_llm(config)
    prompts = [list(p) for p in prompts] if prompts is not None else _prompts(config, llm)
    if on_text is not None and llm.tokenizer is None:
        raise ValueError("streaming text needs the model's tokenizer")
    stream = None if on_text is None else TextStream(llm.tokenizer, on_text)
    on_tokens = None if stream is None else lambda outputs: stream.update(outputs[0])

    def generate(progress=None, on_tokens=None):
        return llm.generate(
            prompts,
            config.max_new_tokens,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            seed=config.seed if config.temperature > 0 else None,
            progress=progress,
            on_tokens=on_tokens,
        )

    if config.warmup_run:
        generate()
    counted = llm.speculative_counters()
    generated = generate(progress, on_tokens)
    speculation = None
    if llm.speculative is not None:
        speculation = SpeculationStats.between(
            llm.speculative.method, counted, llm.speculative_counters()
        )
    if stream is not None:
        stream.update(generated[0], final=True)
    stats = llm.last_stats
    matches = equal = divergence = None
    if config.compare:
        ids = [p if isinstance(p, list) else list(llm.tokenizer(p)["input_ids"]) for p in prompts]
        expected = transformers_greedy(llm.model, ids, config.max_new_tokens, config.ignore_eos)
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
        texts=None
        if tokenizer is None
        else tuple(tokenizer.decode(g, skip_special_tokens=True) for g in generated),
        elapsed_s=stats.elapsed_s,
        ttft=LatencyStats.from_seconds(stats.ttft_s),
        tpot=LatencyStats.from_seconds([t for t in stats.tpot_s if t > 0]),
        matches_transformers=matches,
        tokens_equal=equal,
        first_divergence=divergence,
        speculation=speculation,
    )


@dataclass(frozen=True)
class ChatDemo:
    """``flashdec demo``'s real text, loaded and ready: each message as one chat turn to a
    built-in real model in float32, checked token for token against transformers' greedy
    generate."""

    messages: tuple[str, ...]
    config: GenerateConfig
    llm: object  # flashdec.LLM, its KV pool sized for just these requests
    prompts: tuple[tuple[int, ...], ...]  # the messages in the chat template

    @staticmethod
    def config_for(
        messages: Sequence[str] = DEMO_CHAT_PROMPTS,
        *,
        model: str = "smollm2",
        max_new_tokens: int = DEMO_CHAT_NEW_TOKENS,
        device: str = "auto",
    ) -> GenerateConfig:
        """What the chat turns run as, known before the model loads (its memory can be checked
        first): ``prompt_len`` bounds the longest turn's tokens in the chat template."""
        config = GenerateConfig(
            model=model,
            dtype="float32",
            device=device,
            batch=len(messages),
            prompt_len=max(GenerateConfig.text_token_bound(m) for m in messages),
            max_new_tokens=max_new_tokens,
            compare=True,
        )
        return dataclasses.replace(config, warmup_run=config.on_gpu)  # Triton compiles once

    @classmethod
    def load(
        cls,
        messages: Sequence[str] = DEMO_CHAT_PROMPTS,
        *,
        config: GenerateConfig | None = None,
        loaded=None,
    ) -> ChatDemo:
        """The turns ready to run under ``config`` (default: :meth:`config_for` the messages;
        ``loaded``: the model already loaded, in float32)."""
        from flashdec.models import chat_prompt, resolve_model

        config = config or ChatDemo.config_for(messages)
        if loaded is None:
            loaded = resolve_model(config.model, dtype=torch.float32, device=config.torch_device())
        prompts = tuple(tuple(chat_prompt(loaded.tokenizer, m)) for m in messages)
        longest = max(map(len, prompts)) + config.max_new_tokens
        llm = load_llm(config, loaded, max_model_len=longest)
        return cls(tuple(messages), config, llm, prompts)

    def run(self, progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        return run_generate(self.config, llm=self.llm, progress=progress, prompts=self.prompts)


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first step where two generations differ (a length difference counts)."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return step
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def transformers_greedy(model, prompts: list[list[int]], new: int, ignore_eos: bool):
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        # EOS is a token like any other (min_new_tokens would mask it out of the argmax)
        extra = {"eos_token_id": None} if ignore_eos else {}
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
