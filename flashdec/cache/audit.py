"""What the cache reports about itself: ``PagedKVCache.metrics`` and
``PagedKVCache.validate_invariants``, computed from its parts (groups, request table,
transaction log). Reads only; never on a step's path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from flashdec._blocks import held_range
from flashdec.cache.allocator import CACHED
from flashdec.cache.layer_group import LayerGroup
from flashdec.cache.requests import RequestTable
from flashdec.cache.reservation import request_owner
from flashdec.cache.state import PrefixId, RequestId, RequestRecord, RequestState
from flashdec.cache.transaction import OpenTransaction, TransactionLog


def cache_metrics(
    groups: Sequence[LayerGroup], requests: RequestTable, tx: TransactionLog, version: int
) -> dict[str, Any]:
    """Counters (block counts summed over groups) and ``"groups"``: one dict per group."""
    terminal = requests.terminal
    open_tx = tx.open
    prefixes = groups[0].prefixes  # the groups' registries see the same calls
    per_group = [_group_metrics(group, requests.active, open_tx) for group in groups]
    num_prefix_blocks = sum(g["num_prefix_blocks"] for g in per_group)
    num_used = sum(g["num_used_blocks"] for g in per_group)
    return {
        "version": version,
        "num_blocks": sum(g["num_blocks"] for g in per_group),
        "num_free_blocks": sum(g["num_free_blocks"] for g in per_group),
        "num_used_blocks": num_used,
        "num_private_blocks": sum(g["num_private_blocks"] for g in per_group),
        "num_prefix_blocks": num_prefix_blocks,
        "num_cached_blocks": sum(g["num_cached_blocks"] for g in per_group),
        "num_evictable_blocks": sum(g["num_evictable_blocks"] for g in per_group),
        "num_reserved_blocks": sum(g["num_reserved_blocks"] for g in per_group),
        "prefix_cache_capacity_blocks": prefixes.capacity_blocks,
        "num_requests": requests.num_added,
        "num_active_requests": len(requests.active),
        "num_finished_requests": terminal.count(RequestState.FINISHED),
        "num_cancelled_requests": terminal.count(RequestState.CANCELLED),
        "terminal_request_history_count": terminal.num_recent,
        "terminal_request_history_limit": terminal.limit,
        "num_prefixes": len(prefixes),
        "prefix_refcount_total": prefixes.refcount_total(),
        "num_prefix_evictions": prefixes.num_evictions,
        "retained_transaction_state_count": 0 if open_tx is None else 1,
        "terminal_transaction_history_count": len(tx.history),
        "terminal_transaction_history_limit": tx.history_limit,
        "num_committed_transactions": tx.num_committed,
        "num_aborted_transactions": tx.num_aborted,
        "groups": per_group,
    }


def _group_metrics(
    group: LayerGroup, active: dict[RequestId, RequestRecord], open_tx: OpenTransaction | None
) -> dict:
    index = group.index
    reserved = {} if open_tx is None else open_tx.reserved[index]
    held = [rec.run(index).num_held + len(reserved.get(rid, ())) for rid, rec in active.items()]
    used = group.allocator.num_used
    prefix = group.prefixes.num_blocks
    cached = group.block_cache.num_referenced  # held cached blocks (evictable ones are free)
    return {
        "group": index,
        "layers": list(group.layers),
        "num_layers": len(group.layers),
        "window": group.window,
        "block_size": group.block_size,
        "num_kv_heads": group.num_kv_heads,
        "head_dim": group.head_dim,
        "dtype": str(group.dtype).removeprefix("torch."),
        "num_blocks": group.spec.num_blocks,
        "num_free_blocks": group.allocator.num_free,
        "num_used_blocks": used,
        "num_private_blocks": used - prefix - cached,
        "num_prefix_blocks": prefix,
        "num_cached_blocks": len(group.block_cache),
        "num_shared_cached_blocks": cached,
        "num_evictable_blocks": group.allocator.num_evictable,
        "num_reserved_blocks": sum(len(b) for b in reserved.values()),
        "max_blocks_per_request": max(held, default=0),
        "block_bound_per_request": group.block_bound,
        "bytes_per_block": group.spec.block_bytes,
        "bytes": group.spec.nbytes,
        "used_bytes": used * group.spec.block_bytes,
    }


def check_invariants(
    groups: Sequence[LayerGroup], requests: RequestTable, tx: TransactionLog, num_layers: int
) -> None:
    """RuntimeError on any inconsistency between requests, prefixes, blocks and the open
    transaction, in every group. O(blocks + active requests * table width): a terminal
    request holds nothing, so a block the allocator still gives one is reported as owned
    by neither an active request nor a prefix."""
    open_tx = tx.open
    active = requests.active
    single = len(groups) == 1
    attached: Counter[PrefixId] = Counter()
    for rec in active.values():
        if rec.prefix_id is not None:
            attached[rec.prefix_id] += 1
    for group in groups:
        _check_group(group, active, open_tx, single)
        group.prefixes.check_integrity(attached)
    rows = [rec.row for rec in active.values()]
    if len(set(rows)) != len(rows) or any(r < 0 for r in rows):
        raise RuntimeError(f"active requests do not own distinct device-table rows: {rows}")
    if any(g.tables.num_rows != groups[0].tables.num_rows for g in groups):
        raise RuntimeError("the KV groups' device tables have different row counts")
    if open_tx is not None:
        if not 0 <= open_tx.next_layer <= num_layers:
            raise RuntimeError(f"open transaction at impossible layer {open_tx.next_layer}")
        for rid in open_tx.request_ids:
            rec = active.get(rid)
            if rec is None or rec.state is not RequestState.ACTIVE:
                raise RuntimeError(f"open transaction lists non-active request {rid!r}")
        for per_group in open_tx.reserved:
            if not set(per_group) <= set(open_tx.request_ids):
                raise RuntimeError("open transaction reserved a block for a foreign request")
    if len(tx.history) > tx.history_limit:
        raise RuntimeError("terminal transaction history exceeds its limit")
    requests.check_integrity()


def _check_group(
    group: LayerGroup,
    active: dict[RequestId, RequestRecord],
    open_tx: OpenTransaction | None,
    single: bool,
) -> None:
    index, bs, window = group.index, group.block_size, group.window
    where = "" if single else f"KV group {index}: "
    allocator, prefixes = group.allocator, group.prefixes
    allocator.check_integrity()
    owned = allocator.owned_blocks()
    reserved = open_tx.reserved[index] if open_tx is not None else {}
    num_private = 0
    cached_held: Counter[int] = Counter()
    for rid, rec in active.items():
        if rec.state is not RequestState.ACTIVE:
            raise RuntimeError(f"{where}{rec.state.value} request {rid!r} is listed active")
        run = rec.run(index)
        held = owned.pop(request_owner(rid), [])
        first, end = held_range(rec.seq_len, bs, window)
        ok = (run.first_block, run.num_blocks) == (first, end)
        if not ok or run.num_blocks > run.table.shape[0]:
            raise RuntimeError(
                f"{where}request {rid!r}: seq_len {rec.seq_len} needs {end - first} "
                f"blocks, holds {run.num_held} (logical [{first}, {end}) expected, "
                f"[{run.first_block}, {run.num_blocks}) held)"
            )
        if run.table[run.num_blocks :].any():
            raise RuntimeError(f"{where}request {rid!r}: block table padding is not 0")
        if rec.block_hashes is not None:  # automatic prefix caching: shared cached blocks
            cached_held.update(run.table[run.first_block : run.num_prefix_blocks].tolist())
        elif rec.prefix_id is None:
            if run.num_prefix_blocks:
                raise RuntimeError(f"{where}request {rid!r} has prefix blocks but no prefix")
        else:
            if rec.prefix_id not in prefixes:
                raise RuntimeError(f"{where}request {rid!r} uses unknown prefix {rec.prefix_id!r}")
            ids = prefixes.block_ids(rec.prefix_id)
            if tuple(run.table[: run.num_prefix_blocks].tolist()) != ids:
                raise RuntimeError(f"{where}request {rid!r}: table does not start with its prefix")
        private = run.private_block_ids + list(reserved.get(rid, ()))
        if sorted(private) != held:
            raise RuntimeError(
                f"{where}request {rid!r}: private blocks {sorted(private)} != allocator's {held}"
            )
        num_private += len(held)
    owned.pop(CACHED, None)
    group.block_cache.check_integrity(cached_held, where)
    if group.block_cache.host is not None:
        group.block_cache.host.check_integrity(where)
    for owner, ids in owned.items():
        if not (isinstance(owner, tuple) and owner[0] == "prefix" and owner[1] in prefixes):
            raise RuntimeError(
                f"{where}blocks {ids} owned by {owner!r}, not an active request nor a prefix"
            )
        if sorted(prefixes.block_ids(owner[1])) != ids:
            raise RuntimeError(f"prefix {owner[1]!r} blocks disagree with the allocator")
    # free counts the evictable cached blocks; the held cached ones are counted apart
    cached = group.block_cache.num_referenced
    if num_private + prefixes.num_blocks + cached + allocator.num_free != group.spec.num_blocks:
        raise RuntimeError(f"{where}free + private + prefix + held cached blocks != max_blocks")
