"""Test-side stand-in for the paged cache: a dense K/V store fed by ``prefill``'s sink and by
``decode``'s attention callback, and a greedy loop over it."""

from __future__ import annotations

import torch

from flashdec import dense_decode_attention_ref
from flashdec.models import DecoderAdapter, ModelSpec
from flashdec.reference import apply_rope_inv_freq


class DenseKV:
    """K/V of every layer as dense ``[B, max_len, Hkv, D]`` tensors; row ``b`` is one request."""

    def __init__(self, spec: ModelSpec, batch: int, max_len: int) -> None:
        shape = (batch, max_len, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.k = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)
        ]
        self.seq_lens = torch.zeros(batch, dtype=torch.int64, device=spec.device)
        self.position_shift = 0  # negative control only: rotate decode q/k at wrong positions

    def sink(self, row: int):
        def kv_sink(layer_idx: int, k_rot: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer_idx][row, : k_rot.shape[0]] = k_rot
            self.v[layer_idx][row, : v.shape[0]] = v
            self.seq_lens[row] = k_rot.shape[0]

        return kv_sink

    def attention(self, layer_idx: int, q, k, v) -> torch.Tensor:
        """Rotate q/k at each row's position, append k/v, attend densely over the row."""
        pos = self.seq_lens
        rot_pos = pos + self.position_shift
        q = apply_rope_inv_freq(q, rot_pos, self.spec.inv_freq)
        k = apply_rope_inv_freq(k, rot_pos, self.spec.inv_freq)
        rows = torch.arange(q.shape[0], device=q.device)
        self.k[layer_idx][rows, pos] = k
        self.v[layer_idx][rows, pos] = v
        return dense_decode_attention_ref(
            q,
            self.k[layer_idx],
            self.v[layer_idx],
            pos + 1,
            self.spec.sm_scale,
            window=self.spec.layer_windows[layer_idx],
        )


def truncate_at_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def flashdec_greedy(
    adapter: DecoderAdapter, prompts: list[list[int]], max_new_tokens: int, position_shift: int = 0
) -> list[list[int]]:
    """Prefill each prompt alone, then decode all of them as one batch; stop each at EOS."""
    spec = adapter.spec
    store = DenseKV(spec, len(prompts), max(map(len, prompts)) + max_new_tokens)
    store.position_shift = position_shift
    tokens = []
    for row, prompt in enumerate(prompts):
        ids = torch.tensor(prompt, device=spec.device)
        tokens.append([int(adapter.prefill(ids, store.sink(row)).argmax())])
    for _ in range(max_new_tokens - 1):
        last = torch.tensor([t[-1] for t in tokens], device=spec.device)
        logits = adapter.decode(last, store.attention)
        store.seq_lens += 1
        for row, t in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(t)
    return [truncate_at_eos(t, spec.eos_token_ids) for t in tokens]


def hf_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding); ``ignore_eos``:
    ``max_new_tokens`` each, EOS or not (as ``LLM.generate(..., ignore_eos=True)``)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
        # no EOS at all (min_new_tokens would mask EOS out of the argmax instead)
        extra = {"eos_token_id": None} if ignore_eos else {}
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **extra,
        )
        out.append(gen[0, len(prompt) :].tolist())
    return out
