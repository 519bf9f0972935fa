"""KV layer groups in PagedKVCache: construction, per-group reads, sliding-window release,
windowed prompt import, atomic multi-group transactions and FP8 groups."""

from __future__ import annotations

import pytest
import torch

from flashdec._blocks import blocks_for_tokens, lifetime_blocks, window_block_bound
from flashdec.cache import KVGroupSpec, PagedKVCache, parse_kv_spec
from flashdec.reference import dense_decode_attention_ref, paged_decode_attention_ref
from tests.cache.helpers import decode_inputs, group_kv, request_first_block
from tests.cache.snapshot import assert_rejected, assert_same_state, snapshot

# a full group (2 layers, 2 KV heads, D 8, blocks of 4) and a window group (1 layer, 1 KV head,
# D 4, blocks of 2, window 5): bound ceil(5 / 2) + 1 = 4 blocks per request
SPEC = "(2,32,4,2,8):float32:2;(2,12,2,1,4):float32:1:window=5"
LAYER_GROUPS = [0, 1, 0]  # interleaved, as Gemma-style configs alternate


def make(spec: str = SPEC, layer_groups=LAYER_GROUPS, **kwargs) -> PagedKVCache:
    return PagedKVCache(kv_spec=spec, layer_groups=layer_groups, device="cpu", **kwargs)


