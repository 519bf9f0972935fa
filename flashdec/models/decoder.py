"""A transformers decoder's forward pass, split where FlashDec's paged cache plugs in.

:class:`DecoderAdapter` runs the model's own weights (references to its modules, no copies):

- ``prefill`` runs one prompt with causal SDPA and hands each layer's rotated K and V to a sink,
  so the caller can import them into the paged cache;
- ``decode`` runs one new token per request and asks a callback for each layer's attention, so
  the caller can rotate q/k at each request's position, append k/v and run paged decode.

On CUDA the per-layer elementwise work uses FlashDec's fused kernels (residual add + RMSNorm,
SiLU × up); elsewhere, and whenever ``fused_kernels=False``, it is transformers' own modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from flashdec._checks import check_int_tensor, check_shape, check_tensor
from flashdec.kernels.activation import silu_and_mul
from flashdec.kernels.gemv import small_batch_linear
from flashdec.kernels.norm import rms_norm
from flashdec.models.spec import ModelSpec, model_spec
from flashdec.reference import apply_rope_inv_freq

# kv_sink(layer_idx, k_rot [T, Hkv, D], v [T, Hkv, D])
KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]
# attention(layer_idx, q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D]) -> out [B, Hq, D]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LayersForward(Protocol):
    """What runs a decoder's layers: ``layers_forward(input_ids [N], attend) -> [N, hidden]``."""

    def layers_forward(self, input_ids: torch.Tensor, attend: Attention) -> torch.Tensor: ...


