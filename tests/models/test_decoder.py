"""DecoderAdapter's contract: weights by reference, argument errors, callback shapes."""

from __future__ import annotations

import functools

import pytest
import torch

from flashdec.models import DecoderAdapter, build_random_model
from tests.models.greedy import DenseKV


@functools.cache
def _adapter(name: str = "tiny-qwen2") -> DecoderAdapter:
    return DecoderAdapter(build_random_model(name, device="cpu"))


def test_weights_are_the_models_own():
    adapter = _adapter()
    params = {p.data_ptr() for p in adapter.model.parameters()}
    layer = adapter._layers[0]
    held = [layer.q_proj.weight, layer.q_proj.bias, layer.mlp.down_proj.weight]
    assert all(t.data_ptr() in params for t in held)
    assert adapter._lm_head.weight is adapter.model.model.embed_tokens.weight  # tied


def test_fused_kernels_default_off_on_cpu():
    assert not _adapter().fused_kernels
    with pytest.raises(TypeError, match="fused_kernels must be a bool"):
        DecoderAdapter(_adapter().model, fused_kernels=1)


def test_decode_hands_unrotated_qkv_per_layer():
    adapter = _adapter("tiny-qwen3")
    spec = adapter.spec
    seen = []

    def attention(layer_idx, q, k, v):
        seen.append((layer_idx, q.shape, k.shape, v.shape, q.dtype))
        return torch.zeros_like(q)

    logits = adapter.decode(torch.tensor([3, 4, 5]), attention)
    assert logits.shape == (3, spec.vocab_size) and logits.dtype == spec.dtype
    q_shape = (3, spec.num_q_heads, spec.head_dim)
    kv_shape = (3, spec.num_kv_heads, spec.head_dim)
    assert seen == [(i, q_shape, kv_shape, kv_shape, spec.dtype) for i in range(spec.num_layers)]


def test_decode_rows_are_independent():
    """A request's logits do not depend on which other requests share the step."""
    adapter = _adapter("tiny-llama")
    store = DenseKV(adapter.spec, 3, 16)
    for row, prompt in enumerate([[1, 2, 3], [4, 5], [6, 7, 8, 9]]):
        adapter.prefill(torch.tensor(prompt), store.sink(row))
    batched = adapter.decode(torch.tensor([10, 11, 12]), store.attention)
    solo = DenseKV(adapter.spec, 1, 16)
    adapter.prefill(torch.tensor([4, 5]), solo.sink(0))
    alone = adapter.decode(torch.tensor([11]), solo.attention)
    torch.testing.assert_close(batched[1], alone[0], atol=1e-5, rtol=1e-5)


class TestErrors:
    @pytest.mark.parametrize(
        ("ids", "kind", "match"),
        [
            ([1, 2], TypeError, "input_ids must be a torch"),
            (torch.tensor([1.0, 2.0]), TypeError, "input_ids must have dtype"),
            (torch.tensor([[1, 2]]), ValueError, "input_ids must be 1-D"),
            (torch.tensor([], dtype=torch.long), ValueError, "at least one token"),
            (torch.tensor([1, 256]), ValueError, r"input_ids must lie in \[0, 256\)"),
            (torch.tensor([-1, 2]), ValueError, "min -1"),
        ],
    )
    def test_prefill_rejects_bad_ids_before_any_layer(self, ids, kind, match):
        calls = []
        with pytest.raises(kind, match=match):
            _adapter().prefill(ids, lambda *args: calls.append(args))
        assert calls == []

    def test_prefill_sink_must_be_callable(self):
        with pytest.raises(TypeError, match="kv_sink must be callable"):
            _adapter().prefill(torch.tensor([1, 2]), None)

    def test_sink_exception_propagates(self):
        def sink(layer_idx, k, v):
            raise RuntimeError(f"cache full at layer {layer_idx}")

        with pytest.raises(RuntimeError, match="cache full at layer 0"):
            _adapter().prefill(torch.tensor([1, 2]), sink)

    def test_decode_errors(self):
        adapter = _adapter()
        with pytest.raises(TypeError, match="attention must be callable"):
            adapter.decode(torch.tensor([1]), "dense")
        with pytest.raises(ValueError, match="input_ids must be 1-D"):
            adapter.decode(torch.tensor([[1]]), lambda i, q, k, v: q)
        with pytest.raises(ValueError, match="attention output must have shape"):
            adapter.decode(torch.tensor([1, 2]), lambda i, q, k, v: q[:1])
        with pytest.raises(TypeError, match="attention output must have dtype"):
            adapter.decode(torch.tensor([1, 2]), lambda i, q, k, v: q.double())
        with pytest.raises(TypeError, match="attention output must be a torch"):
            adapter.decode(torch.tensor([1, 2]), lambda i, q, k, v: None)