class History:
    """Every token's K/V as written, per layer, to check what the cache stores and reads."""

    def __init__(self, cache: PagedKVCache, seed: int = 0) -> None:
        self.cache = cache
        self.gen = torch.Generator().manual_seed(seed)
        self.k: dict[tuple[object, int], list[torch.Tensor]] = {}
        self.v: dict[tuple[object, int], list[torch.Tensor]] = {}

    def rows(self, layer: int, count: int) -> torch.Tensor:
        spec = self.cache.kv_groups[self.cache.layout.layer_group(layer)]
        shape = (count, spec.num_kv_heads, spec.head_dim)
        rows = torch.randn(shape, generator=self.gen).to(self.cache.device)
        return rows if spec.dtype == torch.float8_e4m3fn else rows.to(spec.dtype)

    def write(self, tx, rids, counts) -> None:
        total = sum(counts)
        for layer in range(self.cache.num_layers):
            k, v = self.rows(layer, total), self.rows(layer, total)
            self.cache.write_token_layer(tx, layer, k, v)
            row = 0
            for rid, n in zip(rids, counts, strict=True):
                self.k.setdefault((rid, layer), []).extend(k[row : row + n])
                self.v.setdefault((rid, layer), []).extend(v[row : row + n])
                row += n

    def step(self, rids) -> None:
        tx = self.cache.begin_token(rids)
        self.write(tx, rids, [1] * len(rids))
        self.cache.commit_token(tx)

    def prefill(self, rids, counts) -> None:
        tx = self.cache.begin_tokens(rids, counts)
        self.write(tx, rids, counts)
        self.cache.commit_token(tx)

    def check_readable(self, rid) -> None:
        """Every position a future decode reads holds the bytes written for it."""
        cache = self.cache
        length = cache.seq_len(rid)
        for layer in range(cache.num_layers):
            g = cache.layout.layer_group(layer)
            spec = cache.kv_groups[g]
            table = cache.block_tables([rid], group=g)[0].tolist()
            start = 0 if spec.window is None else max(0, length + 1 - spec.window)
            k_layer, v_layer = cache.layout.layer_kv(layer)
            for pos in range(start, length):
                block = int(table[pos // spec.block_size])
                offset = pos % spec.block_size
                assert torch.equal(k_layer[block, :, offset], self.k[(rid, layer)][pos])
                assert torch.equal(v_layer[block, :, offset], self.v[(rid, layer)][pos])


def test_construction_and_read_api():
    cache = make()
    groups = parse_kv_spec(SPEC)
    assert cache.kv_groups == groups and cache.layout.num_groups == 2 and cache.num_layers == 3
    assert [cache.layout.layer_group(i) for i in range(3)] == LAYER_GROUPS
    assert cache.layout.group_layers(0) == (0, 2) and cache.layout.group_layers(1) == (1,)
    k0, v0 = group_kv(cache, 0)
    k1, v1 = group_kv(cache, 1)
    assert k0.shape == v0.shape == (2, 32, 2, 4, 8) and k1.shape == (1, 12, 1, 2, 4)
    assert cache.layout.layer_kv(2)[0].data_ptr() == k0[1].data_ptr()
    assert cache.layout.layer_kv(1)[1].data_ptr() == v1[0].data_ptr()
    assert cache.kv_groups[1].num_blocks == 12 == cache.layout.group_free_blocks(1)
    assert cache.max_blocks == cache.num_free_blocks == 44
    # one token limit: the full pool's 32 * 4 tokens, in each group's blocks
    assert (
        cache.layout.group_max_blocks_per_seq(0) == 32
        and cache.layout.group_max_blocks_per_seq(1) == 64
    )
    for name in ("k_cache", "v_cache"):
        with pytest.raises(RuntimeError, match="group"):
            getattr(cache, name)
    assert cache.dtype == torch.float32  # the groups agree on it
    for name in ("num_kv_heads", "head_dim", "block_size", "max_blocks_per_seq"):
        with pytest.raises(RuntimeError, match="differs between this cache's KV groups"):
            getattr(cache, name)
    positional = PagedKVCache(SPEC, device="cpu")  # the spec may come first
    assert positional.kv_groups == groups and positional.num_layers == 3
    assert PagedKVCache(list(groups), device="cpu").kv_groups == groups
    with pytest.raises(ValueError, match="either kv_spec or the geometry"):
        PagedKVCache(SPEC, 2, device="cpu")
    same = PagedKVCache(kv_spec=list(groups[:1]), device="cpu")
    assert same.k_cache.shape == (2, 32, 2, 4, 8) and same.block_size == 4
    m = cache.metrics()
    assert [g["window"] for g in m["groups"]] == [None, 5]
    assert m["groups"][1]["block_bound_per_request"] == window_block_bound(2, 5) == 4
    assert m["groups"][0]["bytes"] == groups[0].nbytes and m["groups"][1]["layers"] == [1]
    cache.validate_invariants()


def test_default_layer_groups_are_consecutive_and_all_window_caches_size_from_the_pool():
    cache = PagedKVCache(kv_spec=SPEC, device="cpu")
    assert [cache.layout.layer_group(i) for i in range(3)] == [0, 0, 1]
    windows = PagedKVCache(kv_spec="(2,4,2,1,4):float32:1:window=3", device="cpu")
    assert windows.layout.group_max_blocks_per_seq(0) == 4
    longer = PagedKVCache(kv_spec="(2,4,2,1,4):float32:1:window=3", device="cpu", max_seq_len=99)
    assert longer.layout.group_max_blocks_per_seq(0) == 50


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_layers": 3}, ValueError, "either kv_spec or the geometry"),
        ({"dtype": torch.float32}, ValueError, "either kv_spec or the geometry"),
        ({"layer_groups": [0, 0, 0]}, ValueError, "group 0 3 times"),
        ({"layer_groups": [0, 1, 2]}, ValueError, r"not a group in \[0, 2\)"),
        ({"layer_groups": [0, 1]}, ValueError, "group 0 1 times"),
        ({"layer_groups": "010"}, TypeError, "sequence of ints"),
        ({"layer_groups": [0, 1.0, 0]}, TypeError, r"layer_groups\[1\]"),
        ({"kv_spec": "(2,32,4,2,8):float32:2;"}, ValueError, "group 1"),
        ({"kv_spec": 7}, TypeError, "kv_spec"),
        ({"kv_spec": "(1,32,4,2,8):float32:3"}, ValueError, "kv_size 1 is not supported"),
        ({"kv_spec": "(2,32,4,2,7):float32:3"}, ValueError, "head_dim must be even"),
        ({"max_blocks_per_seq": 4}, ValueError, "ambiguous"),
        ({"max_seq_len": 129}, ValueError, "max_seq_len"),
        ({"max_seq_len": 8, "max_blocks_per_seq": 2}, ValueError, "not both"),
        ({"prefix_cache_capacity_blocks": 2}, ValueError, "full-attention KV groups of one"),
        ({"kv_scales": [None, (1.0, 1.0)]}, ValueError, "takes no scales"),
        ({"kv_scales": [None]}, ValueError, "1 entries for 2 groups"),
    ],
)
def test_bad_grouped_construction(kwargs, exc, match):
    params = {"kv_spec": SPEC, "layer_groups": LAYER_GROUPS, "device": "cpu"}
    params.update(kwargs)
    with pytest.raises(exc, match=match):
        PagedKVCache(**params)


