"""Every kind of rejected call raises the agreed error and changes nothing observable.

Each case runs against a populated cache (active, full, finished, cancelled and prefix-attached
requests; a resident prefix) and compares a full snapshot — metrics, version, every request and
prefix, the open transaction and the K/V bytes — before and after the call.
"""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache
from flashdec.engine.layer_ops import rope_paged_kv_append
from tests.cache.snapshot import assert_rejected
from tests.cache.util import commit_token, make_cache, prefix_blocks, tokens


def populated(num_layers: int, open_tx: bool = False) -> PagedKVCache:
    """Requests: a (3 tokens), b (2 tokens, block full), e (empty), f finished, x cancelled,
    u attached to prefix p (block full), w attached to p; 2 free blocks (of 7)."""
    cache = make_cache(
        num_layers=num_layers, block_size=2, max_blocks=7, prefix_cache_capacity_blocks=2
    )
    blocks = prefix_blocks(cache, 1, 0)
    cache.register_prefix("p", blocks, blocks)
    for rid in ("a", "b", "e", "f", "x", "u", "w"):
        cache.add_request(rid)
    cache.attach_prefix("u", "p")
    cache.attach_prefix("w", "p")
    for step, batch in enumerate([["a", "b", "f", "x"], ["a", "b", "f"], ["a"]]):
        commit_token(cache, batch, seed=step)
    commit_token(cache, ["w"], seed=9)
    cache.finish_request("f")
    cache.cancel_request("x")
    assert cache.num_free_blocks == 2
    if open_tx:
        tx = cache.begin_token(["a", "e"])  # e takes one block
        cache.write_token_layer(tx, 0, tokens(cache, 2, 5), tokens(cache, 2, 6))
    cache.validate_invariants()
    return cache


def kv(cache, batch, **kw):
    t = tokens(cache, batch, 1)
    return t.to(**kw) if kw else t


META = torch.device("meta")  # a second device that exists on any machine

APPEND_CASES = [
    # (id, call, exception, message)
    (
        "duplicate-id",
        lambda c: c.append(["a", "a"], kv(c, 2), kv(c, 2)),
        ValueError,
        "more than once",
    ),
    (
        "unknown-id",
        lambda c: c.append(["a", "zz"], kv(c, 2), kv(c, 2)),
        ValueError,
        "unknown request id 'zz'",
    ),
    (
        "finished",
        lambda c: c.append(["a", "f"], kv(c, 2), kv(c, 2)),
        RuntimeError,
        "it is finished",
    ),
    ("cancelled", lambda c: c.append(["x"], kv(c, 1), kv(c, 1)), RuntimeError, "it is cancelled"),
    (
        "capacity",
        lambda c: c.append(["b", "u", "w", "e"], kv(c, 4), kv(c, 4)),
        RuntimeError,
        "needs 3 new block",
    ),
    (
        "k-dtype",
        lambda c: c.append(["a"], kv(c, 1, dtype=torch.float16), kv(c, 1)),
        TypeError,
        "dtype",
    ),
    (
        "v-dtype",
        lambda c: c.append(["a"], kv(c, 1), kv(c, 1, dtype=torch.bfloat16)),
        TypeError,
        "dtype",
    ),
    (
        "k-device",
        lambda c: c.append(["a"], kv(c, 1, device=META), kv(c, 1)),
        TypeError,
        "must be on cpu",
    ),
    (
        "k-batch",
        lambda c: c.append(["a", "b"], kv(c, 1), kv(c, 2)),
        ValueError,
        r"shape \(2, 2, 4\)",
    ),
    ("v-heads", lambda c: c.append(["a"], kv(c, 1), tokens(c, 1, 0, heads=1)), ValueError, "shape"),
    ("k-rank", lambda c: c.append(["a"], kv(c, 1)[0], kv(c, 1)), ValueError, "3-D"),
    ("k-type", lambda c: c.append(["a"], [[0.0]], kv(c, 1)), TypeError, "torch.Tensor"),
    ("empty", lambda c: c.append([], kv(c, 0), kv(c, 0)), ValueError, "must not be empty"),
    ("ids-str", lambda c: c.append("a", kv(c, 1), kv(c, 1)), TypeError, "list or tuple"),
    ("id-bool", lambda c: c.append([True], kv(c, 1), kv(c, 1)), TypeError, "str or an int"),
    (
        "rope-backend",
        lambda c: rope_paged_kv_append(
            c, 0, ["a"], tokens(c, 1, 0, heads=4), kv(c, 1), kv(c, 1), None, append_backend="cuda"
        ),
        ValueError,
        "append_backend",
    ),
    (
        "rope-rotary",
        lambda c: rope_paged_kv_append(
            c, 0, ["a"], tokens(c, 1, 0, heads=4), kv(c, 1), kv(c, 1), 3
        ),
        ValueError,
        "rotary_dim",
    ),
    (
        "rope-q-heads",
        lambda c: rope_paged_kv_append(
            c, 0, ["a"], tokens(c, 1, 0, heads=3), kv(c, 1), kv(c, 1), None
        ),
        ValueError,
        "multiple of num_kv_heads",
    ),
    (
        "rope-layer",
        lambda c: rope_paged_kv_append(
            c, 1, ["a"], tokens(c, 1, 0, heads=4), kv(c, 1), kv(c, 1), None
        ),
        ValueError,
        "layer_idx must be 0",
    ),
    (
        "rope-capacity",
        lambda c: rope_paged_kv_append(
            c, 0, ["b", "u", "w", "e"], tokens(c, 4, 0, heads=2), kv(c, 4), kv(c, 4), None
        ),
        RuntimeError,
        "out of KV blocks",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "match"), [c[1:] for c in APPEND_CASES], ids=[c[0] for c in APPEND_CASES]
)
def test_rejected_append_changes_nothing(call, exc, match):
    cache = populated(num_layers=1)
    assert_rejected(cache, exc, match, lambda: call(cache))


