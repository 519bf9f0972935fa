"""Random operation sequences against a pure-Python model of the cache (hypothesis).

The model keeps what the cache must know — each request's state, prefix and the K/V of every
committed token, each prefix's blocks, refcount and LRU clock, the open transaction — and
predicts which calls succeed and which raise. After every step the cache's invariants are
validated and every committed token is read back through ``block_tables`` / ``seq_lens`` and
compared bitwise with the model. A rejected call must leave the full snapshot unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flashdec.cache import PagedKVCache
from flashdec.reference import dense_decode_attention_ref, paged_decode_attention_ref
from tests.cache.snapshot import assert_same_state, snapshot
from tests.profiles import examples

SEEDS = st.integers(0, 2**16)
RARELY = st.sampled_from([False] * 5 + [True])  # a deliberate mistake now and then


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@dataclass
class ModelRequest:
    state: str = "active"
    prefix: object = None
    num_prefix_blocks: int = 0
    tokens: list = field(default_factory=list)  # per token: (k [L, H, D], v [L, H, D])


@dataclass
class ModelPrefix:
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    refcount: int
    last_used: int

    @property
    def num_blocks(self) -> int:
        return self.k_blocks.shape[1]


@dataclass
class ModelTx:
    handle: object
    rids: list
    reserved: int
    layers: list = field(default_factory=list)  # per written layer: (k [B, H, D], v [B, H, D])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.requests: dict[object, ModelRequest] = {}
        self.prefixes: dict[object, ModelPrefix] = {}
        self.clock = 0
        self.tx: ModelTx | None = None
        self.closed: list[tuple[object, str]] = []  # recent closed handles and their final state
        self.next_rid = 0
        self.next_pid = 0

    # ---- set-up and helpers ---------------------------------------------------------------
    @initialize(
        num_layers=st.integers(1, 2),
        num_kv_heads=st.integers(1, 2),
        head_dim=st.sampled_from([4, 8]),
        block_size=st.integers(2, 4),
        max_blocks=st.integers(4, 16),
        dtype=st.sampled_from([torch.float32, torch.float16]),
        capacity=st.integers(0, 6),
        width=st.integers(2, 6),
    )
    def setup(
        self, num_layers, num_kv_heads, head_dim, block_size, max_blocks, dtype, capacity, width
    ):
        self.cache = PagedKVCache(
            num_layers,
            num_kv_heads,
            head_dim,
            block_size,
            max_blocks,
            dtype=dtype,
            device="cpu",
            prefix_cache_capacity_blocks=min(capacity, max_blocks),
            max_blocks_per_seq=min(width, max_blocks),
        )

    def rand(self, shape, seed) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen).to(self.cache.dtype)

    def kv(self, batch, seed) -> torch.Tensor:
        return self.rand((batch, self.cache.num_kv_heads, self.cache.head_dim), seed)

    def expect(self, exc, call):
        """Run ``call``; when the model predicts a rejection, check it and that nothing moved."""
        if exc is None:
            return call()
        before = snapshot(self.cache)
        try:
            call()
        except exc:
            pass
        else:
            raise AssertionError(f"expected {exc.__name__}")
        assert_same_state(self.cache, before)
        return None

    def active(self) -> list:
        return [rid for rid, r in self.requests.items() if r.state == "active"]

    def blocks_needed(self, rids) -> int:
        bs = self.cache.block_size
        return sum(len(self.requests[r].tokens) % bs == 0 for r in rids)

    def num_free(self) -> int:
        bs = self.cache.block_size
        used = sum(p.num_blocks for p in self.prefixes.values())
        for r in self.requests.values():
            if r.state == "active":
                used += -(-len(r.tokens) // bs) - r.num_prefix_blocks
        if self.tx is not None:
            used += self.tx.reserved
        return self.cache.max_blocks - used

    def slot_error(self, rids):
        """The error a one-token reservation for ``rids`` must raise, or None."""
        if any(self.requests[r].state != "active" for r in rids):
            return RuntimeError
        if self.tx is not None:
            return RuntimeError
        width = self.cache.max_blocks_per_seq * self.cache.block_size
        if any(len(self.requests[r].tokens) >= width for r in rids):
            return RuntimeError
        if self.blocks_needed(rids) > self.num_free():
            return RuntimeError
        return None

    def pick_batch(self, data) -> list:
        any_state = data.draw(RARELY) or not self.active()
        pool = list(self.requests) if any_state else self.active()
        rids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        return rids

    def touch(self, prefix: ModelPrefix) -> None:
        self.clock += 1
        prefix.last_used = self.clock

    # ---- lifecycle ------------------------------------------------------------------------
    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data(), as_str=st.booleans(), existing=RARELY)
    def add_request(self, data, as_str, existing):
        if existing and self.requests:
            rid = data.draw(st.sampled_from(list(self.requests)))
            self.expect(ValueError, lambda: self.cache.add_request(rid))
            return
        rid = f"r{self.next_rid}" if as_str else self.next_rid
        self.next_rid += 1
        error = RuntimeError if self.tx is not None else None
        self.expect(error, lambda: self.cache.add_request(rid))
        if error is None:
            self.requests[rid] = ModelRequest()

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), cancel=st.booleans())
    def end_request(self, data, cancel):
        rid = data.draw(st.sampled_from(list(self.requests)))
        req = self.requests[rid]
        error = RuntimeError if self.tx is not None or req.state != "active" else None
        call = self.cache.cancel_request if cancel else self.cache.finish_request
        self.expect(error, lambda: call(rid))
        if error is None:
            if req.prefix is not None:
                self.prefixes[req.prefix].refcount -= 1
                self.touch(self.prefixes[req.prefix])
            req.state = "cancelled" if cancel else "finished"
            req.prefix, req.num_prefix_blocks = None, 0
            # a terminal request keeps its final length but no bytes are readable any more
            req.tokens = [None] * len(req.tokens)

    # ---- appends and transactions ------------------------------------------------------------
    @precondition(lambda self: self.cache is not None and self.cache.num_layers == 1)
    @precondition(lambda self: self.requests)
    @rule(data=st.data(), seed=SEEDS, duplicate=RARELY)
    def append(self, data, seed, duplicate):
        rids = self.pick_batch(data)
        if duplicate:
            rids = [*rids, rids[0]]
        k, v = self.kv(len(rids), seed), self.kv(len(rids), seed + 1)
        error = ValueError if duplicate else self.slot_error(rids)
        self.expect(error, lambda: self.cache.append(rids, k, v))
        if error is None:
            for row, rid in enumerate(rids):
                self.requests[rid].tokens.append((k[row][None], v[row][None]))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), duplicate=RARELY)
    def begin_token(self, data, duplicate):
        rids = self.pick_batch(data)
        if duplicate:
            rids = [*rids, rids[-1]]
        error = ValueError if duplicate else self.slot_error(rids)
        reserved = self.blocks_needed(rids) if error is None else 0
        handle = self.expect(error, lambda: self.cache.begin_token(rids))
        if error is None:
            assert handle.positions.tolist() == [len(self.requests[r].tokens) for r in rids]
            self.tx = ModelTx(handle, rids, reserved)

    @precondition(lambda self: self.tx is None and self.active())
    @rule(data=st.data(), seed=SEEDS, abort_at=st.integers(0, 4))
    def token_step(self, data, seed, abort_at):
        """A whole engine step: begin, every layer in order, then commit (or abort part-way)."""
        rids = data.draw(
            st.lists(st.sampled_from(self.active()), min_size=1, max_size=4, unique=True)
        )
        error = self.slot_error(rids)
        if error is not None:
            self.expect(error, lambda: self.cache.begin_token(rids))
            return
        self.tx = ModelTx(self.cache.begin_token(rids), rids, self.blocks_needed(rids))
        for layer in range(self.cache.num_layers):
            if layer == abort_at:
                self.abort()
                return
            k, v = self.kv(len(rids), seed + 2 * layer), self.kv(len(rids), seed + 2 * layer + 1)
            self.cache.write_token_layer(self.tx.handle, layer, k, v)
            self.tx.layers.append((k, v))
        self.commit()

    @precondition(lambda self: self.tx is not None)
    @rule(
        seed=SEEDS,
        mistake=st.sampled_from([None] * 6 + ["ahead", "behind", "dtype"]),
        by_id=st.booleans(),
    )
    def write_layer(self, seed, mistake, by_id):
        tx = self.tx
        layer = len(tx.layers) + {"ahead": 1, "behind": -1}.get(mistake, 0)
        handle = tx.handle.transaction_id if by_id else tx.handle
        k, v = self.kv(len(tx.rids), seed), self.kv(len(tx.rids), seed + 1)
        if mistake == "dtype":
            k = k.to(torch.float16 if self.cache.dtype == torch.float32 else torch.float32)
        if not 0 <= layer < self.cache.num_layers:
            error = ValueError
        elif mistake in ("ahead", "behind") or len(tx.layers) == self.cache.num_layers:
            error = RuntimeError
        elif mistake == "dtype":
            error = TypeError
        else:
            error = None
        self.expect(error, lambda: self.cache.write_token_layer(handle, layer, k, v))
        if error is None:
            tx.layers.append((k, v))

    @precondition(lambda self: self.tx is not None)
    @rule()
    def commit(self):
        tx = self.tx
        if len(tx.layers) < self.cache.num_layers:
            self.expect(RuntimeError, lambda: self.cache.commit_token(tx.handle))
            return
        view = self.cache.commit_token(tx.handle)
        for row, rid in enumerate(tx.rids):
            k = torch.stack([layer_k[row] for layer_k, _ in tx.layers])
            v = torch.stack([layer_v[row] for _, layer_v in tx.layers])
            self.requests[rid].tokens.append((k, v))
        assert view.seq_lens.tolist() == [len(self.requests[r].tokens) for r in tx.rids]
        self.closed.append((tx.handle, "committed"))
        self.tx = None

    @precondition(lambda self: self.tx is not None)
    @rule()
    def abort(self):
        self.cache.abort_token(self.tx.handle)
        self.closed.append((self.tx.handle, "aborted"))
        self.tx = None

    @precondition(lambda self: self.closed)
    @rule(data=st.data(), commit=st.booleans())
    def reuse_closed_handle(self, data, commit):
        handle, state = data.draw(st.sampled_from(self.closed[-8:]))
        call = self.cache.commit_token if commit else self.cache.abort_token
        before = snapshot(self.cache)
        try:
            call(handle)
        except RuntimeError as err:
            assert f"already {state}" in str(err)
        else:
            raise AssertionError("a closed transaction was accepted again")
        assert_same_state(self.cache, before)

    # ---- shared prefixes ----------------------------------------------------------------------
    @precondition(lambda self: self.cache is not None and len(self.prefixes) < 4)
    @rule(num_blocks=st.integers(1, 3), seed=SEEDS, reuse=RARELY)
    def register_prefix(self, num_blocks, seed, reuse):
        cache = self.cache
        if reuse and self.prefixes:
            pid = next(iter(self.prefixes))
        else:
            pid = f"p{self.next_pid}" if self.next_pid % 2 else self.next_pid
            self.next_pid += 1
        shape = (cache.num_layers, num_blocks, cache.num_kv_heads, cache.block_size, cache.head_dim)
        kb, vb = self.rand(shape, seed), self.rand(shape, seed + 1)
        error, victims = self.plan_register(pid, num_blocks)
        self.expect(error, lambda: cache.register_prefix(pid, kb, vb))
        if error is None:
            for victim in victims:
                del self.prefixes[victim]
            self.prefixes[pid] = ModelPrefix(kb, vb, 0, 0)
            self.touch(self.prefixes[pid])

    def plan_register(self, pid, num_blocks):
        capacity = self.cache.prefix_cache_capacity_blocks
        if num_blocks > self.cache.max_blocks_per_seq:
            return ValueError, []
        if self.tx is not None or capacity == 0:
            return RuntimeError, []
        if pid in self.prefixes:
            return ValueError, []
        if num_blocks > capacity:
            return RuntimeError, []
        budget = capacity - sum(p.num_blocks for p in self.prefixes.values())
        pool = self.num_free()
        victims = []
        inactive = sorted((p.last_used, q) for q, p in self.prefixes.items() if p.refcount == 0)
        for _, victim in inactive:
            if num_blocks <= min(budget, pool):
                break
            budget += self.prefixes[victim].num_blocks
            pool += self.prefixes[victim].num_blocks
            victims.append(victim)
        if num_blocks > min(budget, pool):
            return RuntimeError, []
        return None, victims

    @precondition(lambda self: self.requests and self.next_pid)
    @rule(data=st.data())
    def attach_prefix(self, data):
        rid = data.draw(st.sampled_from(list(self.requests)))
        pid = data.draw(
            st.sampled_from([p if p % 2 == 0 else f"p{p}" for p in range(self.next_pid)])
        )
        req = self.requests[rid]
        if pid not in self.prefixes:
            error = ValueError
        elif self.tx is not None or req.state != "active" or req.tokens or req.prefix is not None:
            error = RuntimeError
        else:
            error = None
        self.expect(error, lambda: self.cache.attach_prefix(rid, pid))
        if error is None:
            prefix = self.prefixes[pid]
            bs = self.cache.block_size
            req.prefix, req.num_prefix_blocks = pid, prefix.num_blocks
            for t in range(prefix.num_blocks * bs):
                req.tokens.append(
                    (prefix.k_blocks[:, t // bs, :, t % bs], prefix.v_blocks[:, t // bs, :, t % bs])
                )
            prefix.refcount += 1
            self.touch(prefix)

    @precondition(lambda self: self.next_pid)
    @rule(data=st.data())
    def evict_prefix(self, data):
        pid = data.draw(
            st.sampled_from([p if p % 2 == 0 else f"p{p}" for p in range(self.next_pid)])
        )
        if pid not in self.prefixes:
            error = ValueError
        elif self.tx is not None or self.prefixes[pid].refcount > 0:
            error = RuntimeError
        else:
            error = None
        self.expect(error, lambda: self.cache.evict_prefix(pid))
        if error is None:
            del self.prefixes[pid]

    # ---- reading back -------------------------------------------------------------------------
    @invariant()
    def decode_matches_dense_reference(self):
        """The paged reference over the cache equals the dense reference over the model."""
        rids = self.active()
        cache = self.cache
        if cache is None or not rids:
            return
        seed = len(self.requests)
        lens = cache.seq_lens_tensor(rids)
        max_len = max(1, int(lens.max()))
        dense_k = torch.zeros(
            len(rids), max_len, cache.num_kv_heads, cache.head_dim, dtype=cache.dtype
        )
        dense_v = torch.zeros_like(dense_k)
        for b, rid in enumerate(rids):
            for t, (k, v) in enumerate(self.requests[rid].tokens):
                dense_k[b, t], dense_v[b, t] = k[0], v[0]
        q = self.rand((len(rids), 2 * cache.num_kv_heads, cache.head_dim), seed)
        k_layer, v_layer = cache.layout.layer_kv(0)
        out = paged_decode_attention_ref(q, k_layer, v_layer, cache.block_tables(rids), lens)
        expected = dense_decode_attention_ref(q, dense_k, dense_v, lens)
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)

    @invariant()
    def cache_matches_model(self):
        cache = self.cache
        if cache is None:
            return
        cache.validate_invariants()
        assert cache.request_ids() == list(self.requests)
        for rid, req in self.requests.items():
            assert cache.request_state(rid) == req.state
            assert cache.request_prefix(rid) == req.prefix
            assert cache.seq_len(rid) == len(req.tokens)
        assert cache.prefix_ids() == list(self.prefixes)
        for pid, prefix in self.prefixes.items():
            state = cache.prefix_state(pid)
            assert (state.refcount, state.num_blocks) == (prefix.refcount, prefix.num_blocks)
        assert cache.num_free_blocks == self.num_free()
        m = cache.metrics()
        assert m["retained_transaction_state_count"] == (self.tx is not None)
        assert m["num_active_requests"] == len(self.active())
        assert m["prefix_refcount_total"] == sum(p.refcount for p in self.prefixes.values())
        # every committed token reads back bit for bit through block_tables / seq_lens
        rids = self.active()
        if not rids:
            return
        tables = cache.block_tables(rids).long()
        lens = cache.seq_lens_tensor(rids).tolist()
        bs = cache.block_size
        for b, rid in enumerate(rids):
            toks = self.requests[rid].tokens
            if not toks:
                continue
            t = torch.arange(lens[b])
            blocks, offsets = tables[b, t // bs], t % bs
            got_k = cache.k_cache[:, blocks, :, offsets]  # [T, L, Hkv, D]
            got_v = cache.v_cache[:, blocks, :, offsets]
            want_k = torch.stack([k for k, _ in toks])
            want_v = torch.stack([v for _, v in toks])
            assert torch.equal(_bits(got_k), _bits(want_k)), f"K of {rid!r} changed"
            assert torch.equal(_bits(got_v), _bits(want_v)), f"V of {rid!r} changed"


TestPagedKVCacheStateful = pytest.mark.large(CacheMachine.TestCase)
TestPagedKVCacheStateful.settings = settings(
    max_examples=examples(60, ci=15),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
