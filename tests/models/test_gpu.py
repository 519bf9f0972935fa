"""GPU-only checks of the model path: the 8B shape on the device, bf16 logits against
transformers, and a CUDA-graph-captured decode step (run with scripts/gpu_check.sh)."""

from __future__ import annotations

import resource
import time

import pytest
import torch

from flashdec.models import DecoderAdapter, build_random_model, model_spec
from flashdec.models.reference import float32_logits
from flashdec.reference import apply_rope_inv_freq
from tests.models.greedy import DenseKV

pytestmark = pytest.mark.gpu

# bf16 through 32 random layers drifts from the float32 result whoever computes it: FlashDec's
# per-step logits must stay as close to a float32 run of the same model as transformers' own bf16
# logits are (relative L2), with this much slack for a different but equally exact rounding order
BF16_SLACK = 1.5


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@pytest.fixture(scope="module")
def llama8b():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base_gpu, base_rss = torch.cuda.memory_allocated(), _max_rss_bytes()
    start = time.perf_counter()
    model = build_random_model("llama3-8b-shape", device="cuda", seed=0)
    torch.cuda.synchronize()
    build = {
        "seconds": time.perf_counter() - start,
        "gpu_peak": torch.cuda.max_memory_allocated() - base_gpu,
        "rss_growth": _max_rss_bytes() - base_rss,
    }
    yield model, build
    del model
    torch.cuda.empty_cache()


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


def test_8b_shape_is_initialised_on_the_gpu(llama8b):
    model, build = llama8b
    spec = model_spec(model)
    print(f"llama3-8b-shape build: {build}")  # reported by gpu_check's log
    assert spec.dtype == torch.bfloat16 and spec.device.type == "cuda"
    assert build["gpu_peak"] <= 1.05 * spec.weight_bytes
    assert build["rss_growth"] < spec.weight_bytes / 8  # no CPU copy of the weights


@pytest.mark.parametrize("fused", [True, False])
def test_8b_shape_logits_within_bf16_tolerance(llama8b, fused):
    """Prefill and 8 teacher-forced decode steps against transformers' own forward."""
    model, _ = llama8b
    adapter = DecoderAdapter(model, fused_kernels=fused)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, adapter.spec.vocab_size, (61,), generator=gen).cuda()
    steps = torch.randint(0, adapter.spec.vocab_size, (8,), generator=gen).tolist()
    store = DenseKV(adapter.spec, 1, 80)
    ours = [adapter.prefill(prompt, store.sink(0))]
    for token in steps[:-1]:
        ours.append(adapter.decode(torch.tensor([token], device="cuda"), store.attention)[0])
        store.seq_lens += 1
    sequence = torch.cat([prompt, torch.tensor(steps[:-1], device="cuda")])[None]
    with torch.no_grad():  # teacher-forced: every step's logits from one forward
        hf_bf16 = model(sequence).logits[0, len(prompt) - 1 :]
        reference = float32_logits(model, sequence[0])[len(prompt) - 1 :]
    ours_err = [_rel_err(o, r) for o, r in zip(ours, reference, strict=True)]
    hf_err = [_rel_err(h, r) for h, r in zip(hf_bf16, reference, strict=True)]
    agree = [int(o.argmax()) == int(h.argmax()) for o, h in zip(ours, hf_bf16, strict=True)]
    print(
        f"fused={fused} relative logit errors vs float32: FlashDec {ours_err}, "
        f"transformers bf16 {hf_err}; top-1 agreement with transformers {agree}"
    )
    assert max(ours_err) <= BF16_SLACK * max(hf_err)


class _GraphSafeDenseAttention:
    """Dense attention over static buffers with no host sync: capturable in a CUDA graph."""

    def __init__(self, spec, batch: int, max_len: int) -> None:
        shape = (spec.num_layers, batch, max_len, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.k = torch.zeros(shape, dtype=spec.dtype, device="cuda")
        self.v = torch.zeros(shape, dtype=spec.dtype, device="cuda")
        self.positions = torch.zeros(batch, dtype=torch.int64, device="cuda")
        self.slots = torch.arange(max_len, device="cuda")

    def __call__(self, layer_idx, q, k, v):
        spec, pos = self.spec, self.positions
        q = apply_rope_inv_freq(q, pos, spec.inv_freq)
        k = apply_rope_inv_freq(k, pos, spec.inv_freq)
        rows = torch.arange(q.shape[0], device="cuda")
        self.k[layer_idx, rows, pos] = k
        self.v[layer_idx, rows, pos] = v
        keys = self.k[layer_idx].float().repeat_interleave(spec.group_size, dim=2)
        values = self.v[layer_idx].float().repeat_interleave(spec.group_size, dim=2)
        scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * spec.sm_scale
        visible = self.slots[None, None, :] <= pos[:, None, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return torch.einsum("bhl,blhd->bhd", probs, values).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_step_is_cuda_graph_capturable(dtype):
    """Capture adapter.decode (fused kernels) once, replay it: the logits of eager runs."""
    model = build_random_model("tiny", dtype=dtype, device="cuda")
    adapter = DecoderAdapter(model)
    assert adapter.fused_kernels
    batch, max_len = 3, 24
    eager = _GraphSafeDenseAttention(adapter.spec, batch, max_len)
    graphed = _GraphSafeDenseAttention(adapter.spec, batch, max_len)
    static_ids = torch.zeros(batch, dtype=torch.int64, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles, allocator pools settle
        for _ in range(2):
            adapter.decode(static_ids, graphed)
    torch.cuda.current_stream().wait_stream(side)
    graphed.k.zero_()
    graphed.v.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = adapter.decode(static_ids, graphed)

    tokens = torch.tensor([5, 77, 300], device="cuda")
    for step in range(6):
        static_ids.copy_(tokens)
        graphed.positions.fill_(step)
        graph.replay()
        eager.positions.fill_(step)
        expected = adapter.decode(tokens, eager)
        torch.testing.assert_close(static_logits, expected)  # cuBLAS may pick other algorithms
        tokens = expected.argmax(-1)
