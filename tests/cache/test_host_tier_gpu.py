"""The host tier on the GPU: the side-stream copies move the right bytes in both directions for
every KV dtype and any block order; a copy down reads the blocks before the step that reuses
them overwrites them; through ``flashdec.LLM`` (CUDA graphs on) a prompt served from the host
tier and a swapped request give transformers' tokens."""

from __future__ import annotations

import pytest
import torch

import flashdec
from flashdec.cache import PagedKVCache
from flashdec.cache.host_tier import HostBlockPool
from flashdec.models import build_random_model
from tests.models.greedy import hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_copies_round_trip_any_blocks(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(2, 3, 37, 2, 16, 128, device="cuda", generator=gen).to(dtype)
    pool = HostBlockPool(kv, 20)
    assert pool.storage.is_pinned()
    blocks = torch.randperm(37, generator=torch.Generator().manual_seed(1))[:13].tolist()
    hashes = [bytes([i]) for i in range(13)]
    original = kv.clone()
    assert pool.store(blocks, hashes) == 13
    kv.view(torch.uint8).fill_(0)  # the step after the eviction overwrites them
    targets = torch.randperm(37, generator=torch.Generator().manual_seed(2))[:13].tolist()
    assert pool.load(hashes, targets)
    torch.cuda.synchronize()
    for src, dst in zip(blocks, targets, strict=True):
        assert torch.equal(kv[:, :, dst].view(torch.uint8), original[:, :, src].view(torch.uint8))
    pool.transfer.synchronize()
    stats = pool.stats()
    assert stats["copy_down_s"] > 0 and stats["copy_up_s"] > 0
    assert stats["bytes_down"] == stats["bytes_up"] == 13 * kv[:, :, 0].numel() * kv.element_size()


def test_an_eviction_is_copied_before_the_step_that_reuses_the_block():
    """The pool's only blocks are cached; a new request's step evicts them and writes its own
    K/V into them right away (no synchronisation in between): the host copies hold the old
    bytes, and a later hit brings them back exactly."""
    block_bytes = 2 * 2 * 8 * 16 * 128 * 2  # K and V, 2 layers, bf16
    cache = PagedKVCache(
        2,
        8,
        128,
        16,
        4,
        dtype=torch.bfloat16,
        device="cuda",
        enable_prefix_caching=True,
        host_kv_cache_bytes=16 * block_bytes,
    )
    tokens = list(range(64))
    hashes = cache.prefix_cache.block_hashes(tokens)
    cache.add_request("a")
    cache.prefix_cache.attach_cached_prefix("a", hashes, 64)
    tx = cache.begin_tokens(["a"], [64])
    for layer in range(2):
        k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
        cache.write_token_layer(tx, layer, k, -k)
    cache.commit_token(tx)
    cache.prefix_cache.cache_request_blocks("a")
    before = cache.layout._group(0).kv[:, :, cache.request_block_ids("a")].clone()
    cache.finish_request("a")
    cache.add_request("b")
    tx = cache.begin_tokens(["b"], [64])  # evicts all four blocks
    for layer in range(2):
        big = torch.full((64, 8, 128), 7.0, device="cuda", dtype=torch.bfloat16)
        cache.write_token_layer(tx, layer, big, big)
    cache.commit_token(tx)
    cache.finish_request("b")
    cache.add_request("a2")
    assert cache.prefix_cache.attach_cached_prefix("a2", hashes, 65) == 64
    after = cache.layout._group(0).kv[:, :, cache.request_block_ids("a2")]
    assert torch.equal(before, after)
    cache.validate_invariants()


@pytest.mark.parametrize(
    ("name", "dtype"), [("tiny-llama", torch.float32), ("tiny-qwen2-swa", torch.bfloat16)]
)
def test_host_hits_and_swaps_keep_greedy_tokens_with_graphs(name, dtype):
    """Greedy tokens with swaps and host hits (CUDA graphs on) are transformers' in float32 and
    a roomy pool's (nothing swapped, nothing evicted) in bfloat16."""
    model = build_random_model(name, dtype=dtype, device="cuda", seed=0)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    long, short, other = (
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 60, 50)
    )
    requests = ((long, 60), (short, 40))
    if dtype == torch.float32:
        expected = [hf_greedy(model, [p], n, ignore_eos=True)[0] for p, n in requests]
    else:
        roomy = flashdec.LLM(model, max_batch_size=4, num_blocks=64, max_model_len=128)
        expected = [roomy.generate([p], n, ignore_eos=True)[0] for p, n in requests]
    llm = flashdec.LLM(
        model,
        max_batch_size=4,
        num_blocks=8,
        max_model_len=128,
        host_kv_cache_gib=0.01,
        swap_patience=2,
    )
    assert llm.cuda_graphs
    rids = [llm.add_request(p, n, ignore_eos=True) for p, n in requests]
    while llm.has_unfinished():
        llm.step()
    assert [llm.release(r) for r in rids] == expected
    assert llm.num_swaps == 1
    llm.generate([other], 8, ignore_eos=True)  # evicts more of the long request's blocks
    assert llm.generate([long], 8, ignore_eos=True) == [expected[0][:8]]
    stats = llm.prefix_cache_stats()
    assert stats["host_hit_tokens"] > 0 and stats["host"]["failed_up"] == 0
    llm.engine.cache.validate_invariants()
