"""Triton kernels: paged decode and extend attention (split-KV) and (fused RoPE +) KV append."""

from flashdec.kernels._runtime import triton_runs_on
from flashdec.kernels.append import (
    BoundFusedRopeKVAppend,
    fused_rope_kv_append,
    kv_append,
    launch_fused_rope_kv_append,
    launch_kv_append,
)
from flashdec.kernels.decode_plan import DecodePlan, DecodeWorkspace, KernelConfig, plan_decode
from flashdec.kernels.extend_plan import ExtendPlan, ExtendWorkspace, plan_extend
from flashdec.kernels.layer_attention import BoundLayerAttention
from flashdec.kernels.paged_decode import (
    BoundDecode,
    decode,
    launch_decode,
    paged_decode_attention,
)
from flashdec.kernels.paged_extend import (
    BoundExtend,
    extend,
    launch_extend,
    paged_extend_attention,
)
from flashdec.kernels.validation import clear_validation_cache

__all__ = [
    "BoundDecode",
    "BoundExtend",
    "BoundFusedRopeKVAppend",
    "BoundLayerAttention",
    "DecodePlan",
    "DecodeWorkspace",
    "ExtendPlan",
    "ExtendWorkspace",
    "KernelConfig",
    "clear_validation_cache",
    "decode",
    "extend",
    "fused_rope_kv_append",
    "kv_append",
    "launch_decode",
    "launch_extend",
    "launch_fused_rope_kv_append",
    "launch_kv_append",
    "paged_decode_attention",
    "paged_extend_attention",
    "plan_decode",
    "plan_extend",
    "triton_runs_on",
]
