"""Decode backends the engine can run a layer's attention with.

``torch`` gathers the live tokens of every request into a dense tensor and runs the dense
reference math (vectorised, any device); ``triton`` is :func:`flashdec.decode` with a workspace
planned once per step and reused by every layer, so a step allocates nothing per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdec.reference import dense_decode_attention_ref

DECODE_BACKENDS = ("torch", "triton")
APPEND_BACKENDS = ("torch", "triton", "fused")


def check_backend(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value  # type: ignore[return-value]


def torch_paged_decode(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Gather the first ``max_seq_len`` tokens of each request, then dense masked attention."""
    batch = q.shape[0]
    block_size = k_layer.shape[2]
    num_blocks = max(1, -(-max_seq_len // block_size))
    ids = block_tables[:, :num_blocks].long()  # [B, nb]
    num_kv_heads, head_dim = k_layer.shape[1], k_layer.shape[3]
    dense_shape = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    k = k_layer[ids].transpose(2, 3).reshape(dense_shape)  # [B, nb, Hkv, bs, D] -> [B, L, Hkv, D]
    v = v_layer[ids].transpose(2, 3).reshape(dense_shape)
    return dense_decode_attention_ref(q, k, v, seq_lens, sm_scale)


@dataclass
class TritonDecodeState:
    """A decode plan and its workspace for one batch layout, shared by every layer of a step.

    Steps reuse it while the batch shape is unchanged and the longest request is still within the
    plan's length (and not under half of it, so the split count stays sensible as lengths grow).
    """

    plan: object
    workspace: object
    q_shape: tuple[int, int, int]

    def fits(self, q_shape: tuple[int, int, int], max_seq_len: int) -> bool:
        planned = self.plan.max_seq_len
        return q_shape == self.q_shape and planned // 2 < max_seq_len <= planned

    @classmethod
    def build(
        cls,
        q_shape,
        num_kv_heads,
        block_size,
        max_seq_len,
        total_tokens,
        dtype,
        device,
        max_blocks_per_seq,
    ) -> TritonDecodeState:
        from flashdec.kernels import DecodeWorkspace, plan_decode

        batch, num_q_heads, head_dim = q_shape
        # round the planned length up to a power of two: one plan serves many steps
        planned_len = 1 << max(0, (max_seq_len - 1).bit_length())
        planned_len = min(planned_len, max_blocks_per_seq * block_size)
        plan = plan_decode(
            batch,
            num_q_heads,
            num_kv_heads,
            head_dim,
            block_size,
            max(planned_len, max_seq_len),
            dtype,
            device,
            max_blocks_per_seq=max_blocks_per_seq,
            total_tokens=total_tokens,
        )
        return cls(plan=plan, workspace=DecodeWorkspace.allocate(plan), q_shape=tuple(q_shape))
