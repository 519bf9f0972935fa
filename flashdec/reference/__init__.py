"""PyTorch references that define FlashDec's numbers (float32 math, no Triton): attention,
RoPE and FP8 KV quantisation."""

from flashdec.reference.attention import (
    dense_decode_attention_ref,
    paged_decode_attention_ref,
    paged_extend_attention_ref,
)
from flashdec.reference.quant import dequantize_fp8, quantize_fp8
from flashdec.reference.rope import apply_rope, apply_rope_inv_freq, rope_cos_sin, rope_inv_freq

__all__ = [
    "apply_rope",
    "apply_rope_inv_freq",
    "dense_decode_attention_ref",
    "dequantize_fp8",
    "paged_decode_attention_ref",
    "paged_extend_attention_ref",
    "quantize_fp8",
    "rope_cos_sin",
    "rope_inv_freq",
]