def _fuse_linears(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' rows back to back; each module's parameters
    become views of it, so the model keeps working and no weight exists twice (each old tensor
    is freed as soon as its rows are copied)."""
    weights = [lin.weight for lin in linears]
    out_rows = sum(w.shape[0] for w in weights)
    fused = torch.empty(
        out_rows, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device
    )
    has_bias = [lin.bias is not None for lin in linears]
    fused_bias = None
    if any(has_bias):
        fused_bias = torch.zeros(out_rows, dtype=weights[0].dtype, device=weights[0].device)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        with torch.no_grad():
            fused[start : start + rows].copy_(lin.weight)
            lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
            if fused_bias is not None and lin.bias is not None:
                fused_bias[start : start + rows].copy_(lin.bias)
                lin.bias = nn.Parameter(fused_bias[start : start + rows], requires_grad=False)
        start += rows
    return fused, fused_bias


@dataclass(frozen=True)
class _Layer:
    """References to one decoder layer's modules (the model's own parameters)."""

    input_norm: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o_proj: nn.Linear
    post_norm: nn.Module
    mlp: nn.Module
    # with fused weights: q|k|v and gate|up rows in one tensor each (the modules hold views)
    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up_weight: torch.Tensor | None = None

    def fused(self) -> _Layer:
        """This layer with its q/k/v and gate/up weights fused (see :func:`_fuse_linears`)."""
        if self.qkv_weight is not None:
            return self
        qkv, qkv_bias = _fuse_linears((self.q_proj, self.k_proj, self.v_proj))
        gate_up, _ = _fuse_linears((self.mlp.gate_proj, self.mlp.up_proj))
        return dataclasses.replace(self, qkv_weight=qkv, qkv_bias=qkv_bias, gate_up_weight=gate_up)

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn = layer.self_attn
        return cls(
            input_norm=layer.input_layernorm,
            q_proj=attn.q_proj,
            k_proj=attn.k_proj,
            v_proj=attn.v_proj,
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            o_proj=attn.o_proj,
            post_norm=layer.post_attention_layernorm,
            mlp=layer.mlp,
        )


def _sliding_window_mask(positions: torch.Tensor, window: int) -> torch.Tensor:
    """``[T, T]`` bool: query ``i`` sees key ``j`` when ``i - window < j <= i`` (the last
    ``window`` positions, itself included - transformers' sliding-window rule)."""
    offset = positions[:, None] - positions[None, :]
    return (offset >= 0) & (offset < window)


class DecoderAdapter:
    """Prefill and per-token decode of a supported transformers model (see :mod:`.spec`).

    Args:
        model: a ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` or
            ``Qwen3ForCausalLM`` on one device; it is checked (:func:`model_spec`) and used in
            place: the adapter holds references to its modules, never copies of weights.
        fused_kernels: use FlashDec's Triton residual+RMSNorm and SiLU×up kernels. Default: on
            when the model is on CUDA. ``False`` runs transformers' own modules (the exact path).
        fuse_weights: store each layer's q/k/v projections, and its gate/up projections, as one
            tensor each (one GEMM instead of three and two) — the model's parameters are
            re-pointed at views of them, so memory does not grow and the model still runs.
            Default: on when the model is on CUDA (the CPU path keeps the layout untouched).

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: an unsupported architecture or feature, each one named.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        fused_kernels: bool | None = None,
        fuse_weights: bool | None = None,
    ) -> None:
        self.spec: ModelSpec = model_spec(model)
        on_cuda = self.spec.device.type == "cuda"
        fused_kernels = on_cuda if fused_kernels is None else fused_kernels
        fuse_weights = on_cuda if fuse_weights is None else fuse_weights
        for name, value in (("fused_kernels", fused_kernels), ("fuse_weights", fuse_weights)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {value!r}")
        self.model = model
        self.fused_kernels = fused_kernels
        self.fuse_weights = fuse_weights
        self._embed = model.model.embed_tokens
        layers = [_Layer.of(layer) for layer in model.model.layers]
        if fuse_weights:
            layers = [layer.fused() for layer in layers]
        self._layers = tuple(layers)
        self._final_norm = model.model.norm
        self._lm_head = model.lm_head

    # -- per-layer pieces shared by prefill and decode ---------------------------------------

    def _norm(
        self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; without ``residual``, ``(norm(x), x)``.
        The fused path updates ``residual`` in place."""
        if self.fused_kernels:
            eps = norm.variance_epsilon
            if residual is None:
                return rms_norm(x, norm.weight, eps), x
            return rms_norm(x, norm.weight, eps, residual=residual), residual
        if residual is not None:
            x = residual + x
        return norm(x), x

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear``; the fused path streams small-batch weights through FlashDec's GEMV
        where it beats cuBLAS (:func:`small_batch_linear`)."""
        if self.fused_kernels:
            return small_batch_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _proj(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        return self._linear(x, proj.weight, proj.bias)

    def _head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            return rms_norm(x, norm.weight, norm.variance_epsilon)
        return norm(x)

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of normed ``x [N, hidden]`` to ``q [N, Hq, D]``, ``k, v [N, Hkv, D]``
        (q/k normed per head for Qwen3), not rotated. With ``out [N, (Hq + 2 Hkv) D]`` they
        are views of ``out`` (the fused GEMM writes there; other results are copied in)."""
        if layer.qkv_weight is not None:  # one GEMM; q, k, v are strided views of its output
            weight, bias = layer.qkv_weight, layer.qkv_bias
            if out is None:
                qkv = self._linear(x, weight, bias)
            elif bias is None:  # what F.linear runs, into ``out``
                qkv = torch.mm(x, weight.t(), out=out)
            else:
                qkv = torch.addmm(bias, x, weight.t(), out=out)
            q, k, v = self._split_qkv(qkv)
        else:
            n, d = x.shape[0], self.spec.head_dim
            q, k, v = (
                self._proj(x, proj).view(n, -1, d)
                for proj in (layer.q_proj, layer.k_proj, layer.v_proj)
            )
        if layer.q_norm is not None:
            q = self._head_norm(layer.q_norm, q)
            k = self._head_norm(layer.k_norm, k)
        if out is None:
            return q, k, v
        views = self._split_qkv(out)
        for view, result in zip(views, (q, k, v), strict=True):
            if view.data_ptr() != result.data_ptr():
                view.copy_(result)
        return views

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [N, Hq, D]``, ``k, v [N, Hkv, D]``: strided views of ``qkv [N, (Hq + 2 Hkv) D]``."""
        spec, n = self.spec, qkv.shape[0]
        hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
        return (
            qkv[:, : hq * d].view(n, hq, d),
            qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d),
            qkv[:, (hq + hkv) * d :].view(n, hkv, d),
        )

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_kernels:
            return layer.mlp(x)
        mlp = layer.mlp
        if layer.gate_up_weight is not None:
            act = silu_and_mul(self._linear(x, layer.gate_up_weight))
        else:
            act = silu_and_mul(self._proj(x, mlp.gate_proj), self._proj(x, mlp.up_proj))
        return self._proj(act, mlp.down_proj)

    # -- the layers' dense work, in the pieces a piecewise CUDA graph captures --------------

    def begin_layers(
        self, input_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding and the first layer's input norm: ``(x, residual)``, each ``[N, hidden]``;
        the embedding (the residual stream) goes into ``out [N, hidden]`` when given."""
        weight = self._embed.weight
        if out is None:
            embedded = F.embedding(input_ids, weight)
        else:  # F.embedding's gather, into ``out``
            embedded = torch.index_select(weight, 0, input_ids, out=out)
        return self._norm(self._layers[0].input_norm, embedded)

    def project_qkv(
        self, layer_idx: int, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s q, k, v of its normed input ``x`` (not rotated); with ``out
        [N, (Hq + 2 Hkv) D]``, views of it."""
        return self._qkv(self._layers[layer_idx], x, out)

    def finish_layer(
        self, layer_idx: int, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything of layer ``layer_idx`` after its attention ``out [N, Hq, D]``: o_proj,
        residual, MLP, residual, and the next layer's input norm (the final norm after the last
        layer): ``(x, residual)``."""
        layers = self._layers
        layer = layers[layer_idx]
        x, residual = self._norm(
            layer.post_norm, self._proj(out.reshape(out.shape[0], -1), layer.o_proj), residual
        )
        last = layer_idx + 1 == len(layers)
        next_norm = self._final_norm if last else layers[layer_idx + 1].input_norm
        return self._norm(next_norm, self._mlp(layer, x), residual)

    def layers_forward(self, input_ids: torch.Tensor, attend: Attention) -> torch.Tensor:
        """Embedding, every layer (attention by ``attend``) and the final norm: ``[N, hidden]``."""
        x, residual = self.begin_layers(input_ids)
        for i in range(len(self._layers)):
            out = attend(i, *self.project_qkv(i, x))  # [N, Hq, D]
            x, residual = self.finish_layer(i, out, residual)
        return x

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def _check_ids(self, input_ids: object) -> torch.Tensor:
        ids = check_int_tensor("input_ids", input_ids, ndim=1, device=self.spec.device)
        if ids.shape[0] == 0:
            raise ValueError("input_ids must hold at least one token, got shape (0,)")
        return ids

    # -- public API --------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, kv_sink: KVSink) -> torch.Tensor:
        """Run one prompt ``input_ids [T]`` (positions ``0..T-1``) with causal attention
        (within its sliding window on a windowed layer).

        For each layer, in order, calls ``kv_sink(layer_idx, k_rot, v)`` once with
        ``k_rot, v [T, Hkv, D]`` in the model's dtype; ``k_rot`` is K rotated at its position
        with the model's ``inv_freq`` in FlashDec's RoPE arithmetic (what the fused append
        kernel writes at decode time). Returns the last position's logits ``[V]`` in float32.

        Raises TypeError/ValueError (before any layer runs) for bad ids or a non-callable sink;
        an exception from ``kv_sink`` propagates (layers before it have been sunk).
        """
        ids = self._check_ids(input_ids)
        if not callable(kv_sink):
            raise TypeError(f"kv_sink must be callable, got {type(kv_sink).__name__}")
        low, high = int(ids.min()), int(ids.max())  # an out-of-range id would fault on CUDA
        if low < 0 or high >= self.spec.vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, {self.spec.vocab_size}), got min {low}, max {high}"
            )
        spec = self.spec
        num_tokens = ids.shape[0]
        positions = torch.arange(num_tokens, device=ids.device)
        inv_freq = spec.inv_freq
        # a window only matters once the prompt is longer than it; one boolean mask per window
        masks = {
            w: _sliding_window_mask(positions, w)
            for w in set(spec.layer_windows)
            if w is not None and w < num_tokens
        }

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            q = apply_rope_inv_freq(q, positions, inv_freq)
            k = apply_rope_inv_freq(k, positions, inv_freq)
            kv_sink(layer_idx, k, v)
            mask = masks.get(spec.layer_windows[layer_idx])
            out = F.scaled_dot_product_attention(  # [1, Hq, T, D]
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=spec.sm_scale,
                enable_gqa=spec.num_q_heads != spec.num_kv_heads,
            )
            return out[0].transpose(0, 1)  # [T, Hq, D]

        hidden = self.layers_forward(ids, attend)
        return self._proj(hidden[-1:], self._lm_head)[0].float()

    @torch.no_grad()
    def decode(
        self,
        input_ids: torch.Tensor,
        attention: Attention,
        *,
        logits_rows: torch.Tensor | None = None,
        layers: LayersForward | None = None,
    ) -> torch.Tensor:
        """One step for ``input_ids [N]``: a new token per running request, or the tokens of
        several requests packed request by request (prompt chunks; the attention callback
        knows which token belongs where).

        Per layer: norm, q/k/v projections (+ bias), q/k per-head RMSNorm for Qwen3, then
        ``out = attention(layer_idx, q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D])`` with q and k
        NOT rotated (the callback rotates them at each request's position), o_proj, residual,
        MLP, residual. Returns logits ``[N, V]`` in the model's dtype, or only those of
        ``logits_rows`` (int64 row indices: the lm_head runs on those rows alone). ``layers``
        runs the layers instead of :meth:`layers_forward` (the same numbers: e.g. the runner's
        piecewise CUDA graphs, attention still by the callback).

        CUDA-graph capturable: no host sync, no data-dependent control flow. Checks are on
        metadata only (ids are not range-checked: they come from the previous argmax).
        """
        ids = self._check_ids(input_ids)
        if not callable(attention):
            raise TypeError(f"attention must be callable, got {type(attention).__name__}")
        spec = self.spec
        expected = (ids.shape[0], spec.num_q_heads, spec.head_dim)

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            out = attention(layer_idx, q, k, v)
            check_tensor("attention output", out, dtypes=(spec.dtype,), device=spec.device)
            check_shape("attention output", out, expected)
            return out

        hidden = (layers or self).layers_forward(ids, attend)
        if logits_rows is not None:
            hidden = hidden.index_select(0, logits_rows)
        return self._proj(hidden, self._lm_head)
