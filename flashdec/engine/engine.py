"""DecodeEngine: orchestrates the scheduler's decisions, the cache's transactions and the kernels.

The engine owns no block and no length: :class:`~flashdec.cache.PagedKVCache` stays the single
source of truth. The engine adds the request states that exist before and beside the cache
(waiting, rejected), the open multi-layer step, and the per-step decode plan.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from flashdec._checks import FLOAT_DTYPES, check_tensor, resolve_sm_scale, same_device
from flashdec.cache import PagedKVCache
from flashdec.engine.backends import (
    APPEND_BACKENDS,
    DECODE_BACKENDS,
    TritonDecodeState,
    check_backend,
    torch_paged_decode,
)
from flashdec.reference.rope import check_rotary_dim
from flashdec.scheduler import (
    BlockAwareScheduler,
    RequestSpec,
    SchedulerDecision,
    SchedulingSnapshot,
    counters_of,
    snapshot_from_cache,
)


class EngineRequestState(enum.StrEnum):
    """Where a request is from the engine's point of view (a superset of the cache's states)."""

    WAITING = "waiting"  # known to the engine, not yet in the cache
    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # the scheduler decided it can never fit

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StepResult:
    """What a committed step published: one token for every listed request, all layers."""

    transaction_id: int
    request_ids: tuple
    positions: tuple[int, ...]  # where the token was written (= pre-step seq_len)
    seq_lens: tuple[int, ...]  # committed lengths after the step
    num_layers: int


@dataclass
class _OpenStep:
    """Engine-side state of the one open step (the cache keeps the transaction itself)."""

    transaction_id: int
    request_ids: tuple
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] incl. the reserved slot
    seq_lens_after: torch.Tensor  # [B] pre-step lengths + 1: decode sees the new token
    positions: tuple[int, ...]  # pre-step lengths, known on the host
    max_seq_len_after: int
    total_tokens_after: int
    next_layer: int = 0
    num_q_heads: int | None = None
    decode_state: TritonDecodeState | None = None


class DecodeEngine:
    """Runs decode steps for a batch of requests over one :class:`PagedKVCache`.

    Args:
        cache: the cache this engine drives (its only source of block and length truth).
        append_backend: ``"torch"``, ``"triton"`` or ``"fused"`` (one fused RoPE + append kernel).
        decode_backend: ``"torch"`` (gather + dense math) or ``"triton"`` (:func:`flashdec.decode`).
        rotary_dim: dims rotated by RoPE; ``None`` rotates the whole head.
        rope_base: RoPE frequency base.
        sm_scale: softmax scale; ``None`` = ``head_dim ** -0.5``.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        append_backend: str = "fused",
        decode_backend: str = "triton",
        rotary_dim: int | None = None,
        rope_base: float = 10000.0,
        sm_scale: float | None = None,
    ) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        self.cache = cache
        self.append_backend = check_backend("append_backend", append_backend, APPEND_BACKENDS)
        self.decode_backend = check_backend("decode_backend", decode_backend, DECODE_BACKENDS)
        self.rotary_dim = check_rotary_dim(rotary_dim, cache.head_dim)
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)) or rope_base <= 1:
            raise ValueError(f"rope_base must be a float > 1, got {rope_base!r}")
        self.rope_base = float(rope_base)
        self.sm_scale = resolve_sm_scale(sm_scale, cache.head_dim)
        self._states: dict[object, EngineRequestState] = {}
        self._open: _OpenStep | None = None
        self._decode_state: TritonDecodeState | None = None  # reused while the layout holds
        self._scheduled = _ScheduledRequests()

    # ------------------------------------------------------------------ lifecycle (unscheduled)
    def add_request(self, request_id: object) -> None:
        """Register a waiting request (not yet in the cache)."""
        self._require_no_open_step("add_request")
        self._check_new_id(request_id)
        if self._scheduled.specs:
            raise RuntimeError(
                "add_request is the unscheduled lifecycle; this engine already runs "
                "scheduler-managed requests (use submit_request)"
            )
        self._states[request_id] = EngineRequestState.WAITING

    def admit(self, request_id: object) -> None:
        """Make a waiting request active in the cache (empty, seq_len 0)."""
        self._require_no_open_step("admit")
        if self.request_state(request_id) is not EngineRequestState.WAITING:
            raise RuntimeError(
                f"request {request_id!r} is {self._states[request_id].value}; only a waiting "
                "request can be admitted"
            )
        if request_id in self._scheduled.specs:
            raise RuntimeError(
                f"request {request_id!r} is scheduler-managed; it is admitted by "
                "apply_scheduler_decision"
            )
        self.cache.add_request(request_id)
        self._states[request_id] = EngineRequestState.ACTIVE

    def finish_request(self, request_id: object) -> None:
        """Finish an active request: the cache releases its private blocks."""
        self._require_no_open_step("finish_request")
        self._require_state(request_id, EngineRequestState.ACTIVE, "finish")
        self.cache.finish_request(request_id)
        self._states[request_id] = EngineRequestState.FINISHED

    def cancel_request(self, request_id: object) -> None:
        """Cancel a waiting or active request."""
        self._require_no_open_step("cancel_request")
        state = self.request_state(request_id)
        if state is EngineRequestState.ACTIVE:
            self.cache.cancel_request(request_id)
        elif state is not EngineRequestState.WAITING:
            raise RuntimeError(
                f"request {request_id!r} is {state.value}; only waiting or active requests "
                "can be cancelled"
            )
        self._states[request_id] = EngineRequestState.CANCELLED
        self._scheduled.forget_waiting(request_id)

    def request_state(self, request_id: object) -> EngineRequestState:
        _check_id(request_id)
        try:
            return self._states[request_id]
        except KeyError:
            raise ValueError(f"unknown request id {request_id!r}") from None

    def request_ids(self, state: EngineRequestState | None = None) -> list:
        return [rid for rid, s in self._states.items() if state is None or s is state]

    # ------------------------------------------------------------------ scheduler-managed lifecycle
    def submit_request(self, spec: RequestSpec) -> None:
        """Queue a scheduler-managed request; the scheduler admits or rejects it later.

        A request with a prefix needs that prefix resident now, covering its whole context.
        """
        self._require_no_open_step("submit_request")
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(spec).__name__}")
        self._check_new_id(spec.request_id)
        if any(rid not in self._scheduled.specs for rid in self._states):
            raise RuntimeError(
                "submit_request is the scheduler-managed lifecycle; this engine already runs "
                "unscheduled requests (add_request/admit)"
            )
        if spec.prefix_id is not None:
            if spec.prefix_id not in self.cache.prefix_ids():
                raise ValueError(
                    f"prefix {spec.prefix_id!r} must be registered before requests use it"
                )
            num_tokens = self.cache.prefix_state(spec.prefix_id).num_tokens
            if spec.initial_context_tokens != num_tokens:
                raise ValueError(
                    f"a prefix request's context must be its prefix: prefix {spec.prefix_id!r} "
                    f"holds {num_tokens} tokens, spec says {spec.initial_context_tokens}"
                )
        if any(s.submission_order == spec.submission_order for s in self._scheduled.specs.values()):
            raise ValueError(f"submission_order {spec.submission_order} is already used")
        self._scheduled.specs[spec.request_id] = spec
        self._scheduled.waiting.append(spec.request_id)
        self._states[spec.request_id] = EngineRequestState.WAITING

    def request_spec(self, request_id: object) -> RequestSpec:
        self.request_state(request_id)
        try:
            return self._scheduled.specs[request_id]
        except KeyError:
            raise ValueError(f"request {request_id!r} is not scheduler-managed") from None

    def scheduling_snapshot(
        self,
        step: int,
        waiting_wait_steps: Mapping | None = None,
        waiting_skip_counts: Mapping | None = None,
        active_service_wait_steps: Mapping | None = None,
    ) -> SchedulingSnapshot:
        """K/V-free metadata for the scheduler, read from the live cache (counters default 0)."""
        self._require_no_open_step("scheduling_snapshot")
        specs = self._scheduled.specs
        return snapshot_from_cache(
            self.cache,
            step=step,
            specs=specs,
            waiting_ids=list(self._scheduled.waiting),
            active_ids=[rid for rid in specs if self._states[rid] is EngineRequestState.ACTIVE],
            waiting_wait_steps=waiting_wait_steps,
            waiting_skip_counts=waiting_skip_counts,
            active_service_wait_steps=active_service_wait_steps,
        )

    def apply_scheduler_decision(
        self,
        decision: SchedulerDecision,
        *,
        scheduler: BlockAwareScheduler,
        snapshot: SchedulingSnapshot,
    ) -> SchedulerDecision:
        """Admit and reject what ``decision`` says, after proving it is current and canonical.

        The snapshot is rebuilt from the live engine (keeping the caller's fairness counters) and
        the canonical lifetime policy ``BlockAwareScheduler(scheduler.config)`` is re-run on it;
        the decision must equal that result exactly. Anything else — a stale snapshot, a decision
        from another snapshot or config, an edited or non-canonical decision — is rejected before
        any request is admitted or rejected. Returns the applied decision.
        """
        self._require_no_open_step("apply_scheduler_decision")
        if not isinstance(decision, SchedulerDecision):
            raise TypeError(f"decision must be a SchedulerDecision, got {type(decision).__name__}")
        if not isinstance(scheduler, BlockAwareScheduler):
            raise TypeError(
                f"scheduler must be a BlockAwareScheduler, got {type(scheduler).__name__}"
            )
        if not isinstance(snapshot, SchedulingSnapshot):
            raise TypeError(f"snapshot must be a SchedulingSnapshot, got {type(snapshot).__name__}")
        if decision.snapshot != snapshot:
            raise ValueError("decision was not planned from the given snapshot")
        if decision.config != scheduler.config:
            raise ValueError(
                f"decision was planned with {decision.config}, the scheduler has {scheduler.config}"
            )
        live = self.scheduling_snapshot(snapshot.step, **counters_of(snapshot).as_kwargs())
        if live != snapshot:
            raise RuntimeError(
                "stale scheduler decision: the engine changed since the snapshot was taken "
                f"(cache version {snapshot.cache_version} -> {live.cache_version})"
            )
        canonical = BlockAwareScheduler(scheduler.config).plan(live)
        if canonical != decision:
            raise ValueError(
                "decision is not the canonical lifetime-policy decision for this snapshot "
                f"(expected admit={canonical.admit}, reject={canonical.reject}, "
                f"batch={canonical.batch}; got admit={decision.admit}, "
                f"reject={decision.reject}, batch={decision.batch})"
            )
        for rid in decision.admit:
            spec = self._scheduled.specs[rid]
            self.cache.add_request(rid)
            if spec.prefix_id is not None:
                self.cache.attach_prefix(rid, spec.prefix_id)
            self._scheduled.forget_waiting(rid)
            self._states[rid] = EngineRequestState.ACTIVE
        for rid in decision.reject:
            self._scheduled.forget_waiting(rid)
            self._states[rid] = EngineRequestState.REJECTED
        return decision

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
    def begin_step(self, request_ids: Sequence):
        """Open a step: the cache reserves one slot per request (all-or-nothing)."""
        self._require_no_open_step("begin_step")
        rids = tuple(request_ids) if isinstance(request_ids, (list, tuple)) else None
        if rids is None:
            raise TypeError(
                f"request_ids must be a list or tuple, got {type(request_ids).__name__}"
            )
        states, active = self._states, EngineRequestState.ACTIVE
        for rid in rids:  # fast path first; the slow check explains what is wrong
            if type(rid) not in (str, int) or states.get(rid) is not active:
                self._require_state(rid, active, "step")
        view = self.cache.begin_token(list(rids))
        block_tables, seq_lens_after = self.cache.transaction_decode_inputs(view)
        lens = [self.cache.seq_len(rid) for rid in rids]  # host-side: no device sync
        self._open = _OpenStep(
            transaction_id=view.transaction_id,
            request_ids=rids,
            block_tables=block_tables,
            seq_lens_after=seq_lens_after,
            positions=tuple(lens),
            max_seq_len_after=max(lens) + 1,
            total_tokens_after=sum(lens) + len(lens),
        )
        return view

    def step_layer(
        self, tx, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """RoPE + append + decode for one layer; any failure aborts the whole token.

        Returns the attention output ``[B, Hq, D]`` of the rotated q over the cache including the
        new token. After an automatic abort, outputs of earlier layers must be discarded.
        """
        step = self._require_open_step(tx)
        try:
            q = self._check_layer_inputs(step, layer_idx, q)
            q_rot = self.cache.write_token_layer_rope(
                tx,
                layer_idx,
                q,
                k,
                v,
                rotary_dim=self.rotary_dim,
                base=self.rope_base,
                append_backend=self.append_backend,
            )
            out = self._decode_layer(step, layer_idx, q_rot)
        except BaseException:
            self._abort_open_step()
            raise
        step.next_layer = layer_idx + 1
        return out

    def commit_step(self, tx) -> StepResult:
        """Publish the step: every request's seq_len grows by one, once."""
        step = self._require_open_step(tx)
        if step.next_layer != self.cache.num_layers:
            raise RuntimeError(
                f"step has {step.next_layer} of {self.cache.num_layers} layers written; "
                "commit needs all of them"
            )
        view = self.cache.commit_token(tx)
        self._open = None
        return StepResult(  # from host-side lengths: committing never waits for the GPU
            transaction_id=view.transaction_id,
            request_ids=step.request_ids,
            positions=step.positions,
            seq_lens=tuple(p + 1 for p in step.positions),
            num_layers=self.cache.num_layers,
        )

    def abort_step(self, tx) -> None:
        """Abandon the step: the cache releases what begin_step took; seq_lens are unchanged."""
        self._require_open_step(tx)
        self._abort_open_step()

    @property
    def has_open_step(self) -> bool:
        return self._open is not None

    # ------------------------------------------------------------------ prompt import, prefixes
    def prefill_request_layers(
        self, request_id: object, k_layers: torch.Tensor, v_layers: torch.Tensor
    ) -> int:
        """Import one caller-built prompt token for every layer (``[num_layers, Hkv, D]``).

        All or nothing: the token is committed once every layer is written, else rolled back.
        Returns the request's new seq_len.
        """
        self._require_no_open_step("prefill_request_layers")
        self._require_state(request_id, EngineRequestState.ACTIVE, "prefill")
        cache = self.cache
        expected = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
        for name, t in (("k_layers", k_layers), ("v_layers", v_layers)):
            check_tensor(name, t, ndim=3, dtypes=(cache.dtype,), device=cache.device)
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        tx = cache.begin_token([request_id])
        try:
            for layer in range(cache.num_layers):
                cache.write_token_layer(
                    tx,
                    layer,
                    k_layers[layer].unsqueeze(0),
                    v_layers[layer].unsqueeze(0),
                    append_backend="torch" if self.append_backend == "torch" else "triton",
                )
            cache.commit_token(tx)
        except BaseException:
            cache.abort_token(tx)
            raise
        return cache.seq_len(request_id)

    def register_prefix(self, prefix_id, k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> None:
        """Register immutable shared-prefix blocks (before scheduler-managed submissions)."""
        self._require_no_open_step("register_prefix")
        if self._scheduled.has_live_requests(self._states):
            raise RuntimeError(
                "register_prefix while scheduler-managed requests are waiting or active could "
                "evict a prefix they were planned with; register prefixes before submitting"
            )
        self.cache.register_prefix(prefix_id, k_blocks, v_blocks)

    def evict_prefix(self, prefix_id) -> None:
        """Evict an inactive prefix; only once every request of this engine is terminal."""
        self._require_no_open_step("evict_prefix")
        live = (EngineRequestState.WAITING, EngineRequestState.ACTIVE)
        if any(state in live for state in self._states.values()):
            raise RuntimeError(
                "evict_prefix needs every request to be finished, cancelled or rejected first"
            )
        self.cache.evict_prefix(prefix_id)

    # ------------------------------------------------------------------ internals
    def _check_new_id(self, request_id: object) -> None:
        _check_id(request_id)
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} already exists (ids are not reused)")
        try:
            self.cache.request_state(request_id)
        except ValueError:
            return
        raise ValueError(f"request id {request_id!r} already exists in the cache")

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

    def _require_open_step(self, tx) -> _OpenStep:
        tx_id = getattr(tx, "transaction_id", tx)
        if isinstance(tx_id, bool) or not isinstance(tx_id, int):
            raise TypeError(f"tx must be a step handle from begin_step, got {type(tx).__name__}")
        if self._open is None or self._open.transaction_id != tx_id:
            # let the cache say whether it was committed, aborted or never existed
            self.cache.transaction_view(tx_id)
            raise RuntimeError(f"step {tx_id} is not this engine's open step")
        return self._open

    def _abort_open_step(self) -> None:
        tx_id = self._open.transaction_id
        self._open = None
        self.cache.abort_token(tx_id)

    def _check_layer_inputs(self, step: _OpenStep, layer_idx: int, q: torch.Tensor):
        cache = self.cache
        check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
        if q.dtype != cache.dtype or not same_device(q.device, cache.device):
            raise TypeError(
                f"q must be {cache.dtype} on {cache.device}, got {q.dtype} on {q.device}"
            )
        batch, num_q_heads, head_dim = q.shape
        if batch != len(step.request_ids) or head_dim != cache.head_dim:
            raise ValueError(
                f"q must be [batch={len(step.request_ids)}, num_q_heads, {cache.head_dim}], "
                f"got {tuple(q.shape)}"
            )
        if num_q_heads % cache.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                f"({cache.num_kv_heads})"
            )
        if step.num_q_heads is not None and num_q_heads != step.num_q_heads:
            raise ValueError(
                f"q has {num_q_heads} heads but earlier layers of this step had {step.num_q_heads}"
            )
        step.num_q_heads = num_q_heads
        return q

    def _decode_layer(self, step: _OpenStep, layer_idx: int, q_rot: torch.Tensor) -> torch.Tensor:
        k_layer, v_layer = self.cache.layer_kv(layer_idx)
        if self.decode_backend == "torch":
            return torch_paged_decode(
                q_rot,
                k_layer,
                v_layer,
                step.block_tables,
                step.seq_lens_after,
                step.max_seq_len_after,
                self.sm_scale,
            )
        from flashdec.kernels import launch_decode

        if step.decode_state is None:
            step.decode_state = self._triton_state(q_rot.shape, step)
        workspace = step.decode_state.workspace
        # trusted launch: q was checked above, the layer views, tables and lengths are the
        # cache's own, and the plan was built for exactly this batch shape
        return launch_decode(
            q_rot,
            k_layer,
            v_layer,
            step.block_tables,
            step.seq_lens_after,
            self.sm_scale,
            workspace.plan,
            torch.empty_like(q_rot),  # each layer's output outlives the shared workspace
            workspace.partial_out,
            workspace.partial_lse,
            q_rot.shape[0],
        )

    def _triton_state(self, q_shape, step: _OpenStep) -> TritonDecodeState:
        """The decode plan + workspace for this step, reused while the layout still fits."""
        cache = self.cache
        state = self._decode_state
        if state is None or not state.fits(tuple(q_shape), step.max_seq_len_after):
            state = TritonDecodeState.build(
                tuple(q_shape),
                cache.num_kv_heads,
                cache.block_size,
                step.max_seq_len_after,
                step.total_tokens_after,
                cache.dtype,
                cache.device,
                cache.max_blocks_per_seq,
            )
            self._decode_state = state
        return state


def _check_id(request_id: object) -> None:
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise TypeError(f"request id must be a str or int, got {type(request_id).__name__}")


class _ScheduledRequests:
    """Bookkeeping of scheduler-managed requests (specs and the waiting queue)."""

    def __init__(self) -> None:
        self.specs: dict = {}
        self.waiting: list = []  # in submission order

    def forget_waiting(self, request_id) -> None:
        if request_id in self.waiting:
            self.waiting.remove(request_id)

    def has_live_requests(self, states: dict) -> bool:
        live = (EngineRequestState.WAITING, EngineRequestState.ACTIVE)
        return any(states[rid] in live for rid in self.specs)