LIFECYCLE_CASES = [
    ("add-duplicate", lambda c: c.add_request("a"), ValueError, "already exists"),
    ("add-reused", lambda c: c.add_request("f"), ValueError, "not reused"),
    ("add-float", lambda c: c.add_request(1.0), TypeError, "str or an int"),
    ("finish-unknown", lambda c: c.finish_request("zz"), ValueError, "unknown request"),
    ("finish-twice", lambda c: c.finish_request("f"), RuntimeError, "it is finished"),
    ("cancel-cancelled", lambda c: c.cancel_request("x"), RuntimeError, "it is cancelled"),
    ("state-unknown", lambda c: c.request_state(7), ValueError, "unknown request"),
    ("tables-unknown", lambda c: c.block_tables(["a", "zz"]), ValueError, "unknown request"),
    ("lens-finished", lambda c: c.seq_lens_tensor(["f"]), RuntimeError, "it is finished"),
    ("begin-duplicate", lambda c: c.begin_token(["a", "b", "a"]), ValueError, "more than once"),
    ("begin-unknown", lambda c: c.begin_token(["zz"]), ValueError, "unknown request"),
    ("begin-finished", lambda c: c.begin_token(["a", "f"]), RuntimeError, "it is finished"),
    (
        "begin-capacity",
        lambda c: c.begin_token(["b", "u", "w", "e"]),
        RuntimeError,
        "needs 3 new block",
    ),
    ("begin-empty", lambda c: c.begin_token(()), ValueError, "must not be empty"),
    ("begin-pad-small", lambda c: c.begin_token(["a", "b"], pad_to=1), ValueError, "pad_to"),
    ("begin-pad-type", lambda c: c.begin_token(["a"], pad_to=1.5), TypeError, "pad_to"),
    ("tokens-count-len", lambda c: c.begin_tokens(["a", "b"], [1]), ValueError, "1 entries"),
    ("tokens-count-zero", lambda c: c.begin_tokens(["a"], [0]), ValueError, "num_tokens"),
    ("tokens-count-type", lambda c: c.begin_tokens(["a"], 3), TypeError, "num_tokens"),
    (
        "tokens-capacity",
        lambda c: c.begin_tokens(["a", "b"], [4, 4]),
        RuntimeError,
        "out of KV blocks",
    ),
    (
        "tokens-full",
        lambda c: c.begin_tokens(["a"], [10_000]),
        RuntimeError,
        "max_blocks_per_seq",
    ),
    (
        "register-duplicate",
        lambda c: c.register_prefix("p", prefix_blocks(c, 1, 0), prefix_blocks(c, 1, 0)),
        ValueError,
        "already registered",
    ),
    (
        "register-too-big",
        lambda c: c.register_prefix("q", prefix_blocks(c, 3, 0), prefix_blocks(c, 3, 0)),
        RuntimeError,
        "capacity",
    ),
    (
        "register-no-room",
        lambda c: c.register_prefix("q", prefix_blocks(c, 2, 0), prefix_blocks(c, 2, 0)),
        RuntimeError,
        "even after evicting",
    ),
    (
        "register-dtype",
        lambda c: c.register_prefix("q", prefix_blocks(c, 1, 0).half(), prefix_blocks(c, 1, 0)),
        TypeError,
        "dtype",
    ),
    (
        "register-device",
        lambda c: c.register_prefix("q", prefix_blocks(c, 1, 0), prefix_blocks(c, 1, 0).to(META)),
        TypeError,
        "must be on cpu",
    ),
    (
        "register-shape",
        lambda c: c.register_prefix("q", prefix_blocks(c, 1, 0)[:, :, :1], prefix_blocks(c, 1, 0)),
        ValueError,
        "shape",
    ),
    (
        "register-mismatch",
        lambda c: c.register_prefix("q", prefix_blocks(c, 1, 0), prefix_blocks(c, 2, 0)),
        ValueError,
        "shape",
    ),
    (
        "register-empty",
        lambda c: c.register_prefix("q", prefix_blocks(c, 0, 0), prefix_blocks(c, 0, 0)),
        ValueError,
        "at least one block",
    ),
    (
        "register-id",
        lambda c: c.register_prefix(None, prefix_blocks(c, 1, 0), prefix_blocks(c, 1, 0)),
        TypeError,
        "prefix_id",
    ),
    ("attach-unknown-request", lambda c: c.attach_prefix("zz", "p"), ValueError, "unknown request"),
    ("attach-unknown-prefix", lambda c: c.attach_prefix("e", "zz"), ValueError, "unknown prefix"),
    ("attach-nonempty", lambda c: c.attach_prefix("a", "p"), RuntimeError, "empty request"),
    ("attach-finished", lambda c: c.attach_prefix("f", "p"), RuntimeError, "it is finished"),
    ("evict-active", lambda c: c.evict_prefix("p"), RuntimeError, "used by 2 active"),
    ("evict-unknown", lambda c: c.evict_prefix("zz"), ValueError, "unknown prefix"),
    ("prefix-state-unknown", lambda c: c.prefix_state("zz"), ValueError, "unknown prefix"),
]