def test_layer_groups_and_scales_need_kv_spec():
    with pytest.raises(ValueError, match="need kv_spec"):
        PagedKVCache(1, 1, 4, 2, 4, device="cpu", layer_groups=[0])


def test_window_group_holds_a_bounded_number_of_blocks_over_a_long_generation():
    cache = make()
    history = History(cache)
    cache.add_request("a")
    cache.add_request("b")
    bound = window_block_bound(2, 5)
    peaks, committed = [], []
    for step in range(40):  # 40 tokens: 20 blocks of 2 without the window
        rids = ["a", "b"] if step % 3 else ["a"]
        tx = cache.begin_token(rids)
        peaks.append(cache.metrics()["groups"][1]["max_blocks_per_request"])
        history.write(tx, rids, [1] * len(rids))
        cache.commit_token(tx)
        cache.validate_invariants()
        committed.append(cache.metrics()["groups"][1]["max_blocks_per_request"])
        for rid in ("a", "b"):
            held = len(cache.request_block_ids(rid, group=1))
            assert held == blocks_for_tokens(cache.seq_len(rid), 2, 5) <= bound
            assert len(cache.request_block_ids(rid, group=0)) == -(-cache.seq_len(rid) // 4)
    # flat once past the window, and exactly the lifetime commitment the scheduler counts
    assert max(peaks) == max(peaks[10:]) == lifetime_blocks(40, 2, 5) == 3 <= bound
    assert min(peaks[10:]) == 3 and set(committed[10:]) == {2, 3}
    assert request_first_block(cache, "a", group=1) == (40 + 1 - 5) // 2
    for rid in ("a", "b"):
        history.check_readable(rid)
    cache.finish_request("a")
    cache.finish_request("b")
    assert cache.num_free_blocks == cache.max_blocks
    cache.validate_invariants()


def test_decode_over_the_window_group_matches_the_dense_reference():
    cache = make()
    history = History(cache, seed=3)
    rids = ["a", "b", "c"]
    for rid in rids:
        cache.add_request(rid)
    history.prefill(rids, [3, 9, 1])
    gen = torch.Generator().manual_seed(9)
    for _ in range(7):
        tx = cache.begin_token(rids)
        history.write(tx, rids, [1] * 3)
        for layer in range(cache.num_layers):
            g = cache.layout.layer_group(layer)
            spec = cache.kv_groups[g]
            tables, lens = decode_inputs(cache, tx, group=g)
            q = torch.randn(3, 2 * spec.num_kv_heads, spec.head_dim, generator=gen)
            k_layer, v_layer = cache.layout.layer_kv(layer)
            out = paged_decode_attention_ref(
                q,
                k_layer,
                v_layer,
                tables.to(torch.int32),
                lens.to(torch.int32),
                window=spec.window,
            )
            width = int(lens.max())
            dense_k = torch.zeros(3, width, spec.num_kv_heads, spec.head_dim)
            dense_v = torch.zeros_like(dense_k)
            for b, rid in enumerate(rids):
                n = int(lens[b])
                dense_k[b, :n] = torch.stack(history.k[(rid, layer)])
                dense_v[b, :n] = torch.stack(history.v[(rid, layer)])
            ref = dense_decode_attention_ref(
                q, dense_k, dense_v, lens.to(torch.int32), window=spec.window
            )
            torch.testing.assert_close(out, ref)
        cache.commit_token(tx)
        cache.validate_invariants()


def test_prompt_import_longer_than_the_window_stores_only_the_tail():
    cache = make()
    history = History(cache, seed=1)
    cache.add_request("long")
    cache.add_request("short")
    tx = cache.begin_tokens(["long", "short"], [23, 2])
    slots = cache.steps.transaction_slots(tx, group=1)
    # the window group keeps positions [23 + 1 - 5, 23) = [19, 23): blocks 9..11 (18..23)
    assert slots.token_rows.tolist() == [18, 19, 20, 21, 22, 23, 24]
    assert slots.positions.tolist() == [18, 19, 20, 21, 22, 0, 1]
    assert cache.steps.transaction_slots(tx, group=0).token_rows is None
    assert cache.metrics()["groups"][1]["num_reserved_blocks"] == 3 + 1
    view = cache.transaction_view(tx)  # group 0 stores every token
    assert (view.block_ids >= 0).all()
    window_view = cache.transaction_view(tx, group=1)
    assert window_view.block_ids[:18].tolist() == [-1] * 18
    assert window_view.block_ids[18:].tolist() == slots.block_ids.tolist()
    assert window_view.offsets.tolist() == [p % 2 for p in range(23)] + [0, 1]
    tables = window_view.block_tables  # reserved blocks at their logical indices
    assert (
        tables.shape == (2, 64)
        and tables[0, 9:12].tolist()
        == cache.steps.transaction_slots(tx, group=1).block_ids[[0, 2, 4]].tolist()
    )
    assert tables[0, :9].tolist() == [0] * 9
    history.write(tx, ["long", "short"], [23, 2])
    cache.validate_invariants()
    cache.commit_token(tx)
    cache.validate_invariants()
    assert len(cache.request_block_ids("long", group=1)) == blocks_for_tokens(23, 2, 5) == 3
    assert request_first_block(cache, "long", group=1) == 9
    history.check_readable("long")
    history.check_readable("short")
    # a second import on top of held blocks skips past them and releases them at commit
    history.prefill(["long"], [10])
    cache.validate_invariants()
    assert request_first_block(cache, "long", group=1) == (33 + 1 - 5) // 2
    history.check_readable("long")
    for _ in range(3):
        history.step(["long", "short"])
        history.check_readable("long")
    cache.validate_invariants()


def test_window_of_one_keeps_nothing_between_steps():
    cache = PagedKVCache(kv_spec="(2,4,2,1,4):float32:1:window=1", device="cpu")
    history = History(cache)
    cache.add_request("a")
    history.prefill(["a"], [3])
    assert cache.request_block_ids("a") == [] and cache.num_free_blocks == 4
    for _ in range(5):
        tx = cache.begin_token(["a"])
        assert cache.metrics()["groups"][0]["max_blocks_per_request"] == 1
        history.write(tx, ["a"], [1])
        tables, lens = decode_inputs(cache, tx)
        k_layer, _ = cache.layout.layer_kv(0)
        pos = int(lens[0]) - 1
        block = int(tables[0, pos // 2])
        assert torch.equal(k_layer[block, :, pos % 2], history.k[("a", 0)][pos])
        cache.commit_token(tx)
        cache.validate_invariants()
        assert cache.request_block_ids("a") == []


def test_failure_at_every_layer_of_a_multi_group_transaction_rolls_back_bit_identically(
    monkeypatch,
):
    import flashdec.cache.token_steps as facade

    cache = make()
    history = History(cache, seed=2)
    cache.add_request("a")
    cache.add_request("b")
    history.prefill(["a", "b"], [5, 6])  # the next step takes blocks and releases window ones
    for fail_at in range(cache.num_layers):
        before = snapshot(cache)
        tx = cache.begin_token(["a", "b"])
        for layer in range(fail_at):
            cache.write_token_layer(tx, layer, history.rows(layer, 2), history.rows(layer, 2))
        mid = snapshot(cache)

        def boom(*args, **kwargs):
            raise OSError("injected")

        with monkeypatch.context() as patch:
            patch.setattr(facade, "torch_scatter", boom)
            with pytest.raises(OSError, match="injected"):
                k, v = history.rows(fail_at, 2), history.rows(fail_at, 2)
                cache.write_token_layer(tx, fail_at, k, v)
        assert_same_state(cache, mid)
        cache.abort_token(tx)
        after = snapshot(cache)
        for key in ("requests", "num_free_blocks", "kv"):
            if key == "kv":
                assert all(torch.equal(x, y) for x, y in zip(before[key], after[key], strict=True))
            else:
                assert before[key] == after[key]
        cache.validate_invariants()
    history.step(["a", "b"])  # the cache still works
    history.check_readable("a")


def test_rejected_calls_on_a_grouped_cache_change_nothing():
    cache = make()
    history = History(cache)
    cache.add_request("a")
    history.prefill(["a"], [7])
    rows = history.rows
    assert_rejected(
        cache, ValueError, "group must be in", lambda: cache.block_tables(["a"], group=2)
    )
    assert_rejected(
        cache, TypeError, "group must be an int", lambda: cache.request_block_ids("a", group="1")
    )
    assert_rejected(cache, RuntimeError, "is full", lambda: cache.begin_tokens(["a"], [200]))
    tx = cache.begin_token(["a"])
    # layer 1 is the window group's: the full group's shapes are wrong there
    cache.write_token_layer(tx, 0, rows(0, 1), rows(0, 1))
    assert_rejected(
        cache, ValueError, "shape", lambda: cache.write_token_layer(tx, 1, rows(0, 1), rows(0, 1))
    )
    assert_rejected(
        cache,
        RuntimeError,
        "out of order",
        lambda: cache.write_token_layer(tx, 2, rows(2, 1), rows(2, 1)),
    )
    assert_rejected(cache, RuntimeError, "1 of 3 layers", lambda: cache.commit_token(tx))
    assert_rejected(
        cache,
        RuntimeError,
        "need full-attention KV groups",
        lambda: cache.register_prefix("p", rows(0, 1), rows(0, 1)),
    )
    cache.abort_token(tx)


def test_out_of_blocks_in_one_group_takes_nothing_in_any():
    # the window group's pool is tiny: 3 blocks
    cache = make(spec="(2,32,4,2,8):float32:2;(2,3,2,1,4):float32:1:window=5")
    history = History(cache)
    cache.add_request("a")
    cache.add_request("b")
    history.prefill(["a"], [6])  # holds 2 window blocks: positions [2, 6)
    assert_rejected(
        cache,
        RuntimeError,
        "out of KV blocks in KV group 1",
        lambda: cache.begin_tokens(["b"], [6]),
    )
    history.prefill(["b"], [1])  # one block is still free


def test_fp8_group_quantizes_with_its_fixed_scales():
    spec = "(2,8,2,2,4):float8_e4m3fn:1;(2,8,2,2,4):float32:1"
    scales = [(torch.tensor([0.5, 2.0]), 0.25), None]
    cache = PagedKVCache(kv_spec=spec, device="cpu", kv_scales=scales)
    k_scale, v_scale = cache.layout.layer_kv_scales(0)
    assert k_scale.tolist() == [0.5, 2.0] and v_scale.tolist() == [0.25, 0.25]
    assert cache.layout.group_kv_scales(0)[0].tolist() == [[0.5, 2.0]]  # [layers, Hkv]
    assert cache.layout.group_kv_scales(1) is None
    cache.add_request("a")
    k = torch.tensor([[[1.0, -2.0, 1000.0, 0.0], [4.0, 8.0, -3000.0, 1.0]]])
    tx = cache.begin_token(["a"])
    cache.write_token_layer(tx, 0, k, k)
    cache.write_token_layer(tx, 1, k, k)
    cache.commit_token(tx)
    block = cache.request_block_ids("a")[0]
    k_fp8, v_fp8 = group_kv(cache, 0)
    stored_k = k_fp8[0, block, :, 0].float()
    expected = (k / k_scale.view(1, -1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(stored_k, expected[0])
    assert stored_k[0, 2] == 448  # 1000 / 0.5 saturates
    assert torch.equal(
        v_fp8[0, block, :, 0].float(),
        (k[0] / 0.25).clamp(-448, 448).to(torch.float8_e4m3fn).float(),
    )
    fresh = PagedKVCache(kv_spec=spec, device="cpu")
    assert fresh.layout.group_kv_scales(0)[0].tolist() == [[1.0, 1.0]]
    scaled = PagedKVCache(
        kv_spec=spec, device="cpu", kv_scales=[(2.0, torch.tensor([1.0, 3.0])), None]
    )
    assert scaled.layout.group_kv_scales(0)[1].tolist() == [[1.0, 3.0]]
    with pytest.raises(ValueError, match="takes no scales"):
        PagedKVCache(kv_spec=spec, device="cpu", kv_scales=[None, (2.0, 2.0)])
    with pytest.raises(ValueError, match="finite and > 0"):
        PagedKVCache(kv_spec=spec, device="cpu", kv_scales=[(0.0, 1.0), None])


def test_groups_accept_kvgroupspec_sequences():
    groups = (
        KVGroupSpec(2, 16, 4, 2, 8, torch.float32, 1),
        KVGroupSpec(2, 8, 4, 2, 8, torch.float32, 1, window=4),
    )
    cache = PagedKVCache(kv_spec=groups, device="cpu")
    assert cache.kv_groups == groups and cache.block_size == 4 and cache.head_dim == 8
    assert cache.max_blocks_per_seq == 16  # same block size: one width
    history = History(cache)
    cache.add_request("a")
    for _ in range(12):
        history.step(["a"])
    assert len(cache.request_block_ids("a", group=1)) == blocks_for_tokens(12, 4, 4) == 1
    history.check_readable("a")


def test_legacy_append_on_a_single_window_layer_releases_blocks():
    cache = PagedKVCache(kv_spec="(2,4,2,1,4):float32:1:window=3", device="cpu", max_seq_len=64)
    cache.add_request("a")
    written = []
    for step in range(9):
        k = torch.full((1, 1, 4), float(step))
        cache.append(["a"], k, -k)
        written.append(k[0])
        cache.validate_invariants()
        assert len(cache.request_block_ids("a")) == blocks_for_tokens(step + 1, 2, 3)
    table = cache.block_tables(["a"])[0].tolist()
    k_layer, v_layer = cache.layout.layer_kv(0)
    for pos in range(9 + 1 - 3, 9):  # what the next decode reads
        assert torch.equal(k_layer[table[pos // 2], :, pos % 2], written[pos])
        assert torch.equal(v_layer[table[pos // 2], :, pos % 2], -written[pos])
    assert cache.num_free_blocks == 4 - 2


def test_padded_step_over_groups_pads_every_group():
    cache = make()
    history = History(cache)
    for rid in ("a", "b"):
        cache.add_request(rid)
    history.prefill(["a", "b"], [6, 1])
    tx = cache.begin_token(["a", "b"], pad_to=4)
    for g in range(2):
        slots = cache.steps.transaction_slots(tx, group=g)
        assert slots.num_rows == 4 and slots.block_ids[2:].tolist() == [-1, -1]
        assert slots.seq_lens_after.tolist() == [7, 2, 0, 0]
        assert slots.block_tables.shape == (4, cache.layout.group_max_blocks_per_seq(g))
    cache.abort_token(tx)
    cache.validate_invariants()


def test_shared_prefixes_span_every_full_group():
    spec = "(2,10,2,2,4):float32:1;(2,6,2,1,8):float32:2"
    cache = PagedKVCache(spec, layer_groups=[1, 0, 1], device="cpu", prefix_cache_capacity_blocks=4)
    gen = torch.Generator().manual_seed(0)

    def blocks(n):
        shapes = [(1, n, 2, 2, 4), (2, n, 1, 2, 8)]
        return [torch.randn(s, generator=gen) for s in shapes]

    k, v = blocks(2), blocks(2)
    with pytest.raises(TypeError, match="list of 2 tensors"):
        cache.register_prefix("p", k[0], v[0])
    state = cache.register_prefix("p", k, v)
    assert state.num_blocks == 2 and cache.prefix_state("p", group=1).num_blocks == 2
    cache.add_request("a")
    cache.attach_prefix("a", "p")
    assert cache.seq_len("a") == 4 and cache.prefix_state("p").refcount == 1
    history = History(cache, seed=4)
    history.step(["a"])
    cache.validate_invariants()
    tables = [cache.block_tables(["a"], group=g)[0].tolist() for g in range(2)]
    for layer, g, local in ((0, 1, 0), (1, 0, 0), (2, 1, 1)):
        k_layer, _ = cache.layout.layer_kv(layer)
        for pos in range(4):  # the prefix's tokens read back through each group's table
            got = k_layer[tables[g][pos // 2], :, pos % 2]
            assert torch.equal(got, k[g][local, pos // 2, :, pos % 2])
    m = cache.metrics()
    assert m["num_prefix_blocks"] == 4 and [x["num_prefix_blocks"] for x in m["groups"]] == [2, 2]
    # LRU eviction stays in step across groups although their pools differ
    cache.finish_request("a")
    cache.evict_prefix("p")
    cache.register_prefix("q", blocks(2), blocks(2))
    cache.add_request("b")
    history.prefill(["b"], [5])  # 3 blocks in each group: group 1 has 1 free, group 0 has 5
    cache.register_prefix("r", blocks(2), blocks(2))  # only group 1 must evict "q": both do
    assert cache.prefix_ids() == ["r"]
    with pytest.raises(ValueError, match="unknown prefix"):
        cache.prefix_state("q", group=1)
    assert cache.layout.group_free_blocks(0) == 5 and cache.layout.group_free_blocks(1) == 1
    assert_rejected(
        cache, RuntimeError, "capacity", lambda: cache.register_prefix("s", blocks(5), blocks(5))
    )
    cache.finish_request("b")
    cache.evict_prefix("r")
    cache.validate_invariants()
    assert cache.num_free_blocks == cache.max_blocks
