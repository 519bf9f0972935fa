"""The workspace pool: one length-independent plan per batch size, over fixed shared buffers."""

from __future__ import annotations

import math

import pytest
import torch

from flashdec.kernels.decode_plan import MAX_SPLITS
from flashdec.vllm_plugin.workspace import DecodeWorkspacePool, plan_for_batch

GEOMETRY = dict(
    num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cpu"
)


def make_pool(**overrides):
    kwargs = dict(GEOMETRY, max_batch=64, max_seq_len=4096)
    kwargs.update(overrides)
    return DecodeWorkspacePool(**kwargs)


def test_every_batch_size_has_its_own_plan_over_the_shared_buffers():
    pool = make_pool()
    partials = pool._partials
    lo, hi = partials.data_ptr(), partials.data_ptr() + partials.numel() * 4
    for batch in range(1, pool.max_batch + 1):
        ws = pool.workspace(batch)
        assert ws.plan.batch == batch and ws.out.shape == (batch, 32, 128)
        assert ws.partial_out.shape == (batch, 32, ws.plan.num_splits, 128)
        assert ws.partial_lse.shape == (batch, 32, ws.plan.num_splits)
        for t in (ws.partial_out, ws.partial_lse):
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= hi
        # the two partial buffers of one plan do not overlap
        assert ws.partial_out.data_ptr() + ws.partial_out.numel() * 4 <= ws.partial_lse.data_ptr()
        assert pool.workspace(batch) is ws  # fixed for the engine's lifetime
        # the in-kernel merge's arrival counters: one shared arena, zero between launches
        assert ws.counters.shape == (batch, 8) and ws.counters.dtype == torch.int32
        assert ws.counters.data_ptr() == pool._counters.data_ptr()
    assert not pool._counters.any()
    counters = pool._counters.numel() * 4
    assert pool.nbytes == partials.numel() * 4 + pool._outs.numel() * 2 + counters


def test_small_batches_split_to_cover_the_longest_request_large_ones_do_not():
    pool = make_pool()
    one = pool.plan(1)
    assert one.uses_split
    assert one.num_splits * one.tokens_per_split >= 4096
    assert not pool.plan(64).uses_split  # 512 (request, head) programs already fill 132 SMs


def test_split_count_respects_the_memory_budget_and_the_kernel_cap():
    budget = 2 * 2**20
    plan = plan_for_batch(4, **GEOMETRY, max_seq_len=10**6, max_partial_bytes=budget)
    per_split = 4 * 32 * 129 * 4
    assert plan.uses_split and plan.num_splits == budget // per_split
    plan = plan_for_batch(1, **GEOMETRY, max_seq_len=10**7)
    assert plan.num_splits == MAX_SPLITS


def test_tokens_per_split_follows_the_nominal_length():
    short = plan_for_batch(8, **GEOMETRY, max_seq_len=32768, nominal_seq_len=1024)
    long = plan_for_batch(8, **GEOMETRY, max_seq_len=32768, nominal_seq_len=16384)
    assert short.tokens_per_split < long.tokens_per_split
    for plan in (short, long):
        assert plan.num_splits == math.ceil(32768 / plan.tokens_per_split)


def test_nominal_length_is_capped_by_the_longest_request():
    capped = plan_for_batch(2, **GEOMETRY, max_seq_len=512, nominal_seq_len=100000)
    assert capped == plan_for_batch(2, **GEOMETRY, max_seq_len=512, nominal_seq_len=512)


@pytest.mark.parametrize("batch", [0, 65, -1])
def test_batches_outside_the_pool_are_rejected(batch):
    with pytest.raises(ValueError, match=r"batch must be in 1\.\.64"):
        make_pool().workspace(batch)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (dict(max_batch=0), ValueError),
        (dict(max_batch=2.0), TypeError),
        (dict(max_seq_len=0), ValueError),
        (dict(dtype=torch.int8), TypeError),
        (dict(num_kv_heads=5), ValueError),
        (dict(nominal_seq_len=0), ValueError),
    ],
)
def test_bad_pool_arguments_raise(overrides, error):
    with pytest.raises(error):
        make_pool(**overrides)
