"""The launch plan: split heuristic, overrides, workspace buffers (no kernel launches)."""

from __future__ import annotations

import math

import pytest
import torch

from flashdec.kernels import DecodePlan, DecodeWorkspace, plan_decode
from flashdec.kernels.decode_plan import (
    MAX_SPLITS,
    balance_splits,
    default_kernel_config,
)


def _plan(batch, max_len, hkv=8, hq=32, d=128, page=16, **kw) -> DecodePlan:
    return plan_decode(batch, hq, hkv, d, page, max_len, torch.bfloat16, "cpu", **kw)


def test_small_batch_long_context_fills_the_gpu():
    plan = _plan(1, 32768)
    assert plan.uses_split
    assert plan.num_programs >= plan.sm_count  # at least one program per SM
    assert plan.tokens_per_split % plan.block_n == 0
    assert plan.num_splits * plan.tokens_per_split >= 32768


def test_large_batch_needs_no_split():
    assert not _plan(512, 256).uses_split
    assert not _plan(64, 2048).uses_split


def test_skewed_batch_is_cut_by_tokens_not_by_request():
    lens = [32768] + [1024] * 63
    plan = _plan(64, max(lens), total_tokens=sum(lens))
    per_request = [math.ceil(n / plan.tokens_per_split) for n in lens]
    work = [min(n, plan.tokens_per_split) for n in lens]
    assert per_request[0] > 8  # the long request is spread over many programs
    assert max(work) <= 2 * min(work)  # and no program carries much more than another
    uniform = _plan(64, sum(lens) // 64, total_tokens=sum(lens))
    assert uniform.tokens_per_split >= plan.tokens_per_split // 2
    # programs are sized by the real work items, not by batch x the long request's splits
    assert plan.num_programs <= 8 * (64 + math.ceil(sum(lens) / plan.tokens_per_split))


def test_forced_splits_and_overrides():
    plan = _plan(2, 1000, num_splits=3, block_n=32, num_warps=8, num_stages=2)
    assert (plan.num_splits, plan.block_n, plan.num_warps, plan.num_stages) == (3, 32, 8, 2)
    assert plan.tokens_per_split == 352  # ceil(1000 / 3) rounded up to block_n
    plan = _plan(2, 1000, tokens_per_split=128, block_n=64)
    assert (plan.num_splits, plan.tokens_per_split) == (8, 128)
    assert _plan(2, 1000, num_splits=1).num_splits == 1


def test_tiles_pad_the_query_group_to_tensor_core_rows():
    assert _plan(4, 100, hkv=32).block_g == 16  # MHA: 1 row padded to 16
    assert _plan(4, 100, hkv=1).block_g == 32  # MQA: 32 query heads in one tile
    assert _plan(4, 100, hq=24, hkv=8, d=80).block_d == 128


def test_plan_is_frozen_and_workspace_shapes():
    plan = _plan(3, 4096)
    with pytest.raises(AttributeError):
        plan.num_splits = 2  # type: ignore[misc]
    ws = DecodeWorkspace.allocate(plan)
    assert ws.partial_out.shape == (3, 32, plan.num_splits, 128)
    assert ws.partial_out.dtype == torch.float32
    assert ws.partial_lse.shape == (3, 32, plan.num_splits)
    assert ws.out.shape == (3, 32, 128) and ws.out.dtype == torch.bfloat16
    assert plan.allocate_workspace().plan is plan


def test_splits_are_balanced():
    # 4096 tokens in two splits are 2 x 2048, not 2000 + 2000 + 96
    assert balance_splits(4096, 2000, 32) == (2, 2048)
    assert balance_splits(32768, 993, 64) == (32, 1024)
    assert balance_splits(8192, 1986, 64) == (4, 2048)  # rounded down: never above the target
    assert balance_splits(100, 1000, 64) == (1, 128)
    for max_len, target, bn in [(5000, 700, 64), (777, 100, 32), (16384, 7944, 64)]:
        splits, per = balance_splits(max_len, target, bn)
        assert per % bn == 0 and splits * per >= max_len
        assert 0 < max_len - (splits - 1) * per <= per  # no empty split
        assert per < -(-max_len // splits) + bn  # equal up to one tile of rounding


def test_tile_width_follows_programs_per_sm():
    # few programs per SM (split path, or a small batch): the wide 32 KiB tile, 3 stages
    assert (_plan(1, 32768).block_n, _plan(1, 32768).num_stages) == (64, 3)
    assert _plan(32, 4096).block_n == 64 and not _plan(32, 4096).uses_split
    # up to 6 programs per SM: the narrow tile, so that all of them are resident at once
    assert (_plan(64, 2048).block_n, _plan(64, 2048).num_stages) == (32, 3)
    # several waves anyway: wide tile, two stages
    assert (_plan(128, 1024).block_n, _plan(128, 1024).num_stages) == (64, 2)
    # the tile is sized in bytes: head_dim 64 gathers twice as many tokens
    assert default_kernel_config(64, torch.bfloat16).block_n == 128
    assert default_kernel_config(128, torch.float32).block_n == 32
    # four warps for head_dim 256 too (eight were slower on every 16/8/256 shape swept)
    assert default_kernel_config(256, torch.bfloat16).num_warps == 4


def test_split_work_items_stay_within_two_per_sm():
    # 8 x 8 KV heads x 4 splits = 256 items <= 2 x 132 (5 splits would leave SMs unevenly loaded)
    assert _plan(8, 8192).num_splits == 4
    assert _plan(16, 16384).num_splits == 2
    assert _plan(1, 32768, hkv=32, hq=32).num_splits == 8


def test_split_bounds_at_extreme_lengths():
    plan = _plan(1, 10**7)
    assert plan.num_splits <= MAX_SPLITS and plan.tokens_per_split % plan.block_n == 0
    assert plan.num_splits * plan.tokens_per_split >= 10**7
    assert _plan(1, 0).num_splits == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"batch": 0}, ValueError),
        ({"num_q_heads": 6, "num_kv_heads": 4}, ValueError),
        ({"head_dim": 512}, ValueError),
        ({"dtype": torch.int32}, TypeError),
        ({"kv_layout": "NHD"}, ValueError),
        ({"block_n": 48}, ValueError),
        ({"tokens_per_split": 100}, ValueError),
        ({"num_splits": MAX_SPLITS + 1}, ValueError),
        ({"batch": 2.0}, TypeError),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, error):
    args = {
        "batch": 2,
        "num_q_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 64,
        "block_size": 16,
        "max_seq_len": 100,
        "dtype": torch.float16,
        "device": "cpu",
    }
    args.update(kwargs)
    with pytest.raises(error):
        plan_decode(**args)


def test_workspace_allocate_needs_a_plan():
    with pytest.raises(TypeError):
        DecodeWorkspace.allocate("plan")  # type: ignore[arg-type]


def test_short_contexts_get_a_context_sized_single_stage_tile():
    # B=1024 L=17: one loop iteration per program, so no pipeline and a tile of 32 tokens
    short = plan_decode(1024, 32, 8, 128, 16, 17, torch.bfloat16, "cpu")
    assert not short.uses_split
    assert (short.block_n, short.num_stages) == (32, 1)
    assert plan_decode(1024, 32, 8, 128, 16, 5, torch.bfloat16, "cpu").block_n == 16
    # a context of at least one default tile keeps the default tile
    longer = plan_decode(1024, 32, 8, 128, 16, 64, torch.bfloat16, "cpu")
    assert longer.block_n == 64 and longer.num_stages > 1
    # explicit choices still win
    forced = plan_decode(1024, 32, 8, 128, 16, 17, torch.bfloat16, "cpu", block_n=64, num_stages=2)
    assert (forced.block_n, forced.num_stages) == (64, 2)
