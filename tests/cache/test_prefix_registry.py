"""PrefixRegistry: budget, refcounts, LRU eviction of inactive prefixes, no-change failures."""

from __future__ import annotations

import pytest

from flashdec.cache import BlockAllocator, PrefixRegistry
from flashdec.cache.prefix_registry import prefix_owner


def make(num_blocks=10, capacity=6):
    alloc = BlockAllocator(num_blocks)
    return alloc, PrefixRegistry(alloc, capacity, block_size=4)


def state_of(alloc, reg):
    return (
        alloc.owned_blocks(),
        alloc.num_free,
        [reg.state(pid) for pid in reg.ids()],
        reg.num_blocks,
        reg.num_evictions,
    )


def test_capacity_zero_turns_the_feature_off():
    alloc, reg = make(capacity=0)
    assert not reg.enabled
    with pytest.raises(RuntimeError, match="prefix_cache_capacity_blocks=0"):
        reg.register("p", 1)
    assert alloc.num_free == 10


def test_register_takes_prefix_owned_blocks_and_reports_state():
    alloc, reg = make()
    ids, evicted = reg.register("sys", 2)
    assert evicted == []
    assert all(alloc.owner_of(i) == prefix_owner("sys") for i in ids)
    st = reg.state("sys")
    assert (st.prefix_id, st.num_blocks, st.num_tokens, st.block_ids, st.refcount) == (
        "sys",
        2,
        8,
        tuple(ids),
        0,
    )
    reg.check_integrity({})


def test_refcounts_and_evict_rules():
    alloc, reg = make()
    reg.register(1, 2)
    reg.attach(1)
    reg.attach(1)
    assert reg.refcount(1) == 2 and reg.refcount_total() == 2
    with pytest.raises(RuntimeError, match="used by 2 active"):
        reg.evict(1)
    reg.detach(1)
    reg.detach(1)
    with pytest.raises(RuntimeError, match="no reference"):
        reg.detach(1)
    reg.evict(1)
    assert 1 not in reg and alloc.num_free == 10
    with pytest.raises(ValueError, match="unknown prefix"):
        reg.evict(1)


def test_budget_evicts_least_recently_used_inactive_first():
    _alloc, reg = make(capacity=6)
    reg.register("a", 2)
    reg.register("b", 2)
    reg.register("c", 2)
    reg.attach("a")  # a becomes most recent (and active)
    reg.detach("a")  # inactive again, but used after b and c
    assert reg.plan_register("d", 2) == ["b"]
    _, evicted = reg.register("d", 4)
    assert evicted == ["b", "c"]
    assert reg.ids() == ["a", "d"]
    assert reg.num_evictions == 2
    reg.check_integrity({})


def test_active_prefixes_are_never_evicted():
    alloc, reg = make(capacity=4)
    reg.register("a", 2)
    reg.register("b", 2)
    reg.attach("a")
    _, evicted = reg.register("c", 2)
    assert evicted == ["b"]
    before = state_of(alloc, reg)
    with pytest.raises(RuntimeError, match="even after evicting"):
        reg.register("d", 3)  # only c (2 blocks) is evictable
    assert state_of(alloc, reg) == before


def test_pool_shortage_also_evicts():
    alloc, reg = make(num_blocks=6, capacity=6)
    reg.register("a", 2)
    alloc.allocate(3, "someone else")  # 1 block free in the pool, 4 left in the budget
    _, evicted = reg.register("b", 2)
    assert evicted == ["a"]
    reg.attach("b")  # now nothing is evictable and the pool has 1 free block
    before = state_of(alloc, reg)
    with pytest.raises(RuntimeError, match="1 pool blocks would be free"):
        reg.register("c", 2)
    assert state_of(alloc, reg) == before


def test_pool_shortage_failure_changes_nothing():
    alloc, reg = make(num_blocks=5, capacity=5)
    reg.register("a", 1)
    reg.attach("a")
    alloc.allocate(3, "someone else")  # pool: 1 free
    before = state_of(alloc, reg)
    with pytest.raises(RuntimeError, match="cannot register prefix 'b'"):
        reg.register("b", 2)
    assert state_of(alloc, reg) == before


def test_register_rejections():
    alloc, reg = make(capacity=3)
    reg.register("a", 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", 1)
    with pytest.raises(RuntimeError, match="more than the prefix cache capacity"):
        reg.register("big", 4)
    assert reg.ids() == ["a"] and alloc.num_free == 9


def test_integrity_check_compares_refcounts_with_attachments():
    _alloc, reg = make()
    reg.register("a", 1)
    reg.attach("a")
    reg.check_integrity({"a": 1})
    with pytest.raises(RuntimeError, match="refcount 1 but 0"):
        reg.check_integrity({})
    with pytest.raises(RuntimeError, match="unknown prefix 'zz'"):
        reg.check_integrity({"a": 1, "zz": 1})