@pytest.mark.parametrize(
    ("call", "exc", "match"), [c[1:] for c in LIFECYCLE_CASES], ids=[c[0] for c in LIFECYCLE_CASES]
)
def test_rejected_lifecycle_and_prefix_calls_change_nothing(call, exc, match):
    cache = populated(num_layers=2)
    assert_rejected(cache, exc, match, lambda: call(cache))


def q4(c, b=2):
    return tokens(c, b, 3, heads=4)


TX_CASES = [
    (
        "layer-repeat",
        lambda c, t: c.write_token_layer(t, 0, kv(c, 2), kv(c, 2)),
        RuntimeError,
        "out of order",
    ),
    (
        "layer-range",
        lambda c, t: c.write_token_layer(t, 2, kv(c, 2), kv(c, 2)),
        ValueError,
        r"in \[0, 2\)",
    ),
    (
        "layer-type",
        lambda c, t: c.write_token_layer(t, 1.0, kv(c, 2), kv(c, 2)),
        TypeError,
        "layer_idx",
    ),
    ("k-shape", lambda c, t: c.write_token_layer(t, 1, kv(c, 1), kv(c, 2)), ValueError, "shape"),
    (
        "k-dtype",
        lambda c, t: c.write_token_layer(t, 1, kv(c, 2, dtype=torch.float16), kv(c, 2)),
        TypeError,
        "dtype",
    ),
    (
        "v-device",
        lambda c, t: c.write_token_layer(t, 1, kv(c, 2), kv(c, 2, device=META)),
        TypeError,
        "must be on cpu",
    ),
    (
        "handle-type",
        lambda c, t: c.write_token_layer("1", 1, kv(c, 2), kv(c, 2)),
        TypeError,
        "TokenTransactionView",
    ),
    (
        "handle-unknown",
        lambda c, t: c.write_token_layer(t.transaction_id + 1, 1, kv(c, 2), kv(c, 2)),
        RuntimeError,
        "unknown token transaction",
    ),
    (
        "with-out-of-order",
        lambda c, t: c.write_token_layer_with(t, 0, lambda *a: None),
        RuntimeError,
        "out of order",
    ),
    (
        "with-failing-writer",
        lambda c, t: c.write_token_layer_with(t, 1, lambda *a: 1 / 0),
        ZeroDivisionError,
        None,
    ),
    (
        "all-layers-after-one",
        lambda c, t: c.steps.write_all_layers_with(t, lambda: None),
        RuntimeError,
        "already has 1 layer",
    ),
    ("slots-type", lambda c, t: c.steps.transaction_slots("x"), TypeError, "TokenTransactionView"),
    ("commit-early", lambda c, t: c.commit_token(t), RuntimeError, "1 of 2 layers"),
    ("begin-second", lambda c, t: c.begin_token(["b"]), RuntimeError, "is open"),
    ("finish-in-tx", lambda c, t: c.finish_request("a"), RuntimeError, "is open"),
    ("view-type", lambda c, t: c.transaction_view(None), TypeError, "TokenTransactionView"),
]


@pytest.mark.parametrize(
    ("call", "exc", "match"), [c[1:] for c in TX_CASES], ids=[c[0] for c in TX_CASES]
)
def test_rejected_transaction_calls_leave_it_open_and_unchanged(call, exc, match):
    cache = populated(num_layers=2, open_tx=True)
    tx = cache.transaction_view(cache.steps.open_transaction_id)
    assert_rejected(cache, exc, match, lambda: call(cache, tx))
    # the transaction still completes normally
    cache.write_token_layer(tx, 1, kv(cache, 2), kv(cache, 2))
    cache.commit_token(tx)
    assert cache.seq_len("a") == 4 and cache.seq_len("e") == 1
    cache.validate_invariants()
