"""snapshot_from_cache against a real PagedKVCache (CPU, fp32, tiny)."""

import pytest
import torch

from flashdec.cache import PagedKVCache
from flashdec.engine import snapshot_from_cache
from flashdec.scheduler import (
    BlockAwareScheduler,
    PrefixInfo,
    RequestSpec,
    SchedulerConfig,
)

BS = 4


def _cache(max_blocks=16, prefix_blocks=2):
    cache = PagedKVCache(
        1,
        1,
        4,
        BS,
        max_blocks,
        dtype=torch.float32,
        device="cpu",
        prefix_cache_capacity_blocks=prefix_blocks,
    )
    if prefix_blocks:
        kv = torch.zeros(1, prefix_blocks, 1, BS, 4)
        cache.register_prefix("sys", kv, kv.clone())
    return cache


def _append(cache, rids, n=1):
    for _ in range(n):
        z = torch.zeros(len(rids), 1, 4)
        cache.append(rids, z, z.clone())


SPECS = {
    "a": RequestSpec("a", 6, 5, submission_order=0),
    "b": RequestSpec("b", 8, 6, submission_order=1, prefix_id="sys"),
    "c": RequestSpec("c", 3, 2, submission_order=3),
    "d": RequestSpec("d", 8, 1, submission_order=2, prefix_id="sys"),
}


def _populated():
    cache = _cache()
    cache.add_request("a")
    _append(cache, ["a"], 6)
    cache.add_request("b")
    cache.attach_prefix("b", "sys")
    _append(cache, ["b"], 1)
    return cache


def test_snapshot_fields_from_cache():
    cache = _populated()
    version = cache.version
    snap = snapshot_from_cache(
        cache,
        step=7,
        specs=SPECS,
        waiting_ids=["c", "d"],
        active_ids=["a", "b"],
        waiting_wait_steps={"c": 2},
        waiting_skip_counts={"d": 1},
        active_service_wait_steps={"b": 3},
    )
    assert cache.version == version  # reading mutates nothing
    assert (snap.step, snap.cache_version, snap.block_size) == (7, version, BS)
    assert (snap.total_blocks, snap.free_blocks, snap.max_blocks_per_seq) == (16, 11, 16)
    assert snap.prefixes == (PrefixInfo("sys", 2, 8, 1),)
    a, b = snap.active
    assert (a.committed_tokens, a.committed_blocks, a.committed_private_blocks) == (6, 2, 2)
    assert (a.lifetime_private_blocks, a.service_wait_steps) == (3, 0)
    assert (b.committed_tokens, b.committed_blocks, b.committed_private_blocks) == (9, 3, 1)
    assert (b.lifetime_private_blocks, b.service_wait_steps) == (2, 3)
    assert snap.waiting_ids == ("d", "c")  # submission order
    d, c = snap.waiting
    assert (d.lifetime_private_blocks, d.wait_steps, d.skip_count) == (1, 0, 1)
    assert (c.lifetime_private_blocks, c.wait_steps, c.skip_count) == (2, 2, 0)
    again = snapshot_from_cache(
        cache,
        step=7,
        specs=SPECS,
        waiting_ids=["d", "c"],
        active_ids=["a", "b"],
        waiting_wait_steps={"c": 2},
        waiting_skip_counts={"d": 1},
        active_service_wait_steps={"b": 3},
    )
    assert again == snap
    decision = BlockAwareScheduler(SchedulerConfig(4, 4)).plan(snap)
    # pool 16 - prefix 2 - lifetimes (3 + 2) = 9 >= d (1) + c (2)
    assert decision.admit == ("d", "c")
    assert cache.version == version


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"active_ids": ["a"]}, ValueError),  # b is active in the cache
        ({"active_ids": ["a", "b", "c"]}, ValueError),  # c unknown to the cache
        ({"waiting_ids": ["a"], "active_ids": ["a", "b"]}, ValueError),  # both
        ({"waiting_ids": ["c", "c"]}, ValueError),
        ({"waiting_ids": "cd"}, TypeError),
        ({"waiting_ids": [1.5]}, TypeError),
        ({"specs": {"a": SPECS["a"], "b": SPECS["b"]}}, ValueError),  # no spec for c
        ({"specs": {**SPECS, "c": "spec"}}, TypeError),
        ({"specs": {**SPECS, "c": SPECS["a"]}}, ValueError),  # spec of another id
        ({"specs": [SPECS["a"]]}, TypeError),
        ({"waiting_wait_steps": {"a": 1}}, ValueError),  # counter for an active id
        ({"active_service_wait_steps": {"c": 1}}, ValueError),
        ({"waiting_skip_counts": {"c": -1}}, ValueError),
        ({"waiting_skip_counts": {"c": 1.0}}, TypeError),
        ({"waiting_wait_steps": [("c", 1)]}, TypeError),
        ({"step": -1}, ValueError),
        ({"specs": {**SPECS, "b": RequestSpec("b", 8, 6, 1)}}, ValueError),  # prefix mismatch
    ],
)
def test_snapshot_argument_errors(kwargs, error):
    cache = _populated()
    version = cache.version
    args = {"step": 0, "specs": SPECS, "waiting_ids": ["c"], "active_ids": ["a", "b"]}
    args.update(kwargs)
    with pytest.raises(error):
        snapshot_from_cache(cache, **args)
    assert cache.version == version


def test_waiting_ids_must_be_unknown_to_the_cache():
    cache = _populated()
    cache.add_request("c")
    cache.finish_request("c")
    with pytest.raises(ValueError, match="already known"):
        snapshot_from_cache(cache, step=0, specs=SPECS, waiting_ids=["c"], active_ids=["a", "b"])


def test_no_snapshot_while_a_transaction_is_open():
    cache = _populated()
    tx = cache.begin_token(["a"])
    with pytest.raises(RuntimeError, match="transaction"):
        snapshot_from_cache(cache, step=0, specs=SPECS, waiting_ids=[], active_ids=["a", "b"])
    cache.abort_token(tx)
    snapshot_from_cache(cache, step=0, specs=SPECS, waiting_ids=[], active_ids=["a", "b"])
