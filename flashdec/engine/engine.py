"""DecodeEngine: one request lifecycle over the cache, and the layer operations of a step.

The engine owns no block and no length: :class:`~flashdec.cache.PagedKVCache` stays the single
source of truth for every request it holds (active, finished, cancelled). The engine adds only
what exists before a request reaches the cache — waiting (with its spec when a scheduler manages
it), rejected, or cancelled while waiting — so the two can never disagree about a state (the
states and their transitions: the :class:`~flashdec.engine.lifecycle.RequestLifecycle` mixin).
The scheduler-managed requests' specs, waiting queue and fairness counters are its ``submissions``
(:mod:`flashdec.engine.submissions`), which the serving loop drives.

A step is ``begin_step`` (all validation, the reservation, one metadata upload) → ``step_layer``
per layer (a thin launch of RoPE + append and decode over fixed-address buffers) →
``commit_step``. Once ``begin_step`` has run, the layers of a step can be captured in a CUDA
graph (``capture_step``) and replayed for later steps of the same batch (``replay_step``).

How a layer's attention runs — RoPE + append, then decode or extend, in the layer's KV group
(SPEC §8.2: its storage, tables, geometry and window; its own plan, workspace and bound launch per
step) — is :class:`~flashdec.engine.attention.StepAttention`'s (``engine.attention``); the engine
decides which step is open and whether a layer may run. One group is the normal case of the same
path (no separate one-group methods).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from flashdec._checks import (
    check_choice,
    check_positive_int,
    check_token_counts,
)
from flashdec.cache import PagedKVCache, RequestState, TokenTransactionView, TransactionSlots
from flashdec.cache.history import TERMINAL_HISTORY_LIMIT, TerminalHistory
from flashdec.engine.attention import StepAttention, activation_dtype_of
from flashdec.engine.layer_ops import APPEND_BACKENDS, DECODE_BACKENDS, check_prompt_layers
from flashdec.engine.lifecycle import RequestLifecycle
from flashdec.engine.snapshot import cache_group_shapes
from flashdec.engine.states import EngineRequestState
from flashdec.engine.step import CapturedStep, OpenStep, StepResult
from flashdec.engine.submissions import SubmissionQueue
from flashdec.kernels import triton_runs_on
from flashdec.runtime import capture_cuda_graph, upload
from flashdec.scheduler import (
    BlockAwareScheduler,
    RequestSpec,
    SchedulerDecision,
    SchedulingSnapshot,
)

log = logging.getLogger("flashdec")
T = TypeVar("T")


class DecodeEngine(RequestLifecycle):
    """Runs decode steps for a batch of requests over one :class:`PagedKVCache`.

    Args:
        cache: the cache this engine drives (its only source of block and length truth).
        append_backend: ``"torch"``, ``"triton"`` or ``"fused"`` (one fused RoPE + append kernel).
        decode_backend: ``"torch"`` (gather + dense math) or ``"triton"`` (split-KV kernel).
            On a CPU cache without Triton's interpreter (``TRITON_INTERPRET=1`` set before
            Triton is imported), Triton backends fall back to ``"torch"`` with a warning.
        rotary_dim: dims rotated by RoPE; ``None`` rotates the whole head.
        rope_base: RoPE frequency base.
        sm_scale: softmax scale; ``None`` = ``head_dim ** -0.5``.
        rope_inv_freq: a model's own float32 inverse frequencies ``[rotary_dim // 2]`` (e.g. with
            llama3 scaling), used instead of ``rope_base``.
        activation_dtype: the dtype of ``q, k, v`` and of the attention output. ``None`` = the
            cache's dtype (float caches); required — float16 or bfloat16 — when a KV group
            stores float8_e4m3fn. A float group's storage dtype must equal it. FP8 groups
            quantize on append and dequantize in attention with each layer's scales per KV head
            (``cache.layout.layer_kv_scales``; ``cache.set_kv_scales`` replaces them while the
            cache holds nothing, as ``flashdec.LLM``'s calibration does).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        append_backend: str = "fused",
        decode_backend: str = "triton",
        rotary_dim: int | None = None,
        rope_base: float = 10000.0,
        sm_scale: float | None = None,
        *,
        rope_inv_freq: torch.Tensor | None = None,
        activation_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        append_backend = check_choice("append_backend", append_backend, APPEND_BACKENDS)
        decode_backend = check_choice("decode_backend", decode_backend, DECODE_BACKENDS)
        specs = cache.kv_groups
        self.activation_dtype = activation_dtype_of(specs, activation_dtype)
        if not triton_runs_on(cache.device) and "torch" not in (append_backend, decode_backend):
            log.warning(
                "Triton kernels cannot run on %s tensors in this process (set TRITON_INTERPRET=1 "
                "before Triton is imported to interpret them): using the torch backends",
                cache.device,
            )
        if not triton_runs_on(cache.device):
            append_backend = decode_backend = "torch"
        self.cache = cache
        self.append_backend = append_backend
        self.decode_backend = decode_backend
        # how a layer's attention runs in its group (RoPE, append, decode / extend)
        self.attention = StepAttention(
            cache,
            append_backend,
            decode_backend,
            self.activation_dtype,
            rotary_dim,
            rope_base,
            sm_scale,
            rope_inv_freq,
        )
        self.rope = self.attention.ropes[0]
        self.sm_scale = self.attention.sm_scales[0]
        self._windows = self.attention.windows
        self._num_groups = len(specs)
        self._num_layers = cache.num_layers
        self._layer_groups = tuple(cache.layout.layer_group(i) for i in range(cache.num_layers))
        # what the scheduler derives requests' needs from: empty for one full-attention group
        self._group_shapes = cache_group_shapes(cache)
        self._block_size = specs[0].block_size
        self._dtype = self.activation_dtype
        self._open: OpenStep | None = None
        self._capturing = False
        # the lifecycle before and beside the cache; what stays of a terminal request is
        # bounded (flashdec.cache.history): a server runs without end
        self._waiting: dict[Any, RequestSpec | None] = {}  # insertion order
        # rejected / cancelled while waiting: every state, and the newest ids listed
        self._closed = TerminalHistory(EngineRequestState.REJECTED, TERMINAL_HISTORY_LIMIT)
        self._mode: str | None = None  # "unscheduled" or "scheduled", fixed by the first request
        # scheduler-managed requests: specs, the waiting queue and the fairness counters (the
        # serving loop drives them); the SPEC's submit/snapshot/apply delegate to it
        self.submissions = SubmissionQueue(self)

    @classmethod
    def for_model(
        cls, cache: PagedKVCache, spec, *, append_backend: str, decode_backend: str
    ) -> DecodeEngine:
        """An engine over ``cache`` for a model of ``spec`` (a ``flashdec.models.ModelSpec``:
        models sit above the engine, not imported), with its RoPE, softmax scale and dtype."""
        return cls(
            cache,
            append_backend=append_backend,
            decode_backend=decode_backend,
            rotary_dim=spec.rotary_dim,
            sm_scale=spec.sm_scale,
            rope_inv_freq=spec.inv_freq,
            activation_dtype=spec.dtype,
        )

    @property
    def group_shapes(self) -> tuple[tuple[int, int | None], ...]:
        """Each KV layer group's ``(block_size, window)`` as the scheduler counts blocks; empty
        for a cache of one full-attention group."""
        return self._group_shapes

    @property
    def max_tokens_per_request_step(self) -> int | None:
        """The most tokens one request may bring to one step: ``window - 1`` of the smallest
        sliding window (``begin_step``'s rule; one token always), None without a window."""
        windows = [w for w in self._windows if w is not None]
        return max(1, min(windows) - 1) if windows else None

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim

    @property
    def rope_base(self) -> float:
        return self.rope.base

    # ------------------------------------------------------------------ scheduler-managed
    def submit_request(self, spec: RequestSpec) -> None:
        """Queue a scheduler-managed request; the scheduler admits or rejects it later (SPEC §5;
        the queue is :attr:`submissions`). A request with a prefix needs that prefix resident
        now, covering its whole context."""
        self.submissions.submit_request(spec)

    def scheduling_snapshot(
        self,
        step: int,
        waiting_wait_steps: Mapping | None = None,
        waiting_skip_counts: Mapping | None = None,
        active_service_wait_steps: Mapping | None = None,
    ) -> SchedulingSnapshot:
        """K/V-free metadata for the scheduler, read from the live cache (SPEC §5; see
        :meth:`SubmissionQueue.scheduling_snapshot`): without counter arguments, the queue's
        own counters (zero unless a :class:`ServingLoop` advances them)."""
        return self.submissions.scheduling_snapshot(
            step, waiting_wait_steps, waiting_skip_counts, active_service_wait_steps
        )

    def apply_scheduler_decision(
        self,
        decision: SchedulerDecision,
        *,
        scheduler: BlockAwareScheduler,
        snapshot: SchedulingSnapshot,
    ) -> SchedulerDecision:
        """Admit and reject what ``decision`` says after proving it current and canonical (SPEC
        §5, §6; see :meth:`SubmissionQueue.apply_scheduler_decision`). Returns it."""
        return self.submissions.apply_scheduler_decision(
            decision, scheduler=scheduler, snapshot=snapshot
        )

    # ------------------------------------------------------------------ single-layer step
    def step(
        self, request_ids: Sequence, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Append one token and decode it for every listed request (``num_layers == 1`` only)."""
        if self.cache.num_layers != 1:
            raise RuntimeError(
                f"step() needs a single-layer cache (this one has {self.cache.num_layers} layers); "
                "use begin_step / step_layer / commit_step"
            )
        tx = self.begin_step(request_ids)
        out = self.step_layer(tx, 0, q, k, v)
        self.commit_step(tx)
        return out

    # ------------------------------------------------------------------ multi-layer step
    def _check_batch(self, request_ids: object, action: str) -> tuple:
        _check_batch_type(request_ids)
        rids = tuple(request_ids)
        self._explain_batch(rids, action)
        return rids

    def _explain_batch(self, rids: Sequence, action: str) -> None:
        """RuntimeError for an id the engine holds but the cache cannot know (waiting or closed
        before admission): the cache checks every other id itself."""
        waiting, closed = self._waiting, self._closed
        for rid in rids:
            if rid in waiting or (type(rid) in (str, int) and closed.state(rid) is not None):
                self._require_state(rid, EngineRequestState.ACTIVE, action)

    def begin_step(
        self,
        request_ids: Sequence,
        pad_to: int | None = None,
        *,
        num_tokens: Sequence[int] | None = None,
        plan_len: int | None = None,
    ):
        """Open a step: the cache reserves ``num_tokens[i]`` slots for request ``i`` (None: one
        each), all or nothing.

        One token each is the decode step: ``pad_to`` pads its rows to a CUDA graph's captured
        batch (every layer then takes ``q, k, v`` with ``pad_to`` rows; padding rows are neither
        stored nor attended). ``plan_len`` sizes its decode plans for requests that long (at
        least the batch's longest after the step): a CUDA graph captured before such requests
        exist. With more, every layer takes ``q, k, v`` packed
        ``[sum(num_tokens), H, D]`` in ``request_ids`` order and returns the extend attention of
        each new token over its request's context and the new tokens before it. A step whose
        rows all bring the same ``n >= 2`` tokens (a verification step) takes ``pad_to`` and
        ``plan_len`` too: it is then a fixed-shape step (its metadata in fixed-address
        buffers, ``q, k, v`` of ``pad_to * n`` rows, the padding rows last), which
        ``capture_step`` can capture and ``replay_step`` replay. A scheduled request's tokens
        come out of its lifetime commitment; a sliding-window group takes at most
        ``window - 1`` tokens of a request per step.
        """
        self._require_no_open_step("begin_step")
        _check_batch_type(request_ids)
        if plan_len is not None:
            check_positive_int("plan_len", plan_len)
        if num_tokens is not None:
            counts = check_token_counts("num_tokens", num_tokens, len(request_ids))
            self._check_token_budget(request_ids, counts)
            if any(n != 1 for n in counts):
                fixed = pad_to is not None or plan_len is not None
                if fixed and len(set(counts)) != 1:
                    raise ValueError(
                        "pad_to and plan_len are for steps whose rows all bring the same number "
                        f"of tokens (decode, verification); got num_tokens {counts}"
                    )
                if pad_to is not None:
                    check_positive_int("pad_to", pad_to)
                    if pad_to < len(counts):
                        raise ValueError(
                            f"pad_to ({pad_to}) must be >= the batch size ({len(counts)})"
                        )
                if not fixed:
                    return self._begin_extend(request_ids, counts)
                return self._begin_fixed_extend(
                    request_ids, counts, pad_to or len(counts), plan_len
                )
        cache = self.cache
        # the fused append saves the old slot bytes for abort in its own launch
        by_writer = self.attention.fused_triton
        try:  # the cache validates the batch (in O(1) when it is the last step's)
            view = cache.begin_token(request_ids, pad_to=pad_to, backup_by_writer=by_writer)
        except (ValueError, RuntimeError):
            self._explain_batch(request_ids, "step")
            raise
        # tuples, as StepResult reports them; + 1 in Python (cheaper than a numpy op + tolist)
        positions = tuple(view.host_positions.tolist())
        step = OpenStep(
            "decode",
            view,
            self._all_group_slots(view),
            positions,
            tuple(map((1).__add__, positions)),
        )
        if plan_len is not None:
            step.plan_len = max(step.plan_len, plan_len)
        if by_writer:
            step.backups = tuple(
                cache.steps.transaction_backup(view, group=g) for g in range(self._num_groups)
            )
        self._open = step
        return view

    def _check_token_budget(self, request_ids: Sequence, counts: list[int]) -> None:
        """ValueError when a scheduled request would take more tokens than its lifetime
        commitment has left, or a window group more than its window allows in one step."""
        self._explain_batch(request_ids, "step")
        specs, cache = self.submissions.specs, self.cache
        for i, (rid, n) in enumerate(zip(request_ids, counts, strict=True)):
            spec = specs.get(rid) if type(rid) in (str, int) else None
            if spec is None or cache.request_state(rid) is not RequestState.ACTIVE:
                continue  # unscheduled (no commitment) or not active: begin_token says why
            left = spec.initial_context_tokens + spec.max_new_tokens - cache.seq_len(rid)
            if n > left:
                raise ValueError(
                    f"num_tokens[{i}] = {n} for request {rid!r}, but its lifetime commitment "
                    f"has only {left} token(s) left"
                )
        for g, window in enumerate(self._windows):
            if window is not None and 1 < max(counts) >= window:
                raise ValueError(
                    f"num_tokens: a step brings at most window - 1 = {window - 1} tokens of a "
                    f"request to sliding-window KV group {g} (window {window}), got "
                    f"{max(counts)}"
                )

    def _begin_extend(self, request_ids: Sequence, counts: list[int]):
        """``begin_step`` for a step with more than one token for some request."""
        rids = self._check_batch(request_ids, "step")
        cache = self.cache
        view = cache.begin_tokens(list(rids), counts)
        starts = view.host_seq_lens.tolist()
        after = [s + n for s, n in zip(starts, counts, strict=True)]
        step = OpenStep("extend", view, self._all_group_slots(view), starts, after)
        step.query_lens = upload(counts, cache.device, torch.int32)  # no wait for the GPU
        self._open = step
        return view

    def _begin_fixed_extend(
        self, request_ids: Sequence, counts: list[int], num_rows: int, plan_len: int | None
    ):
        """``begin_step`` for a fixed-shape step: ``counts[0]`` tokens for every request, the
        metadata copied into the fixed buffers of ``num_rows`` rows (the rest padding)."""
        view = self._begin_extend(request_ids, counts)
        step = self._open
        n = counts[0]
        try:
            fixed = tuple(
                self.attention.fixed_slots(g, num_rows, n) for g in range(self._num_groups)
            )
            step.group_slots = tuple(
                f.fill(slots) for f, slots in zip(fixed, step.group_slots, strict=True)
            )
        except BaseException:
            self._abort_open_step()
            raise
        step.fixed = fixed
        step.slots = step.group_slots[0]
        step.num_rows = num_rows
        step.num_tokens = num_rows * n  # every layer's input rows, padding included
        step.tokens_per_row = n
        step.query_lens = fixed[0].query_lens
        if plan_len is not None:
            step.plan_len = max(step.plan_len, plan_len)
        return view

    def step_slots(self, tx) -> TransactionSlots:
        """The metadata the open step's layers read (group 0): the cache's slots, or a
        fixed-shape step's fixed buffers (``pad_to`` rows; ``request_slots`` is what a CUDA
        graph over the step gathers per-request state with)."""
        return self._require_open_step(tx).slots

    def _all_group_slots(self, view: TokenTransactionView) -> tuple:
        """Every group's slots of a transaction."""
        cache = self.cache
        if self._num_groups == 1:  # begin_step's cost: no generator for the common case
            return (cache.steps.transaction_slots(view),)
        return tuple(cache.steps.transaction_slots(view, group=g) for g in range(self._num_groups))

    def step_layer(
        self, tx, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """RoPE + append + attention for one layer; any failure aborts the whole step.

        Returns the attention output of the rotated q over the cache including the new
        token(s): ``[rows, Hq, D]`` (decode) or ``[sum(num_tokens), Hq, D]`` (extend). After an
        automatic abort, outputs of earlier layers must be discarded.
        """
        step = self._require_open_step(tx)
        try:
            groups = self._layer_groups  # the layer's KV group, looked up inline (per layer)
            if type(layer_idx) is int and 0 <= layer_idx < self._num_layers:
                g = groups[layer_idx]
            else:
                g = self.cache.layout.layer_group(layer_idx)  # TypeError / ValueError
            if self._capturing is False and q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "step_layer is being captured in a CUDA graph outside capture_step: the "
                    "engine would count layers the graph has not run yet; use capture_step"
                )
            if step.kind != "decode":
                if step.kind != "extend":
                    raise RuntimeError(
                        f"step {step.transaction_id} is a prefill transaction; use prefill_layer"
                    )
                return self.attention.extend_layer(step, layer_idx, g, q, k, v)
            return self.attention.decode_layer(step, layer_idx, g, q, k, v)
        except BaseException:
            self._abort_open_step()
            raise

    def commit_step(self, tx, accept: Sequence[int] | None = None) -> StepResult:
        """Publish the step: request ``i``'s seq_len grows by ``accept[i]`` of its new tokens
        (None: all of them), once. The slots of rejected tokens get their old bytes back and
        blocks left without a committed token return to the pool. A bad ``accept`` raises and
        leaves the step open."""
        step = self._require_open_step(tx)
        # RuntimeError if layers are missing; TypeError / ValueError for a bad accept
        view = self.cache.commit_token(step.transaction_id, accept)
        self._open = None
        lens = step.seq_lens_after
        if accept is not None:
            lens = tuple(view.host_seq_lens.tolist())
        return StepResult(  # from host-side lengths: committing never waits for the GPU
            transaction_id=view.transaction_id,
            request_ids=step.request_ids,
            positions=step.positions,
            seq_lens=lens,
            num_layers=self._num_layers,
        )

    def abort_step(self, tx) -> None:
        """Abandon the step: the cache releases what begin took; seq_lens are unchanged."""
        self._require_open_step(tx)
        self._abort_open_step()

    @property
    def has_open_step(self) -> bool:
        return self._open is not None

    # ------------------------------------------------------------------ CUDA graphs
    def capture_step(self, tx, body: Callable[[], T], *, pool: Any = None) -> CapturedStep:
        """Capture ``body()`` — which runs ``step_layer`` for every layer of the open step, with
        whatever model code sits around it — in a CUDA graph, then replay it once so this step
        is really written. Kernels must be warm (run one eager step of the same shapes first).
        """
        step = self._require_capturable(tx)
        if self.decode_backend != "triton":
            raise RuntimeError("capture_step needs decode_backend='triton' (no host sync)")
        if self.append_backend == "torch":  # it writes the capture's live rows on every replay
            raise RuntimeError(
                "capture_step needs append_backend 'fused' or 'triton' (the torch append would "
                "replay the capture's row count, writing padding rows into the pool)"
            )
        if not step.slots.positions.is_cuda:
            raise RuntimeError("capture_step needs a CUDA cache")
        if self.cache.steps.layers_written(step.transaction_id):
            raise RuntimeError("capture_step needs a step with no layer written yet")
        # the captured kernels do not run until the replay: an abort before it must not
        # restore from backup rows they never wrote
        self.cache.steps.complete_backup(step.transaction_id)
        graph = torch.cuda.CUDAGraph()
        self._capturing = True
        try:
            with capture_cuda_graph(graph, pool):
                output = body()
            written = self.cache.steps.layers_written(step.transaction_id)
            if written != self.cache.num_layers:
                raise RuntimeError(
                    f"the captured body wrote {written} of "
                    f"{self.cache.num_layers} layers; it must run step_layer for every layer"
                )
        except BaseException:
            if self._open is step:
                self._abort_open_step()
            raise
        finally:
            self._capturing = False
        graph.replay()
        keep = (*step.decode, *step.extend, *step.fixed)
        return CapturedStep(
            self, graph, output, step.num_rows, step.generations, keep, step.tokens_per_row
        )

    def replay_step(self, tx, captured: CapturedStep) -> Any:
        """Write every layer of the open step by replaying ``captured``; returns its output."""
        step = self._require_capturable(tx)
        if not isinstance(captured, CapturedStep) or captured.engine is not self:
            raise TypeError("captured must be a CapturedStep of this engine")
        if not captured._fits(step):  # the open step is looked up once
            raise ValueError(
                f"captured step has {captured.num_rows} rows of {captured.tokens_per_row} "
                f"token(s) (buffers generation {captured.generation}); this step has "
                f"{step.num_rows} of {step.tokens_per_row} (generation "
                f"{step.slots.generation}): capture again"
            )
        self.cache.steps.write_all_layers_with(step.transaction_id, captured.graph.replay)
        return captured.output

    # ------------------------------------------------------------------ prompt import
    def begin_prefill(self, request_ids: Sequence, num_tokens: Sequence[int]):
        """Open a prompt import: ``num_tokens[i]`` slots for request ``i``, all layers, one
        transaction (``prefill_layer`` per layer, then ``commit_step`` or ``abort_step``)."""
        self._require_no_open_step("begin_prefill")
        rids = self._check_batch(request_ids, "prefill")
        view = self.cache.begin_tokens(list(rids), num_tokens)
        starts = [self.cache.seq_len(rid) for rid in rids]
        after = [s + n for s, n in zip(starts, num_tokens, strict=True)]
        self._open = OpenStep("prefill", view, self._all_group_slots(view), starts, after)
        return view

    def prefill_layer(self, tx, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's prompt ``k, v [sum(num_tokens), Hkv, D]`` (already rotated, as the
        cache keeps them; the layer's group's Hkv and D) in the reserved slots — a window group
        keeps only the rows its window needs; any failure aborts the whole import."""
        step = self._require_open_step(tx, "prefill")
        try:
            self.attention.import_layer(
                step, layer_idx, self.cache.layout.layer_group(layer_idx), k, v
            )
        except BaseException:
            self._abort_open_step()
            raise

    def prefill_request_layers(
        self,
        request_id: object,
        k_layers: torch.Tensor | Sequence[torch.Tensor],
        v_layers: torch.Tensor | Sequence[torch.Tensor],
    ) -> int:
        """Import caller-built prompt tokens for every layer, all or nothing.

        ``k_layers, v_layers``: ``[num_layers, Hkv, D]`` (one token) or
        ``[num_layers, T, Hkv, D]`` (T tokens) — or one tensor per layer, ``[Hkv, D]`` or
        ``[T, Hkv, D]`` in that layer's group's geometry (needed when the cache's KV layer
        groups differ in Hkv, head_dim or dtype). Returns the request's new seq_len.
        """
        self._require_no_open_step("prefill_request_layers")
        self._require_state(request_id, EngineRequestState.ACTIVE, "prefill")
        ks, vs = check_prompt_layers(self.cache, k_layers, v_layers, self._dtype)
        count = ks[0].shape[0]
        tx = self.begin_prefill([request_id], [count])
        for layer in range(self.cache.num_layers):
            self.prefill_layer(tx, layer, ks[layer], vs[layer])
        self.commit_step(tx)
        return self.cache.seq_len(request_id)

    # ------------------------------------------------------------------ prefixes
    def register_prefix(self, prefix_id, k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> None:
        """Register immutable shared-prefix blocks (before scheduler-managed submissions)."""
        self._require_no_open_step("register_prefix")
        live = any(spec is not None for spec in self._waiting.values()) or (
            self._mode == "scheduled" and self.cache.request_ids(RequestState.ACTIVE)
        )
        if live:
            raise RuntimeError(
                "register_prefix while scheduler-managed requests are waiting or active could "
                "evict a prefix they were planned with; register prefixes before submitting"
            )
        self.cache.register_prefix(prefix_id, k_blocks, v_blocks)

    def evict_prefix(self, prefix_id) -> None:
        """Evict an inactive prefix; only once every request of this engine is terminal."""
        self._require_no_open_step("evict_prefix")
        if self._waiting or self.cache.request_ids(RequestState.ACTIVE):
            raise RuntimeError(
                "evict_prefix needs every request to be finished, cancelled or rejected first"
            )
        self.cache.evict_prefix(prefix_id)

    # ------------------------------------------------------------------ internals
    def _require_state(self, request_id, state: EngineRequestState, action: str) -> None:
        current = self.request_state(request_id)
        if current is not state:
            raise RuntimeError(
                f"cannot {action} request {request_id!r}: it is {current.value}, "
                f"expected {state.value}"
            )

    def _require_no_open_step(self, action: str) -> None:
        if self._open is not None:
            raise RuntimeError(
                f"{action} is not allowed while step {self._open.transaction_id} is open; "
                "commit_step or abort_step first"
            )

    def _require_open_step(self, tx, kind: str | None = None) -> OpenStep:
        step = self._open
        tx_id = tx.transaction_id if isinstance(tx, TokenTransactionView) else tx
        if step is None or step.transaction_id != tx_id or type(tx_id) is not int:
            if isinstance(tx_id, bool) or not isinstance(tx_id, int):
                raise TypeError(
                    f"tx must be a step handle from begin_step, got {type(tx).__name__}"
                )
            # let the cache say whether it was committed, aborted or never existed
            self.cache.transaction_view(tx_id)
            raise RuntimeError(f"step {tx_id} is not this engine's open step")
        if kind is not None and step.kind != kind:
            raise RuntimeError(
                f"step {tx_id} is a {step.kind} transaction; this call needs a {kind} one"
            )
        return step

    def _require_capturable(self, tx) -> OpenStep:
        """The open step, when a CUDA graph can capture it: a decode step or a fixed-shape
        extend step (``begin_step(..., num_tokens=, pad_to=)``)."""
        step = self._require_open_step(tx)
        if not step.tokens_per_row:
            raise RuntimeError(
                f"step {step.transaction_id} is a {step.kind} transaction without fixed "
                "metadata; CUDA graphs need a decode step or a verification step begun with "
                "pad_to (every row the same number of tokens)"
            )
        return step

    def _abort_open_step(self) -> None:
        tx_id = self._open.transaction_id
        self._open = None
        self.cache.abort_token(tx_id)


def _check_batch_type(request_ids: object) -> None:
    if not isinstance(request_ids, (list, tuple)):
        raise TypeError(f"request_ids must be a list or tuple, got {type(request_ids).__name__}")
