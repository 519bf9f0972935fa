"""PyTorch references that define FlashDec's numbers (float32 math, no Triton)."""

from flashdec.reference.attention import dense_decode_attention_ref, paged_decode_attention_ref
from flashdec.reference.rope import apply_rope, apply_rope_inv_freq, rope_cos_sin, rope_inv_freq

__all__ = [
    "apply_rope",
    "apply_rope_inv_freq",
    "dense_decode_attention_ref",
    "paged_decode_attention_ref",
    "rope_cos_sin",
    "rope_inv_freq",
]
