"""Random operation sequences over multi-group caches, window groups included (hypothesis).

A pure-Python model keeps every request's K/V per layer and predicts, from the block accounting
of ``flashdec._blocks`` alone, which reservations fit each group's pool. After every step the
cache's invariants hold, every group holds exactly the blocks the window rule allows, free
counts match the model, and every position a future decode reads holds the bytes written for
it. Steps fail at random layers (the writer stores part of a layer, then raises): abort leaves
the cache bit-identical to before the step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flashdec._blocks import blocks_for_tokens, held_block_range, lifetime_blocks
from flashdec.cache import KVGroupSpec, PagedKVCache
from flashdec.cache.token_steps import torch_scatter
from tests.cache.helpers import request_first_block
from tests.cache.snapshot import assert_same_state, snapshot
from tests.profiles import examples

SEEDS = st.integers(0, 2**16)

group_specs = st.builds(
    KVGroupSpec,
    kv_size=st.just(2),
    num_blocks=st.integers(3, 24),
    block_size=st.integers(1, 4),
    num_kv_heads=st.integers(1, 2),
    head_dim=st.sampled_from([2, 4]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    layer_count=st.integers(1, 2),
    window=st.one_of(st.none(), st.integers(1, 7)),
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


class Injected(Exception):
    pass


class GroupedCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.tokens: dict[object, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.state: dict[object, str] = {}
        self.next_rid = 0

    @initialize(
        groups=st.lists(group_specs, min_size=1, max_size=3),
        data=st.data(),
        prefixes=st.sampled_from([False, False, True]),
    )
    def setup(self, groups, data, prefixes):
        if prefixes:  # shared prefixes: full-attention groups of one block size
            groups = [
                dataclasses.replace(g, window=None, block_size=groups[0].block_size) for g in groups
            ]
        order = [g for g, spec in enumerate(groups) for _ in range(spec.layer_count)]
        order = data.draw(st.permutations(order))
        full = [s.num_blocks * s.block_size for s in groups if s.window is None]
        top = min([24, *full])
        longest = data.draw(st.integers(min(8, top), top))
        capacity = data.draw(st.integers(1, min(g.num_blocks for g in groups))) if prefixes else 0
        self.cache = PagedKVCache(
            groups,
            layer_groups=order,
            device="cpu",
            max_seq_len=longest,
            prefix_cache_capacity_blocks=capacity,
        )
        self.gen = torch.Generator().manual_seed(data.draw(SEEDS))
        self.prefix_tokens: dict[object, list] = {}  # registered prefixes' tokens, per layer

    # ---- model ----------------------------------------------------------------------------
    def spec_of(self, layer: int) -> KVGroupSpec:
        return self.cache.kv_groups[self.cache.layout.layer_group(layer)]

    def rows(self, layer: int, count: int) -> torch.Tensor:
        spec = self.spec_of(layer)
        shape = (count, spec.num_kv_heads, spec.head_dim)
        return torch.randn(shape, generator=self.gen).to(spec.dtype)

    def active(self) -> list:
        return [rid for rid, s in self.state.items() if s == "active"]

    def length(self, rid) -> int:
        return len(self.tokens[rid])

    def held(self, g: int, rid) -> int:
        spec = self.cache.kv_groups[g]
        return blocks_for_tokens(self.length(rid), spec.block_size, spec.window)

    def free(self, g: int) -> int:
        cache = self.cache
        used = sum(self.held(g, r) - self.prefix_blocks(r) for r in self.active())
        used += sum(cache.prefix_state(p, group=g).num_blocks for p in cache.prefix_ids())
        return cache.kv_groups[g].num_blocks - used

    def prefix_blocks(self, rid) -> int:
        pid = self.cache.request_prefix(rid)
        return 0 if pid is None else self.cache.prefix_state(pid).num_blocks

    def new_blocks(self, g: int, rid, count: int) -> int:
        """Blocks a reservation of ``count`` tokens takes in group ``g``: the blocks of the
        tokens it stores that the request does not hold yet."""
        spec = self.cache.kv_groups[g]
        bs, start = spec.block_size, self.length(rid)
        keep, end = held_block_range(start + count, bs, spec.window)
        stored = {p // bs for p in range(start, start + count) if p // bs >= min(keep, end - 1)}
        first, held_end = held_block_range(start, bs, spec.window)
        return len(stored - set(range(first, held_end)))

    def expected_error(self, rids, counts):
        for g, spec in enumerate(self.cache.kv_groups):
            width = self.cache.layout.group_max_blocks_per_seq(g)
            for rid, n in zip(rids, counts, strict=True):
                if -(-(self.length(rid) + n) // spec.block_size) > width:
                    return "is full"
            need = sum(self.new_blocks(g, r, n) for r, n in zip(rids, counts, strict=True))
            if need > self.free(g):
                return "out of KV blocks"
        return None

    # ---- rules ----------------------------------------------------------------------------
    @precondition(lambda self: self.cache is not None)
    @rule()
    def add_request(self):
        rid = self.next_rid
        self.next_rid += 1
        self.cache.add_request(rid)
        self.tokens[rid] = []
        self.state[rid] = "active"

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data())
    def finish_request(self, data):
        if not self.active():
            self.add_request()
            return
        rid = data.draw(st.sampled_from(self.active()))
        self.cache.finish_request(rid)
        self.state[rid] = "finished"

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data(), prompt=st.booleans(), fail=st.booleans())
    def transaction(self, data, prompt, fail):
        cache = self.cache
        if not self.active():
            self.add_request()
        rids = data.draw(
            st.lists(st.sampled_from(self.active()), min_size=1, max_size=3, unique=True)
        )
        counts = [data.draw(st.integers(1, 9)) if prompt else 1 for _ in rids]
        begin = (
            (lambda: cache.begin_tokens(rids, counts))
            if prompt
            else (lambda: cache.begin_token(rids))
        )
        error = self.expected_error(rids, counts)
        before = snapshot(cache)
        if error is not None:
            try:
                begin()
            except RuntimeError as err:
                assert error in str(err)
            else:
                raise AssertionError(f"expected RuntimeError {error!r}")
            assert_same_state(cache, before)
            return
        tx = begin()
        for g, spec in enumerate(cache.kv_groups):  # held + reserved stays within the lifetime
            for rid, n in zip(rids, counts, strict=True):
                total = self.length(rid) + n
                bound = lifetime_blocks(total, spec.block_size, spec.window)
                if not prompt:
                    during = len(cache.request_block_ids(rid, group=g)) + self.new_blocks(g, rid, 1)
                    assert during <= bound
        fail_at = data.draw(st.integers(0, cache.num_layers - 1)) if fail else None
        total = sum(counts)
        written = []
        for layer in range(cache.num_layers):
            k, v = self.rows(layer, total), self.rows(layer, total)
            if layer == fail_at:

                def partial(k_layer, v_layer, slots, k=k, v=v):
                    torch_scatter(k_layer, v_layer, k, v, slots)  # stores, then fails
                    raise Injected

                with contextlib.suppress(Injected):
                    cache.write_token_layer_with(tx, layer, partial)
                cache.abort_token(tx)
                after = snapshot(cache)
                for key in ("requests", "num_free_blocks", "prefixes"):
                    assert after[key] == before[key], key
                storage = ("k", "v") if "k" in before else ("kv",)
                for key in storage:
                    old, new = before[key], after[key]
                    pairs = zip(old, new, strict=True) if key == "kv" else [(old, new)]
                    assert all(torch.equal(a, b) for a, b in pairs), "abort left bytes changed"
                return
            cache.write_token_layer(tx, layer, k, v)
            written.append((k, v))
        cache.commit_token(tx)
        row = 0
        for rid, n in zip(rids, counts, strict=True):
            for t in range(row, row + n):
                self.tokens[rid].append([(k[t], v[t]) for k, v in written])
            row += n

    @precondition(lambda self: self.cache is not None and self.cache.prefix_cache_capacity_blocks)
    @rule(data=st.data(), op=st.sampled_from(["register", "attach", "evict"]))
    def prefix_op(self, data, op):
        if op == "register" or not self.cache.prefix_ids():
            self.register_prefix(data.draw(st.integers(1, 3)))
        elif op == "attach":
            self.attach_prefix(data)
        else:
            self.evict_prefix(data)

    def register_prefix(self, num_blocks):
        cache = self.cache
        pid = f"p{self.next_rid}"
        self.next_rid += 1
        k, v, tokens = [], [], []
        bs = cache.kv_groups[0].block_size
        for spec in cache.kv_groups:
            shape = (spec.layer_count, num_blocks, spec.num_kv_heads, bs, spec.head_dim)
            k.append(torch.randn(shape, generator=self.gen).to(spec.dtype))
            v.append(torch.randn(shape, generator=self.gen).to(spec.dtype))
        for t in range(num_blocks * bs):
            per_layer = []
            for layer in range(cache.num_layers):
                g = cache.layout.layer_group(layer)
                local = cache.layout.group_layers(g).index(layer)
                per_layer.append((k[g][local, t // bs, :, t % bs], v[g][local, t // bs, :, t % bs]))
            tokens.append(per_layer)
        before = snapshot(cache)
        try:
            cache.register_prefix(pid, k, v)
        except (RuntimeError, ValueError):  # over the budget or the pool, or too long
            assert_same_state(cache, before)
            return
        self.prefix_tokens[pid] = tokens

    def attach_prefix(self, data):
        cache = self.cache
        pid = data.draw(st.sampled_from(cache.prefix_ids()))
        rid = self.next_rid
        self.next_rid += 1
        cache.add_request(rid)
        self.state[rid] = "active"
        cache.attach_prefix(rid, pid)
        self.tokens[rid] = list(self.prefix_tokens[pid])
        if len(cache.kv_groups) > 1:
            event("a prefix attached across several groups")

    def evict_prefix(self, data):
        cache = self.cache
        pid = data.draw(st.sampled_from(cache.prefix_ids()))
        if cache.prefix_state(pid).refcount:
            before = snapshot(cache)
            try:
                cache.evict_prefix(pid)
            except RuntimeError:
                assert_same_state(cache, before)
                return
            raise AssertionError("evicted a prefix in use")
        cache.evict_prefix(pid)

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def cache_matches_model(self):
        cache = self.cache
        if cache is None:
            return
        cache.validate_invariants()
        groups = cache.metrics()["groups"]
        for g in range(len(cache.kv_groups)):
            assert cache.layout.group_free_blocks(g) == self.free(g) == groups[g]["num_free_blocks"]
            for rid in self.active():
                assert len(cache.request_block_ids(rid, group=g)) == self.held(g, rid)
                if request_first_block(cache, rid, group=g):
                    event("a window group released blocks")
        for rid in self.active():
            assert cache.seq_len(rid) == self.length(rid)
            self.check_readable(rid)
        for pid in cache.prefix_ids():  # every group's registry holds the same prefixes
            states = [cache.prefix_state(pid, group=g) for g in range(len(cache.kv_groups))]
            assert len({(s.num_blocks, s.refcount, s.last_used) for s in states}) == 1

    def check_readable(self, rid) -> None:
        cache = self.cache
        length = self.length(rid)
        for layer in range(cache.num_layers):
            g = cache.layout.layer_group(layer)
            spec = cache.kv_groups[g]
            start = 0 if spec.window is None else max(0, length + 1 - spec.window)
            if start >= length:
                continue
            table = cache.block_tables([rid], group=g)[0].long()
            t = torch.arange(start, length)
            blocks, offsets = table[t // spec.block_size], t % spec.block_size
            k_layer, v_layer = cache.layout.layer_kv(layer)
            want_k = torch.stack([self.tokens[rid][p][layer][0] for p in range(start, length)])
            want_v = torch.stack([self.tokens[rid][p][layer][1] for p in range(start, length)])
            assert torch.equal(_bits(k_layer[blocks, :, offsets]), _bits(want_k))
            assert torch.equal(_bits(v_layer[blocks, :, offsets]), _bits(want_v))


TestGroupedCacheStateful = pytest.mark.large(GroupedCacheMachine.TestCase)
TestGroupedCacheStateful.settings = settings(
    max_examples=examples(300, ci=60),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
