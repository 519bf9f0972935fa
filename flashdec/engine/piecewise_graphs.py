"""Piecewise CUDA graphs of a mixed step: the dense work in graphs, attention eager between them.

A mixed step (decode rows plus prompt chunks, any split of its tokens among requests) has no
fixed shape for attention, but everything else in it - the embedding, the norms, the q/k/v,
o, gate/up and down projections, SiLU x up - depends only on the step's token count. Run
eagerly, those ~15 launches a layer cost far more host time than GPU time below about 1,024
tokens (``benchmarks/results/mixed_step.md``). So, as vLLM's piecewise capture does, each
token bucket gets ``num_layers + 1`` graphs: before layer 0's attention (embedding, input norm,
q/k/v), between two layers' attentions (o_proj, residual, MLP, the next layer's norm and
q/k/v) and after the last (o_proj, residual, MLP, final norm). Attention - RoPE, the append
into the paged cache and extend - runs eagerly in between, on the step's real token count,
through the engine as before: the cache, its transactions and the extend plans are untouched.

A step of ``T`` tokens pads to the smallest bucket ``>= T``: its ids go into the bucket's
fixed input buffer, attention sees the first ``T`` rows of the fixed q/k/v and writes its
output into the first ``T`` rows of the fixed attention buffer. Padding rows compute on stale
values that nothing reads (every dense op is row-wise). Every graph is captured at the warm
start, before the first request (largest bucket first, one memory pool for all); a step above
the largest bucket runs eagerly (at that size the GPU, not the host, bounds the step).

What outlives a piece - the ids, q/k/v, the residual stream and attention's output - lives in
one set of buffers sized for the largest bucket, which every bucket and every layer's piece
views (the GEMMs write into them): a piece's own result tensors would stay allocated for every
layer of every bucket (about 400 KiB per bucket token on Llama-3-8B, 3.8 GiB for the default
buckets). Only the pieces' temporaries, shared through the pool, and each bucket's final hidden
state are the graphs' own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from flashdec.engine.decode_graphs import WarmStart, held_device_memory
from flashdec.runtime import capture_cuda_graph

log = logging.getLogger(__name__)

# padding costs GPU time once the GEMMs are compute-bound (a few hundred tokens): finer steps
# there; above 1,024 tokens eager steps are GPU-bound already (mixed_step.md: 0-15% headroom)
TOKEN_BUCKETS = (
    *range(16, 128, 16),
    *range(128, 256, 32),
    *range(256, 1025, 64),
)


@dataclass(frozen=True)
class _SharedBuffers:
    """The fixed buffers every bucket views (sized for the largest)."""

    ids: torch.Tensor  # [rows] int64
    qkv: torch.Tensor  # [rows, (Hq + 2 Hkv) D]: the fused projection's output
    residual: torch.Tensor  # [rows, hidden]
    attention: torch.Tensor  # [rows, Hq, D]

    def rows(self, bucket: int) -> _SharedBuffers:
        # not dataclasses.astuple: it deep-copies the tensors
        return _SharedBuffers(*(getattr(self, f.name)[:bucket] for f in dataclasses.fields(self)))


@dataclass
class _BucketState:
    """One bucket's views of the shared buffers, and its graphs. ``outputs[i]`` is piece ``i``'s
    result: ``(q, k, v, residual)`` before layer ``i``'s attention, ``(hidden,)`` after the last
    layer."""

    buffers: _SharedBuffers
    outputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


class PiecewiseGraphs:
    """The piecewise graphs of one model, per token bucket up to ``max_tokens``.

    ``adapter`` is a :class:`flashdec.models.DecoderAdapter` (its ``begin_layers``,
    ``project_qkv`` and ``finish_layer`` are the pieces). :meth:`layers_forward` is a drop-in
    for the adapter's own (``DecoderAdapter.decode(..., layers=...)``). Without ``capture``
    (no CUDA: tests) the pieces run eagerly on the same padded buffers.
    """

    def __init__(self, adapter, *, max_tokens: int, capture: bool = True) -> None:
        self.adapter = adapter
        self.num_layers = adapter.num_layers
        # every bucket below the step budget and the first that holds it (a step never exceeds
        # the budget: larger buckets would be captured for nothing)
        fits = [b for b in TOKEN_BUCKETS if b >= max_tokens][:1]
        self.buckets = tuple(b for b in TOKEN_BUCKETS if b < max_tokens) + tuple(fits)
        self.capture = capture
        self._states: dict[int, _BucketState] = {}
        self._buffers: _SharedBuffers | None = None
        self.pool = None
        self.replays = 0  # steps that ran on the graphs
        self.warm_start: WarmStart | None = None

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens has a bucket (a captured one, with
        ``capture``)."""
        bucket = self._bucket(num_tokens)
        return bucket is not None and (not self.capture or bucket in self._states)

    def _bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def layers_forward(self, input_ids: torch.Tensor, attend) -> torch.Tensor:
        """The layers over ``input_ids [T]`` (``T`` within a bucket, see :meth:`fits`), attention
        by ``attend(layer, q, k, v)`` on the ``T`` real rows: ``[T, hidden]``, a view of the
        bucket's output buffer (valid until the next step)."""
        num_tokens = input_ids.shape[0]
        bucket = self._bucket(num_tokens)
        if bucket is None:
            raise ValueError(
                f"a step of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}"
            )
        state = self._states.get(bucket)
        if state is None:
            if self.capture:
                raise ValueError(f"no graphs were captured for a {bucket}-token step")
            state = self._states[bucket] = self._new_state(bucket, input_ids.device)
        buffers = state.buffers
        buffers.ids[:num_tokens].copy_(input_ids)
        self._run_piece(state, 0)
        for layer in range(self.num_layers):
            q, k, v, _ = state.outputs[layer]
            out = attend(layer, q[:num_tokens], k[:num_tokens], v[:num_tokens])
            buffers.attention[:num_tokens].copy_(out)
            self._run_piece(state, layer + 1)
        if self.capture:
            self.replays += 1
        return state.outputs[self.num_layers][0][:num_tokens]

    def _run_piece(self, state: _BucketState, index: int) -> None:
        if self.capture:
            state.graphs[index].replay()
        else:
            state.outputs[index] = self._piece(state, index)

    def _piece(self, state: _BucketState, index: int) -> tuple[torch.Tensor, ...]:
        """Piece ``index``'s dense work on ``state``'s buffers (what graph ``index`` captures)."""
        adapter, buffers = self.adapter, state.buffers
        if index == 0:
            x, residual = adapter.begin_layers(buffers.ids, out=buffers.residual)
        else:
            residual = state.outputs[index - 1][-1]
            x, residual = adapter.finish_layer(index - 1, buffers.attention, residual)
            if index == self.num_layers:
                return (x,)
        return (*adapter.project_qkv(index, x, out=buffers.qkv), residual)

    def _new_state(self, bucket: int, device: torch.device) -> _BucketState:
        if self._buffers is None:
            spec, rows = self.adapter.spec, self.buckets[-1]
            hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
            self._buffers = _SharedBuffers(
                ids=torch.zeros(rows, dtype=torch.long, device=device),
                qkv=torch.zeros((rows, (hq + 2 * hkv) * d), dtype=spec.dtype, device=device),
                residual=torch.zeros((rows, spec.hidden_size), dtype=spec.dtype, device=device),
                attention=torch.zeros((rows, hq, d), dtype=spec.dtype, device=device),
            )
        state = _BucketState(self._buffers.rows(bucket))
        state.outputs = [()] * (self.num_layers + 1)
        return state

    def capture_all(self) -> WarmStart:
        """Capture every bucket's graphs (largest first, one pool), each bucket's kernels run
        once eagerly before its capture. Nothing touches the cache."""
        start = time.perf_counter()
        held = held_device_memory()
        device = self.adapter.spec.device
        self._states = {}
        self.pool = torch.cuda.graph_pool_handle()
        log.info(
            "warm start: capturing the mixed steps' piecewise graphs of %d token buckets up to %d",
            len(self.buckets),
            self.buckets[-1],
        )
        with torch.no_grad():
            for bucket in reversed(self.buckets):
                state = self._new_state(bucket, device)
                for index in range(self.num_layers + 1):  # compiles, picks cuBLAS kernels
                    state.outputs[index] = self._piece(state, index)
                torch.cuda.synchronize()
                for index in range(self.num_layers + 1):
                    graph = torch.cuda.CUDAGraph()
                    with capture_cuda_graph(graph, self.pool):
                        state.outputs[index] = self._piece(state, index)
                    state.graphs.append(graph)
                self._states[bucket] = state
        torch.cuda.synchronize()
        self.warm_start = WarmStart(
            len(self.buckets) * (self.num_layers + 1),
            self.buckets,
            time.perf_counter() - start,
            held_device_memory() - held,
        )
        log.info(
            "warm start: %d piecewise graphs in %.1f s, holding %.2f GiB",
            self.warm_start.graphs,
            self.warm_start.seconds,
            self.warm_start.memory_bytes / 2**30,
        )
        return self.warm_start
