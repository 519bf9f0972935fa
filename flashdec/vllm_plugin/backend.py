"""vLLM 0.24.0 ``CUSTOM`` attention backend: FlashAttention's layout, metadata and K/V writes,
FlashDec's paged decode for pure single-token decode batches.

Imported by vLLM only (through the class path :func:`flashdec.vllm_plugin.register` registers);
it imports vLLM at module level. What is reused from vLLM's FlashAttention backend unchanged:
the KV cache shape and stride order, the metadata builder (``query_start_loc``, ``seq_lens``,
``block_table``, ``max_query_len``), the K/V write (``reshape_and_cache_flash`` in
``do_kv_cache_update``), prefill, mixed batches and every unsupported case (the parent's
``forward``). What FlashDec does: a batch whose every request has query length 1 is attended by
``flashdec.decode`` on strided views of vLLM's cache, with a workspace planned for the batch size
(no allocation, no host sync), so vLLM's full CUDA graphs of decode batches capture it.

CUDA graphs. Which path a layer takes is decided in Python, so a captured graph keeps the path
of its capture. vLLM captures full graphs of uniform decode batches (query length 1: FlashDec)
and, with ``AttentionCGSupport.ALWAYS``, could also capture a mixed-batch graph whose dummy
batch has query length 1 and replay it on a real prefill. The builder therefore declares
``UNIFORM_BATCH`` (as vLLM does for FlashAttention 2, for the same reason): mixed batches run
attention eagerly between piecewise graphs and take the parent path.
"""

from __future__ import annotations

import torch
import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from flashdec.kernels import decode
from flashdec.vllm_plugin.layout import decode_arguments, token_major_kv_views
from flashdec.vllm_plugin.stats import STATS
from flashdec.vllm_plugin.workspace import DecodeWorkspacePool

# KV cache dtypes FlashDec reads (FP8 caches fall back until FlashDec's FP8 decode is wired in).
_FLOAT_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# Batch capacity when the engine config is not available (unit use outside an engine).
_DEFAULT_MAX_BATCH = 256
_DEFAULT_MAX_SEQ_LEN = 8192

# One pool per (geometry, dtype, device, capacity): every layer of that shape shares it.
_POOLS: dict[tuple, DecodeWorkspacePool] = {}


def _pool(num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, max_batch, max_seq_len):
    key = (num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, max_batch, max_seq_len)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = DecodeWorkspacePool(
            max_batch=max_batch,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            device=device,
            max_seq_len=max_seq_len,
        )
    return pool


class FlashDecMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention's builder, with CUDA-graph support capped at uniform batches."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        parent = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        cap = AttentionCGSupport.UNIFORM_BATCH
        return parent if parent.value < cap.value else cap


class FlashDecImpl(FlashAttentionImpl):
    """FlashAttention's implementation with FlashDec's paged decode for decode batches."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        config = get_current_vllm_config_or_none()
        if config is not None:
            self._max_batch = max(
                config.scheduler_config.max_num_seqs,
                config.compilation_config.max_cudagraph_capture_size or 0,
            )
            self._max_seq_len = config.model_config.max_model_len
            dual_batch_overlap = config.parallel_config.use_ubatching
        else:
            self._max_batch, self._max_seq_len = _DEFAULT_MAX_BATCH, _DEFAULT_MAX_SEQ_LEN
            dual_batch_overlap = False
        self._unsupported = self._unsupported_reason(dual_batch_overlap)
        if self._unsupported is not None:
            STATS.record_fallback(self._unsupported)
        self._kv_cache: torch.Tensor | None = None  # the cache the views below were made of
        self._kv_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pool: DecodeWorkspacePool | None = None

    def _unsupported_reason(self, dual_batch_overlap: bool) -> str | None:
        """Why this layer can never use FlashDec (None when it can)."""
        if self.attn_type != AttentionType.DECODER:
            return f"{getattr(self.attn_type, 'value', self.attn_type)} attention"
        if self.kv_cache_dtype not in _FLOAT_KV_CACHE_DTYPES:
            return f"KV cache dtype {self.kv_cache_dtype!r}"
        if self.sliding_window != (-1, -1):
            return "sliding-window attention"
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.logits_soft_cap:
            return "logits soft-capping"
        if self.sinks is not None:
            return "attention sinks"
        if self.head_size > 256:
            return f"head_size {self.head_size} (> 256)"
        if self.total_cp_world_size > 1:
            return "context parallelism"
        if envs.VLLM_BATCH_INVARIANT:
            return "batch-invariant mode"
        if dual_batch_overlap:
            return "micro-batching (dual-batch overlap)"
        return None

    def _decode_reason(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata | None,
        output_scale: torch.Tensor | None,
        output_block_scale: torch.Tensor | None,
    ) -> str | None:
        """Why this call of a supported layer takes the parent path (None: FlashDec decodes it)."""
        if attn_metadata is None:
            return "profiling runs"
        if attn_metadata.max_query_len != 1:
            return "prefill and mixed batches"
        if output_scale is not None or output_block_scale is not None:
            return "fused output quantization"
        if isinstance(attn_metadata.causal, torch.Tensor):
            return "per-request causality"
        if attn_metadata.mm_prefix_range_tensor is not None:
            return "multimodal prefix-LM ranges"
        if kv_cache.dtype != query.dtype:
            return f"KV cache dtype {kv_cache.dtype} with {query.dtype} queries"
        if attn_metadata.seq_lens.shape[0] > self._max_batch:
            return f"decode batches above {self._max_batch} requests"
        return None

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._unsupported is None:  # layers that can never decode here were counted once
            reason = self._decode_reason(
                query, kv_cache, attn_metadata, output_scale, output_block_scale
            )
            if reason is None:
                return self._decode(query, kv_cache, attn_metadata, output)
            STATS.record_fallback(reason)
        return super().forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            output_scale=output_scale,
            output_block_scale=output_block_scale,
        )

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if kv_cache is not self._kv_cache:  # the layer's cache tensor is fixed once allocated
            self._kv_views = token_major_kv_views(kv_cache)
            self._kv_cache = kv_cache
        args = decode_arguments(
            query,
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            output,
            kv_views=self._kv_views,
        )
        batch, num_q_heads, head_dim = args.q.shape
        if self._pool is None:
            self._pool = _pool(
                num_q_heads,
                args.k_cache.shape[1],
                head_dim,
                args.k_cache.shape[2],
                query.dtype,
                query.device,
                self._max_batch,
                self._max_seq_len,
            )
        decode(
            args.q,
            args.k_cache,
            args.v_cache,
            args.block_tables,
            args.seq_lens,
            sm_scale=self.scale,
            out=args.out,
            workspace=self._pool.workspace(batch),
        )
        STATS.record_decode(batch, num_q_heads, self.num_kv_heads, head_dim)
        counter = STATS.device_counter(query.device)
        if counter is not None:
            counter.add_(1)
        return output


class FlashDecBackend(FlashAttentionBackend):
    """vLLM's FlashAttention backend with FlashDec's decode; registered as ``CUSTOM``."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps the name back to AttentionBackendEnum

    @staticmethod
    def get_impl_cls() -> type[FlashDecImpl]:
        return FlashDecImpl

    @staticmethod
    def get_builder_cls() -> type[FlashDecMetadataBuilder]:
        return FlashDecMetadataBuilder
