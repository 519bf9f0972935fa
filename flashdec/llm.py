"""``flashdec.LLM``: generate with a transformers model through FlashDec's runtime.

The model's own weights run the projections and the MLP (PyTorch, with FlashDec's fused
RMSNorm and SiLU kernels on CUDA); attention is FlashDec's paged cache. Every loop step is one
engine step over the running batch: each running request's decode token plus chunks of admitted
prompts, under a token budget (``max_num_batched_tokens``). Requests are admitted by the lifetime
scheduler and joined into the running batch as others finish (continuous batching), all through
the one serving loop. On CUDA a decode-only step — every layer and the final argmax — replays a
CUDA graph per batch-size bucket and decode plan, all captured before the constructor returns;
the host does bookkeeping and one graph launch per step.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from flashdec._checks import (
    check_choice,
    check_device,
    check_fraction,
    check_positive_int,
    check_token_ids,
    type_name,
)
from flashdec.engine import DecodeEngine
from flashdec.engine.decode_graphs import WarmStart
from flashdec.engine.draft_model import DraftModelDrafter
from flashdec.engine.loop import LoopStep, ServingLoop
from flashdec.engine.preemption import ORDER_STRIDE, SwapPreemption
from flashdec.engine.request import Request, RequestTiming, now
from flashdec.engine.runner import ModelRunner
from flashdec.engine.sampling import SamplingParams, make_generator
from flashdec.kv_pool import (
    FP8_DTYPE,
    KVPoolConfig,
    build_kv_cache,
    set_cache_kv_scales,
    token_blocks,
)
from flashdec.kv_scales import (
    CALIBRATION_TOKENS,
    KVScales,
    calibrate_kv_scales,
    load_kv_scales,
    save_kv_scales,
    static_kv_scales,
)
from flashdec.models import DecoderAdapter, load_draft_model, resolve_model
from flashdec.scheduler import BlockAwareScheduler, RequestSpec, SchedulerConfig
from flashdec.speculative import SpeculativeConfig

log = logging.getLogger("flashdec")

KV_CACHE_DTYPES = ("auto", "fp8")  # "auto" (or None): the model's dtype; "fp8": float8_e4m3fn
KV_SCALE_MODES = ("dynamic", "static")  # or a path: flashdec.LLM's kv_scales


@dataclass(frozen=True)
class GenerationStats:
    """What the last :meth:`LLM.generate` call measured (wall clock, synchronised)."""

    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    elapsed_s: float
    ttft_s: tuple[float, ...]  # per request: submission -> first token
    tpot_s: tuple[float, ...]  # per request: mean time per output token after the first
    decode_steps: int
    graph_replays: int
    # speculative decoding (0 without it): drafts verified and accepted, the mean tokens a
    # request got per step that decoded it (1.0 without speculation), and the steps run plain
    # because verification measured slower there (SpeculativeConfig.min_speedup)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    tokens_per_step: float = 1.0
    held_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class LLM:
    """Greedy (or sampled) generation with a transformers causal LM through FlashDec.

    Args:
        model: a transformers ``PreTrainedModel`` (Llama, Qwen2, Mistral, Qwen3; GGUF
            checkpoints as transformers loads them, dequantized), a local model directory
            (loaded with its tokenizer, if saved), a built-in real model's name (``"smollm2"``,
            with its tokenizer; see :mod:`flashdec.models.real`) or the name of a built-in
            shape (``flashdec.models.BUILTIN_SHAPES``: random weights, seed 0).
        dtype: the model's dtype by default; another one converts the model in place.
        device: the model's device by default; another one moves the model there.
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool; default: what fits ``gpu_memory_fraction`` of the
            GPU (CPU: a quarter of the available host memory, at most 4 GiB), capped at what
            ``max_batch_size`` requests of ``max_model_len`` tokens can use.
        max_batch_size: requests decoded per step at most.
        cuda_graphs: capture the decode forward per batch-size bucket and decode plan, all of
            them before this constructor returns (the warm start; default: on CUDA with the
            Triton decode).
        tokenizer: used for text prompts (default: the one loaded with a model directory).
        max_model_len: longest prompt + output (default: the model's max positions, at most
            32768).
        gpu_memory_fraction: share of the GPU's memory the weights, the KV pool and the
            activations may use together when ``num_blocks`` is not given.
        append_backend, decode_backend: the engine's (default: ``fused`` / ``triton`` on CUDA,
            ``torch`` / ``torch`` on the CPU).
        kv_cache_dtype: ``None`` or ``"auto"`` stores K/V in the model's dtype; ``"fp8"`` stores
            them as float8_e4m3fn (1 byte per element: the KV pool holds twice the tokens of
            bf16) with a scale per layer and KV head (``stored = value / scale``, saturating at
            +-448; see ``kv_scales``). Needs an fp16/bf16 model. Prompt and decode attention
            both read the FP8 cache.
        kv_scales: where an FP8 cache's scales come from (only with ``"fp8"``):
            ``"dynamic"`` (the default) calibrates them from the first request's prompt — the
            K/V the model's own forward caches for its first 512 tokens, per layer and KV head
            max-abs x 2 / 448 (:mod:`flashdec.kv_scales`) — before that request is queued, and
            keeps them; ``"static"`` uses ``kv_scale`` for every layer and head; a path (a
            ``.safetensors`` file or a checkpoint directory) loads a checkpoint's ``k_scale`` /
            ``v_scale`` fields (or ``save_kv_scales``' file); a
            :class:`~flashdec.kv_scales.KVScales` is used as given. The scales are part of the
            prefix cache's hash root; ``kv_scales_in_use`` reads them back.
        kv_scale: the fixed K and V scale of every layer and head: with ``kv_scales="static"``
            (passing it alone implies ``"static"``; default 1.0, which suits K/V of magnitude up
            to a few hundred).
        max_num_batched_tokens: tokens one step brings at most: the running requests' decode
            tokens first, then prompt chunks (a long prompt is split across steps; a
            sliding-window model's chunks stay below its window). Every step imports at least
            one prompt token while prompts wait, so a full batch never starves them.
        enable_prefix_caching: automatic prefix caching (SPEC §8.7): a prompt starts with the
            longest run of cached full KV blocks matching its start (shared, immutable) and
            computes only the rest; the blocks of every imported prompt and finished request
            stay cached until an allocation needs them. Output is the same either way.
        speculative: a :class:`flashdec.SpeculativeConfig` turns on speculative decoding:
            each step verifies every running request's drafts in one mixed-token step and
            commits the accepted ones plus the target's next token (rejected drafts roll back
            bit-identically). Greedy output is unchanged token for token; sampling keeps the
            model's distribution. Requests that keep missing stop drafting for a while, and a
            batch of more than 32 decoding requests does not speculate. With CUDA graphs, a
            verification step whose rows all bring K drafts (no prompt chunk) replays a graph
            captured at the warm start; others run eagerly (see ``ModelRunner``).
        host_kv_cache_gib: the host tier of automatic prefix caching: GiB of pinned host memory
            that keep the cached KV blocks the GPU pool evicts (copied down in one batched
            transfer per allocation, on a side stream), so a later prompt that starts with them
            copies them up instead of recomputing them. 0 (the default) turns it off; needs
            ``enable_prefix_caching``. ``prefix_cache_stats()["host"]`` reports it.
        swap_patience: with the host tier, preemption by swap: once the oldest waiting request
            has waited this many steps because the KV pool is short (not for a batch slot),
            the newest running requests whose commitments it needs are swapped out: their full
            blocks stay cached (and go down to the host tier as the pool needs them), they wait
            again right behind it and resume from those blocks, recomputing only the rest.
            Each request is swapped at most once, so none is ever stuck
            (:mod:`flashdec.scheduler.preemption`); greedy output is unchanged. ``None``: never
            swap. ``num_swaps`` counts them.
        mixed_step_graphs: run the dense work of steps that carry prompt chunks (embedding,
            norms, projections, MLP) on CUDA graphs captured per token bucket at the warm start,
            attention eager between them (:mod:`flashdec.engine.piecewise_graphs`); steps of
            more than 1,024 tokens stay eager. Default: with ``cuda_graphs``.

    Raises TypeError/ValueError for bad arguments; ValueError naming any unsupported
    architecture or feature of the model.
    """

    def __init__(
        self,
        model,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 64,
        cuda_graphs: bool | None = None,
        tokenizer=None,
        max_model_len: int | None = None,
        gpu_memory_fraction: float = 0.9,
        append_backend: str | None = None,
        decode_backend: str | None = None,
        kv_cache_dtype: str | None = None,
        kv_scales: str | os.PathLike | KVScales | None = None,
        kv_scale: float | None = None,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        speculative: SpeculativeConfig | None = None,
        mixed_step_graphs: bool | None = None,
        host_kv_cache_gib: float = 0.0,
        swap_patience: int | None = 16,
    ) -> None:
        if mixed_step_graphs is not None and not isinstance(mixed_step_graphs, bool):
            raise TypeError(
                f"mixed_step_graphs must be a bool or None, got {type_name(mixed_step_graphs)}"
            )
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(
                f"speculative must be a SpeculativeConfig or None, got {type_name(speculative)}"
            )
        fp8 = _check_kv_cache_dtype(kv_cache_dtype, kv_scale)
        scale_mode = _check_kv_scales(kv_scales, kv_scale, fp8)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {type_name(enable_prefix_caching)}"
            )
        self.enable_prefix_caching = enable_prefix_caching
        self.host_kv_cache_gib = _check_host_kv_cache_gib(host_kv_cache_gib, enable_prefix_caching)
        if swap_patience is not None:
            check_positive_int("swap_patience", swap_patience, minimum=0)
        if device is not None:
            device = check_device(device)  # before a model moves: a clear error, not torch's
        fraction = check_fraction("gpu_memory_fraction", gpu_memory_fraction)
        if num_blocks is not None:
            check_positive_int("num_blocks", num_blocks)
        self.max_num_batched_tokens = check_positive_int(
            "max_num_batched_tokens", max_num_batched_tokens
        )
        if isinstance(model, (str, os.PathLike)):
            loaded = resolve_model(model, dtype=dtype, device=device)
            model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        elif not isinstance(model, torch.nn.Module):
            raise TypeError(
                "model must be a transformers PreTrainedModel, a local model directory or a "
                f"built-in shape name, got {type_name(model)}"
            )
        elif dtype is not None or device is not None:
            model.to(**{k: v for k, v in (("dtype", dtype), ("device", device)) if v})
        self.adapter = DecoderAdapter(model)  # ValueError naming unsupported features
        spec = self.adapter.spec
        if fp8 and spec.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"kv_cache_dtype='fp8' needs a float16 or bfloat16 model, this one is {spec.dtype} "
                "(pass dtype=torch.bfloat16)"
            )
        self.kv_cache_dtype = FP8_DTYPE if fp8 else spec.dtype
        self.kv_scale = 1.0 if kv_scale is None else float(kv_scale)
        # the FP8 cache's first scales; then the scales in use (None: not FP8, or dynamic and
        # not calibrated yet: the first request calibrates them)
        first_scales = _initial_kv_scales(scale_mode, spec, self.kv_scale) if fp8 else None
        self._calibrate_kv_scales = scale_mode == "dynamic"
        self._kv_scales = None if self._calibrate_kv_scales else first_scales
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = check_positive_int("block_size", block_size)
        self.max_batch_size = check_positive_int("max_batch_size", max_batch_size)
        if max_model_len is None:
            max_model_len = min(spec.max_position_embeddings, 32768)
        self.max_model_len = check_positive_int("max_model_len", max_model_len)
        torch_backend = "torch" in (append_backend, decode_backend)
        if cuda_graphs is None:  # a graph captures the Triton kernels (see the checks below)
            cuda_graphs = spec.device.type == "cuda" and not torch_backend
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool or None, got {cuda_graphs!r}")
        if cuda_graphs and decode_backend == "torch":
            raise ValueError(
                "cuda_graphs=True needs decode_backend='triton' (the torch decode reads lengths "
                "back to the host, which a CUDA graph cannot capture)"
            )
        if cuda_graphs and append_backend == "torch":
            raise ValueError(
                "cuda_graphs=True needs append_backend 'fused' or 'triton' (the torch append "
                "writes as many rows as the captured step had live, so a replay with padding "
                "rows would write them into the pool)"
            )
        if cuda_graphs and spec.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        if mixed_step_graphs and not cuda_graphs:
            raise ValueError("mixed_step_graphs=True needs cuda_graphs=True")
        self.cuda_graphs = cuda_graphs
        if self.max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({spec.max_position_embeddings})"
            )

        # a draft model is loaded first: its weights count as used when the pools are sized
        draft = None
        if speculative is not None and speculative.method == "draft":
            draft = load_draft_model(speculative.draft_model, spec, self.max_model_len)
        pool = KVPoolConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            max_batch_size=self.max_batch_size,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_scales=first_scales,
            memory_fraction=fraction,
            enable_prefix_caching=self.enable_prefix_caching,
            companion_kv_bytes_per_token=0 if draft is None else draft.spec.kv_bytes_per_token,
            host_kv_cache_bytes=int(self.host_kv_cache_gib * 2**30),
        )
        cache = build_kv_cache(model, spec, pool)
        on_cuda = spec.device.type == "cuda"
        append_backend = append_backend or ("fused" if on_cuda else "torch")
        decode_backend = decode_backend or ("triton" if on_cuda else "torch")
        self.engine = DecodeEngine.for_model(
            cache, spec, append_backend=append_backend, decode_backend=decode_backend
        )
        self.scheduler = BlockAwareScheduler(
            SchedulerConfig(max_active_requests=max_batch_size, max_batch_size=max_batch_size)
        )
        self._runner = ModelRunner(
            self.engine,
            self.adapter,
            max_batch_size=self.max_batch_size,
            cuda_graphs=self.cuda_graphs,
            speculative=speculative,
            max_step_tokens=self.max_num_batched_tokens,
            mixed_step_graphs=mixed_step_graphs,
            drafter=None
            if draft is None
            else DraftModelDrafter(
                draft,
                # as many tokens as the target's (the budget was shared for that)
                build_kv_cache(
                    draft.model,
                    draft.spec,
                    replace(
                        pool,
                        num_blocks=token_blocks(cache),
                        kv_cache_dtype=draft.spec.dtype,
                        kv_scales=None,
                        enable_prefix_caching=False,
                        companion_kv_bytes_per_token=0,
                        host_kv_cache_bytes=0,
                    ),
                ),
                append_backend=append_backend,
                decode_backend=decode_backend,
            ),
        )
        self.speculative = speculative
        if self.enable_prefix_caching:  # a finished request's answer joins the prefix cache
            self.engine.submissions.generated_tokens = self._runner.generated_tokens
        # preemption by swap needs somewhere to swap to: the host tier
        preemption = None
        if self.host_kv_cache_gib and swap_patience is not None:
            preemption = SwapPreemption(self._runner, self._resumed_spec, swap_patience)
        self.loop = ServingLoop(
            self.engine,
            self.scheduler,
            self._runner,
            max_step_tokens=self.max_num_batched_tokens,
            preemption=preemption,
        )
        self._next_id = 0
        self.last_stats: GenerationStats | None = None
        # on CUDA, every decode graph is captured before a request arrives (None: no graphs)
        self.warm_start: WarmStart | None = self._runner.warm_start() if cuda_graphs else None

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer (load a model directory that has one, or "
                    "pass tokenizer=); pass token ids instead"
                )
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, (list, tuple, np.ndarray, torch.Tensor)):
            raise TypeError(
                f"a prompt must be a list of token ids or a str, got {type_name(prompt)}"
            )
        return check_token_ids("a prompt", prompt)

    def _spec(self, request_id: int, num_prompt_tokens: int, max_new_tokens: int) -> RequestSpec:
        # orders spaced out: a swapped request waits again right behind the one it gave way to
        return self._resumed_spec(
            request_id, num_prompt_tokens, max_new_tokens, request_id * ORDER_STRIDE
        )

    @staticmethod
    def _resumed_spec(request_id, context_tokens: int, new_tokens: int, order: int) -> RequestSpec:
        # the lifetime commitment: the context plus every token whose K/V is appended
        return RequestSpec(request_id, context_tokens, max(1, new_tokens - 1), order)

    def _calibrate(self, ids: list[int]) -> None:
        """Dynamic FP8 scales from the first request's prompt, into the (empty) cache."""
        scales = calibrate_kv_scales(self.model, ids)
        set_cache_kv_scales(self.engine.cache, scales)
        self._kv_scales, self._calibrate_kv_scales = scales, False
        log.info(
            "FP8 KV scales calibrated on %d prompt tokens: K %.3g..%.3g, V %.3g..%.3g",
            min(len(ids), CALIBRATION_TOKENS),
            scales.k.min(),
            scales.k.max(),
            scales.v.min(),
            scales.v.max(),
        )

    @property
    def kv_scales_in_use(self) -> KVScales | None:
        """The FP8 cache's scales per layer and KV head (``source`` says where they came
        from); None without an FP8 cache, or with dynamic scales before the first request."""
        return self._kv_scales

    def save_kv_scales(self, path: str | os.PathLike) -> None:
        """Write the FP8 scales in use to a ``.safetensors`` file that ``kv_scales=path``
        loads (a checkpoint's field names); RuntimeError when there are none yet."""
        if self._kv_scales is None:
            raise RuntimeError(
                "no FP8 KV scales to save: the cache is not FP8, or its dynamic scales are "
                "calibrated by the first request"
            )
        save_kv_scales(self._kv_scales, path)

    @property
    def num_swaps(self) -> int:
        """Running requests swapped out so far (preemption by swap; ``swap_patience``)."""
        preemption = self.loop.preemption
        return 0 if preemption is None else preemption.num_swaps

    def _check_request(self, prompt, max_new_tokens: int, ignore_eos: bool) -> list[int]:
        """Every check of one request (its prompt ids), before anything is queued."""
        ids = self._prompt_ids(prompt)
        check_positive_int("max_new_tokens", max_new_tokens)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type_name(ignore_eos)}")
        vocab = self.adapter.spec.vocab_size
        if not ids:
            raise ValueError("a prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(
                f"prompt token ids must lie in [0, {vocab}), got {min(ids)}..{max(ids)}"
            )
        if len(ids) + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        # the scheduler's own rule: a request an empty pool cannot hold would wait forever
        reason = self.loop.rejection_reason(self._spec(self._next_id, len(ids), max_new_tokens))
        if reason is not None:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) can never fit "
                f"the KV cache: it {reason}"
            )
        return ids

    def _queue(
        self,
        ids: list[int],
        max_new_tokens: int,
        ignore_eos: bool,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> int:
        if self._calibrate_kv_scales:  # before its prompt is hashed for the prefix cache
            self._calibrate(ids)
        rid = self._next_id
        prompt = torch.tensor(ids, dtype=torch.long, device=self.adapter.spec.device)
        request = Request(prompt, max_new_tokens, ignore_eos, now(), sampling, generator)
        self._runner.requests[rid] = request
        submissions = self.engine.submissions
        try:
            if self.enable_prefix_caching:
                submissions.remember_prompt(rid, ids)
            self.loop.submit(self._spec(rid, len(ids), max_new_tokens))
        except BaseException:
            submissions.forget(rid)
            self._runner.forget(rid)
            raise
        if sampling is not None and not sampling.greedy:
            self._runner.sampled.add(rid)
        self._next_id += 1
        return rid

    def add_request(
        self,
        prompt,
        max_new_tokens: int = 32,
        *,
        ignore_eos: bool = False,
        sampling: SamplingParams | None = None,
    ):
        """Queue one prompt (token ids, or text with a tokenizer); returns its request id.

        It is admitted as the pool allows and joins the running batch at the next
        :meth:`step`. All checks happen before anything is queued, including that the KV
        cache can ever hold it (ValueError naming the blocks it needs and the blocks there are).
        ``sampling`` is this request's own (default: greedy); with a ``seed`` its samples do not
        depend on the other requests of the batch.
        """
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type_name(sampling)}")
        ids = self._check_request(prompt, max_new_tokens, ignore_eos)
        generator = None
        if not sampling.greedy:
            generator = self._runner.request_generator(sampling)
        return self._queue(ids, max_new_tokens, ignore_eos, sampling, generator)

    def abort_request(self, request_id) -> list[int]:
        """Stop ``request_id`` and forget it; returns the tokens of it that reached the host
        (never waits for the device: a token still on its way is dropped). A waiting or running
        request is cancelled between steps: its KV blocks return to the pool at once (the next
        step can admit others into them). A finished request is just forgotten, like
        :meth:`release`. ValueError for an unknown id."""
        try:
            req = self._runner.requests[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {request_id!r}") from None
        if self.loop.is_live(request_id):
            self.loop.cancel(request_id)
        self._runner.forget(request_id)
        return req.tokens

    def poll(self, request_id, start: int = 0) -> tuple[list[int], bool]:
        """What has reached the host for ``request_id``, without waiting for the device: its
        tokens from index ``start`` on, and whether it has finished (every token is in). For a
        server streaming tokens as the steps produce them. RuntimeError for a request the
        scheduler rejected, ValueError for an unknown id."""
        try:
            req = self._runner.requests[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {request_id!r}") from None
        if req.error is not None:
            raise RuntimeError(f"request {request_id!r} did not run: {req.error}")
        return req.tokens[start:], req.finished_at is not None

    def step(self) -> LoopStep | None:
        """One serving-loop step: admit, import prompts, decode one token for the batch. When
        nothing runs but the last step's tokens are still on their way, collect them (None).

        A step that raises (a KeyboardInterrupt, an error in the model) leaves every request as
        it was before it: stepping on gives the tokens an uninterrupted run gives."""
        if self.loop.idle:
            self._runner.collect()
            self._runner.ended.clear()  # nothing runs that the loop would still finish
            return None
        return self._step()

    def _step(self) -> LoopStep:
        record = self.loop.step()
        if self.enable_prefix_caching:  # imported prompt blocks become hits for others
            cache = self.engine.cache
            for rid in record.prefilled:
                if rid not in record.finished:
                    cache.prefix_cache.cache_request_blocks(rid)
        for rid, reason in zip(record.rejected, record.rejection_reasons, strict=True):
            self._runner.requests[rid].error = f"the scheduler rejected it: {reason}"
        return record

    def prefix_cache_stats(self) -> dict:
        """Automatic prefix caching's counters (SPEC §8.7): ``queried_tokens`` (prompt tokens
        looked up at admission), ``hit_tokens`` (found cached: ``gpu_hit_tokens`` in the GPU
        pool, ``host_hit_tokens`` copied up from the host tier), ``hit_rate``,
        ``cached_blocks`` (indexed in the GPU pool now), ``evictable_blocks`` (cached, held by
        no request: counted as free), ``evicted_blocks`` (reclaimed by allocations so far),
        ``enabled``, and ``host``: the host tier's counters, or None without one —
        ``capacity_blocks``, ``cached_blocks``, ``blocks_down`` / ``blocks_up`` and
        ``bytes_down`` / ``bytes_up`` (moved each way), ``copy_down_s`` / ``copy_up_s`` (time
        of the completed copies), ``dropped_blocks`` (LRU entries dropped when full),
        ``failed_down`` / ``failed_up`` (copies that raised: recomputed instead)."""
        return self.engine.cache.prefix_cache.stats()

    def speculative_counters(self) -> dict[str, int]:
        """Running totals since the LLM was made (SPEC §8.8): ``draft_tokens`` (drafts
        verified), ``accepted_tokens``, ``request_steps`` (a request decoded in a step) and
        ``step_tokens`` (the tokens those gave), ``held_steps`` (steps run plain because
        verification measured slower: ``SpeculativeConfig.min_speedup``); the difference of two
        readings covers what ran between them. Without speculation the drafts stay 0 and every
        request step gives one token."""
        return dict(self._runner.counters)

    def has_unfinished(self) -> bool:
        return not self.loop.idle or self._runner.pending is not None

    def output(self, request_id) -> list[int]:
        """The tokens generated so far for ``request_id`` (the prompt excluded); RuntimeError
        for a request the scheduler rejected, naming why."""
        req = self._request(request_id)
        if req.error is not None:
            raise RuntimeError(f"request {request_id!r} did not run: {req.error}")
        return list(req.tokens)

    def request_timing(self, request_id) -> RequestTiming:
        req = self._request(request_id)
        return req.timing()

    def release(self, request_id) -> list[int]:
        """Forget a finished (or rejected) request's record; returns its tokens, all of them
        (a rejected request's: none)."""
        req = self._request(request_id)
        if self.loop.is_live(request_id):
            raise RuntimeError(f"request {request_id!r} is still running")
        self._runner.forget(request_id)
        return req.tokens

    def _request(self, request_id) -> Request:
        """The record of ``request_id``; once it stopped running, with every token it made
        (its last one may still be on its way from the device: read it now)."""
        try:
            req = self._runner.requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request id {request_id!r}") from None
        if self._runner.is_pending(request_id) and not self.loop.is_live(request_id):
            self._runner.collect()
        return req

    def generate(
        self,
        prompts,
        max_new_tokens: int = 32,
        *,
        ignore_eos: bool = False,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        progress=None,
        on_tokens=None,
    ) -> list[list[int]]:
        """Generate for every prompt; returns the generated ids only, one list per prompt, in
        order (a sequence stops after its EOS token unless ``ignore_eos``).

        Greedy by default (exactly transformers' greedy ``generate``); ``temperature > 0``
        samples (with ``top_k`` / ``top_p``, reproducibly under ``seed``). ``progress(done,
        total)`` is called after every step with the tokens generated so far;
        ``on_tokens(outputs)`` (for streaming) with every prompt's tokens so far, in order.

        Every prompt is checked before any is queued; whatever happens, nothing of the call
        is left behind (an interrupted call cancels its requests and forgets them).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a non-empty list of token-id lists or strings")
        if progress is not None and not callable(progress):
            raise TypeError(
                f"progress must be a callable(done, total) or None, got {type_name(progress)}"
            )
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(
                f"on_tokens must be a callable(outputs) or None, got {type_name(on_tokens)}"
            )
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        if not self.loop.idle:
            raise RuntimeError(
                "generate needs an idle LLM (requests added with add_request "
                "are still running: step them to completion first)"
            )
        checked = [self._check_request(p, max_new_tokens, ignore_eos) for p in prompts]
        runner = self._runner
        runner.collect()  # the last tokens of requests added with add_request: theirs to keep
        runner.ended.clear()
        # one generator for the call: its rows are sampled together, reproducibly under seed
        generator = None
        if not sampling.greedy:
            generator = make_generator(self.adapter.spec.device, sampling.seed)
        start = now(self.adapter.spec.device)
        rids: list[int] = []
        replays_before = runner.graph_replays
        counted = dict(runner.counters)
        steps = 0
        try:
            for ids in checked:
                rids.append(self._queue(ids, max_new_tokens, ignore_eos, sampling, generator))
            total = max_new_tokens * len(rids)
            while not self.loop.idle:
                self._step()
                steps += 1
                self._report(rids, total, progress, on_tokens)
            runner.collect()
            self._report(rids, total, progress, on_tokens)
            requests = [runner.requests[rid] for rid in rids]
            for i, req in enumerate(requests):
                if req.error is not None:
                    raise RuntimeError(f"prompt {i} did not run: {req.error}")
        finally:
            self.loop.close()  # an error mid-way cancels what is left: the pool stays clean
            runner.pending = None
            runner.ended.clear()
            for rid in rids:  # the caller never sees these ids: forget them, whatever happened
                runner.forget(rid)
        elapsed = now(self.adapter.spec.device) - start
        counts = {key: runner.counters[key] - counted[key] for key in counted}
        self.last_stats = GenerationStats(
            num_requests=len(requests),
            prompt_tokens=sum(r.prompt.shape[0] for r in requests),
            generated_tokens=sum(len(r.tokens) for r in requests),
            elapsed_s=elapsed,
            ttft_s=tuple(r.first_token_at - r.submitted_at for r in requests),
            tpot_s=tuple(r.time_per_output_token() for r in requests),
            decode_steps=steps,
            graph_replays=runner.graph_replays - replays_before,
            draft_tokens=counts["draft_tokens"],
            accepted_tokens=counts["accepted_tokens"],
            tokens_per_step=counts["step_tokens"] / max(1, counts["request_steps"]),
            held_steps=counts["held_steps"],
        )
        return [r.tokens for r in requests]

    def _report(self, rids: list, total: int, progress, on_tokens) -> None:
        """``generate``'s callbacks after a step: tokens done, and each prompt's tokens."""
        requests = [self._runner.requests[r] for r in rids]
        if progress is not None:
            progress(sum(len(r.tokens) for r in requests), total)
        if on_tokens is not None:
            on_tokens([list(r.tokens) for r in requests])


def _check_host_kv_cache_gib(gib: object, caching: bool) -> float:
    """The host tier's size in GiB; TypeError/ValueError for a bad one."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)):
        raise TypeError(f"host_kv_cache_gib must be a number, got {type_name(gib)}")
    if not (math.isfinite(gib) and gib >= 0):
        raise ValueError(f"host_kv_cache_gib must be finite and >= 0, got {gib!r}")
    if gib and not caching:
        raise ValueError("host_kv_cache_gib needs enable_prefix_caching=True")
    return float(gib)


def _check_kv_scales(kv_scales: object, kv_scale: float | None, fp8: bool) -> object:
    """``kv_scales`` checked: ``"dynamic"``, ``"static"``, a path or a KVScales (None: dynamic,
    or static when ``kv_scale`` was given); TypeError/ValueError for a bad one."""
    if kv_scales is None:
        return None if not fp8 else ("dynamic" if kv_scale is None else "static")
    if not fp8:
        raise ValueError("kv_scales applies only with kv_cache_dtype='fp8'")
    if isinstance(kv_scales, KVScales):
        mode: object = kv_scales
    elif isinstance(kv_scales, (str, os.PathLike)):
        mode = kv_scales if kv_scales in KV_SCALE_MODES else os.fspath(kv_scales)
        if mode not in KV_SCALE_MODES and not os.path.exists(mode):
            raise ValueError(
                f"kv_scales must be 'dynamic', 'static', an existing .safetensors file or "
                f"checkpoint directory, or a KVScales; {mode!r} does not exist"
            )
    else:
        raise TypeError(
            "kv_scales must be 'dynamic', 'static', a path or a KVScales, got "
            f"{type_name(kv_scales)}"
        )
    if kv_scale is not None and mode != "static":
        raise ValueError(f"kv_scale applies only with kv_scales='static', not {kv_scales!r}")
    return mode


def _initial_kv_scales(mode: object, spec, kv_scale: float) -> KVScales:
    """The FP8 scales the cache starts with (dynamic: 1.0 until the first prompt calibrates)."""
    layers, heads = spec.num_layers, spec.num_kv_heads
    if isinstance(mode, KVScales):
        if (mode.num_layers, mode.num_kv_heads) != (layers, heads):
            raise ValueError(
                f"kv_scales has {mode.num_layers} layers x {mode.num_kv_heads} KV heads; the "
                f"model has {layers} x {heads}"
            )
        return mode
    if mode == "static":
        return static_kv_scales(layers, heads, kv_scale)
    if mode == "dynamic":
        return static_kv_scales(layers, heads, 1.0)
    return load_kv_scales(mode, layers, heads)  # a path: ValueError naming what is wrong


def _check_kv_cache_dtype(kv_cache_dtype: object, kv_scale: object) -> bool:
    """Whether the KV cache is FP8; TypeError/ValueError for a bad option or scale."""
    fp8 = (
        kv_cache_dtype is not None
        and check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES) == "fp8"
    )
    if kv_scale is None:
        return fp8
    if isinstance(kv_scale, bool) or not isinstance(kv_scale, (int, float)):
        raise TypeError(f"kv_scale must be a float, got {type(kv_scale).__name__}")
    if not (math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale must be finite and > 0, got {kv_scale!r}")
    if kv_scale != 1.0 and not fp8:
        raise ValueError("kv_scale applies only with kv_cache_dtype='fp8'")
    return fp8
