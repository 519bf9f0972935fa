"""Abort backups saved by the writers (``begin_token(..., backup_by_writer=True)``): what the
engine's fused append kernel does in its own launch, emulated here in PyTorch. Abort restores
exactly the layers whose writer was called; ``complete_backup`` makes it restore every layer."""

from __future__ import annotations

import pytest
import torch

from flashdec.cache import PagedKVCache
from flashdec.cache.token_steps import torch_scatter
from tests.cache.snapshot import assert_rejected, snapshot
from tests.cache.test_groups import History, make
from tests.cache.util import commit_token, make_cache, tokens


def saving_writer(cache: PagedKVCache, tx, layer: int, k, v, fail: bool = False):
    """A writer that saves the slots' old bytes into the transaction backup, then stores (and
    then raises, with ``fail``) — the fused append kernel's contract."""
    group = cache.layout.layer_group(layer)
    layers = cache.layout.group_layers(group)
    local, count = layers.index(layer), len(layers)
    backup = cache.steps.transaction_backup(tx, group=group)

    def write(k_layer, v_layer, slots):
        ids, offsets = slots.block_ids[: slots.batch], slots.offsets[: slots.batch]
        rows = slots.batch * k_layer.shape[1]
        backup[local, :rows] = k_layer[ids, :, offsets].reshape(rows, -1)
        backup[count + local, :rows] = v_layer[ids, :, offsets].reshape(rows, -1)
        torch_scatter(k_layer, v_layer, k, v, slots)
        if fail:
            raise OSError("injected after the store")

    return cache.write_token_layer_with(tx, layer, write)


def test_abort_restores_exactly_the_layers_whose_writer_ran():
    cache = make_cache(num_layers=3)
    cache.add_request("a")
    cache.add_request("b")
    commit_token(cache, ["a", "b"], seed=1)
    for fail_at in range(cache.num_layers + 1):
        before = snapshot(cache)
        tx = cache.begin_token(["a", "b"], backup_by_writer=True)
        backup = cache.steps.transaction_backup(tx)
        assert backup.shape == (2 * cache.num_layers, 2 * cache.num_kv_heads, cache.head_dim)
        assert backup.dtype == cache.dtype
        backup.fill_(7.0)  # stale rows: restoring a layer no writer saved would show
        for layer in range(min(fail_at + 1, cache.num_layers)):
            k, v = tokens(cache, 2, 10 + layer), tokens(cache, 2, 20 + layer)
            if layer < fail_at:
                saving_writer(cache, tx, layer, k, v)
            else:
                with pytest.raises(OSError, match="injected"):
                    saving_writer(cache, tx, layer, k, v, fail=True)
                assert cache.steps.layers_written(tx) == layer
        cache.abort_token(tx)
        after = snapshot(cache)
        assert torch.equal(after["k"], before["k"]) and torch.equal(after["v"], before["v"])
        assert after["requests"] == before["requests"]
        cache.validate_invariants()
    commit_token(cache, ["a", "b"], seed=2)  # the cache still works


def test_the_backup_has_fixed_addresses_per_batch_size():
    cache = make_cache()
    cache.add_request("a")
    cache.add_request("b")
    pointers = set()
    for _ in range(3):
        tx = cache.begin_token(["a", "b"], backup_by_writer=True)
        pointers.add(cache.steps.transaction_backup(tx).data_ptr())
        for layer in range(cache.num_layers):
            saving_writer(cache, tx, layer, tokens(cache, 2, layer), tokens(cache, 2, 5))
        cache.commit_token(tx)
    assert len(pointers) == 1


def test_complete_backup_restores_every_layer_whatever_the_writers_did():
    cache = make_cache()
    cache.add_request("a")
    commit_token(cache, ["a"], seed=3)
    before = snapshot(cache)
    tx = cache.begin_token(["a"], backup_by_writer=True)
    cache.steps.complete_backup(tx)
    assert cache.steps.transaction_backup(tx) is None  # the cache's backup now
    for layer in range(cache.num_layers):  # writers that save nothing
        cache.write_token_layer(tx, layer, tokens(cache, 1, layer), tokens(cache, 1, 9))
    cache.abort_token(tx)
    after = snapshot(cache)
    assert torch.equal(after["k"], before["k"]) and torch.equal(after["v"], before["v"])


def test_complete_backup_comes_before_the_first_layer():
    cache = make_cache()
    cache.add_request("a")
    tx = cache.begin_token(["a"], backup_by_writer=True)
    saving_writer(cache, tx, 0, tokens(cache, 1, 0), tokens(cache, 1, 1))
    assert_rejected(
        cache, RuntimeError, "before the first", lambda: cache.steps.complete_backup(tx)
    )
    cache.abort_token(tx)


def test_no_writer_backup_without_the_option_or_without_restore():
    cache = make_cache()
    cache.add_request("a")
    tx = cache.begin_token(["a"])
    assert cache.steps.transaction_backup(tx) is None
    cache.steps.complete_backup(tx)  # nothing to complete
    cache.abort_token(tx)
    cache = make_cache(restore_on_abort=False)
    cache.add_request("a")
    tx = cache.begin_token(["a"], backup_by_writer=True)
    assert cache.steps.transaction_backup(tx) is None
    cache.abort_token(tx)


def test_bad_backup_option_is_rejected_and_changes_nothing():
    cache = make_cache()
    cache.add_request("a")
    assert_rejected(
        cache,
        TypeError,
        "backup_by_writer must be a bool",
        lambda: cache.begin_token(["a"], backup_by_writer=1),
    )


def test_multi_group_abort_restores_the_attempted_layers_of_each_group():
    """Interleaved full and window layers: the window group's ring slots hold readable tokens,
    so its restore must be exact."""
    cache = make()
    history = History(cache, seed=4)
    cache.add_request("a")
    cache.add_request("b")
    history.prefill(["a", "b"], [5, 6])
    for _ in range(3):  # past the window: the next slots overwrite live ring entries
        history.step(["a", "b"])
    for fail_at in range(cache.num_layers + 1):
        before = snapshot(cache)
        tx = cache.begin_token(["a", "b"], backup_by_writer=True)
        for g in range(len(cache.kv_groups)):
            cache.steps.transaction_backup(tx, group=g).fill_(7.0)
        for layer in range(min(fail_at + 1, cache.num_layers)):
            k, v = history.rows(layer, 2), history.rows(layer, 2)
            if layer < fail_at:
                saving_writer(cache, tx, layer, k, v)
            else:
                with pytest.raises(OSError, match="injected"):
                    saving_writer(cache, tx, layer, k, v, fail=True)
        mid = snapshot(cache)
        cache.abort_token(tx)
        after = snapshot(cache)
        assert all(torch.equal(x, y) for x, y in zip(before["kv"], after["kv"], strict=True))
        assert after["requests"] == before["requests"]
        assert mid["requests"] == before["requests"]
        cache.validate_invariants()
    history.step(["a", "b"])
    history.check_readable("a")
