"""Decode plans for every batch size vLLM may run, over one set of fixed-address buffers.

vLLM captures one CUDA graph per padded decode batch size and replays it with new lengths, so a
decode call must allocate nothing, never read lengths back, and keep its buffer addresses for
the engine's lifetime. :class:`DecodeWorkspacePool` therefore plans every batch size
``1..max_batch`` up front and gives each plan a :class:`flashdec.DecodeWorkspace` whose buffers
are views of three shared arenas (float32 split partials; output rows in the model dtype; the
int32 arrival counters of the in-kernel split merge, which every launch leaves zero), sized for
the largest plan. Sharing is safe because all layers and all graphs run on one stream, in order
(vLLM's dual-batch overlap, which breaks that, is a fallback case of the backend).

The split choice. vLLM captures with dummy lengths and replays with real ones, so a plan cannot
be sized from the batch's lengths. The kernel cuts each request into ``ceil(len /
tokens_per_split)`` splits at run time (capped by the plan's split count), so the one fixed
choice is ``tokens_per_split``: it comes from :func:`flashdec.plan_decode`'s heuristic for a
batch of ``nominal_seq_len``-token requests. Batches that need no split at that length (enough
(request, KV head) programs for the GPU) keep a single pass at every length. Split plans get
enough splits to cover ``max_seq_len`` (vLLM's ``max_model_len``), within ``MAX_SPLITS`` and a
memory budget for the partials; a request longer than that is still exact, its last split just
takes the excess.
"""

from __future__ import annotations

import math

import torch

from flashdec._checks import FLOAT_DTYPES, check_positive_int
from flashdec.kernels import DecodePlan, DecodeWorkspace, plan_decode
from flashdec.kernels.decode_plan import MAX_SPLITS

# Lengths the split heuristic plans for when nothing better is known (capped at max_seq_len).
DEFAULT_NOMINAL_SEQ_LEN = 2048
# Cap on one plan's split partials (float32 output + log-sum-exp per split); the pool holds one
# arena of the largest plan's size.
DEFAULT_MAX_PARTIAL_BYTES = 128 * 2**20


def plan_for_batch(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    max_seq_len: int,
    nominal_seq_len: int = DEFAULT_NOMINAL_SEQ_LEN,
    max_partial_bytes: int = DEFAULT_MAX_PARTIAL_BYTES,
) -> DecodePlan:
    """The length-independent plan of one decode batch size (see the module docstring)."""
    check_positive_int("max_seq_len", max_seq_len)
    check_positive_int("nominal_seq_len", nominal_seq_len)
    check_positive_int("max_partial_bytes", max_partial_bytes)
    nominal = min(nominal_seq_len, max_seq_len)
    base = plan_decode(
        batch, num_q_heads, num_kv_heads, head_dim, block_size, nominal, dtype, device
    )
    if not base.uses_split:
        return base  # a single pass per (request, KV head) serves every length
    per_split = base.tokens_per_split
    bytes_per_split = batch * num_q_heads * (head_dim + 1) * 4
    splits = min(
        math.ceil(max_seq_len / per_split),
        MAX_SPLITS,
        max(1, max_partial_bytes // bytes_per_split),
    )
    splits = max(splits, base.num_splits)
    return plan_decode(
        batch,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_seq_len,
        dtype,
        device,
        # programs for the nominal batch; longer requests loop over more work items
        total_tokens=batch * nominal,
        num_splits=splits,
        tokens_per_split=per_split,
        block_n=base.block_n,
        num_warps=base.num_warps,
        num_stages=base.num_stages,
    )


class DecodeWorkspacePool:
    """One capturable :class:`DecodeWorkspace` per batch size ``1..max_batch``, sharing buffers.

    All sizes are planned at construction, so the buffers never move afterwards.
    """

    def __init__(
        self,
        *,
        max_batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_seq_len: int,
        nominal_seq_len: int = DEFAULT_NOMINAL_SEQ_LEN,
        max_partial_bytes: int = DEFAULT_MAX_PARTIAL_BYTES,
    ) -> None:
        check_positive_int("max_batch", max_batch)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
        device = torch.device(device)
        plans = [
            plan_for_batch(
                batch,
                num_q_heads,
                num_kv_heads,
                head_dim,
                block_size,
                dtype,
                device,
                max_seq_len=max_seq_len,
                nominal_seq_len=nominal_seq_len,
                max_partial_bytes=max_partial_bytes,
            )
            for batch in range(1, max_batch + 1)
        ]
        device = plans[0].device  # plan_decode resolves "cuda" to the current device
        hq, d = num_q_heads, head_dim
        partial_numel = max(p.batch * hq * p.num_splits * (d + 1) for p in plans)
        self._partials = torch.empty(partial_numel, dtype=torch.float32, device=device)
        self._outs = torch.empty(max_batch * hq * d, dtype=dtype, device=device)
        self._counters = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)
        self._workspaces = tuple(self._workspace_of(p) for p in plans)
        self.max_batch = max_batch
        self.device = device

    def _workspace_of(self, plan: DecodePlan) -> DecodeWorkspace:
        b, hq, s, d = plan.batch, plan.num_q_heads, plan.num_splits, plan.head_dim
        hkv = plan.num_kv_heads
        out_numel = b * hq * s * d
        return DecodeWorkspace(
            plan=plan,
            partial_out=self._partials[:out_numel].view(b, hq, s, d),
            partial_lse=self._partials[out_numel : out_numel + b * hq * s].view(b, hq, s),
            out=self._outs[: b * hq * d].view(b, hq, d),
            counters=self._counters[: b * hkv].view(b, hkv),
        )

    @property
    def nbytes(self) -> int:
        """Device bytes of the shared buffers."""
        buffers = (self._partials, self._outs, self._counters)
        return sum(t.numel() * t.element_size() for t in buffers)

    def workspace(self, batch: int) -> DecodeWorkspace:
        """The workspace planned for exactly ``batch`` requests."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch must be in 1..{self.max_batch}, got {batch}")
        return self._workspaces[batch - 1]

    def plan(self, batch: int) -> DecodePlan:
        return self.workspace(batch).plan
