"""Snapshot of everything observable about a PagedKVCache, to prove a rejected call changed
nothing (metrics, version, every request and prefix, the open transaction, the K/V bytes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from flashdec.cache import PagedKVCache
from tests.cache.helpers import group_kv, request_first_block


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor so equality is bitwise (-0.0 != 0.0, NaN == NaN)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().cpu().contiguous().view(ints)


def snapshot(cache: PagedKVCache) -> dict[str, Any]:
    groups = range(len(cache.kv_groups))
    requests = {
        rid: (
            cache.request_state(rid),
            cache.seq_len(rid),
            [cache.request_block_ids(rid, group=g) for g in groups],
            [request_first_block(cache, rid, group=g) for g in groups],
            cache.request_prefix(rid),
        )
        for rid in cache.request_ids()
    }
    prefixes = {pid: cache.prefix_state(pid) for pid in cache.prefix_ids()}
    tx_id = cache.steps.open_transaction_id
    tx = None
    if tx_id is not None:
        view = cache.transaction_view(tx_id)
        metadata = [view.block_tables.flatten()]
        for g in groups:
            slots = cache.steps.transaction_slots(tx_id, group=g)
            metadata += [slots.positions, slots.block_ids, slots.offsets, slots.seq_lens_after]
        tx = (
            tx_id,
            cache.steps.layers_written(tx_id),
            cache.metrics()["num_reserved_blocks"],
            torch.cat(metadata).clone(),
        )
    state = {
        "version": cache.version,
        "metrics": cache.metrics(),
        "num_free_blocks": cache.num_free_blocks,
        "requests": requests,
        "prefixes": prefixes,
        "open_transaction_id": cache.steps.open_transaction_id,
        "tx": tx,
        "history": list(cache._tx.history),
    }
    storage = [_bits(t).clone() for g in groups for t in group_kv(cache, g)]
    if len(groups) == 1:  # the SPEC names of a single-group cache's storage
        state["k"], state["v"] = storage
    else:
        state["kv"] = storage
    return state


def assert_same_state(cache: PagedKVCache, before: dict[str, Any]) -> None:
    after = snapshot(cache)
    for key, old in before.items():
        new = after[key]
        if key in ("k", "v"):
            assert torch.equal(old, new), f"{key}_cache bytes changed"
        elif key == "kv":
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                assert torch.equal(a, b), f"group {i // 2} {'kv'[i % 2]} storage bytes changed"
        elif key == "tx":
            assert (old is None) == (new is None), "open transaction appeared/disappeared"
            if old is not None:
                assert old[:3] == new[:3], f"open transaction changed: {old[:3]} -> {new[:3]}"
                assert torch.equal(old[3], new[3]), "transaction metadata changed"
        else:
            assert old == new, f"{key} changed: {old!r} -> {new!r}"
    cache.validate_invariants()


def assert_rejected(
    cache: PagedKVCache,
    exc: type[BaseException],
    match: str | None,
    call: Callable[[], object],
) -> None:
    """``call`` raises ``exc`` (message matching ``match``) and the cache is left unchanged."""
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        call()
    assert_same_state(cache, before)
