"""Device-side metadata checks (one small read) and the version-keyed validation cache.

The stats kernels are compared with a plain torch computation on the host; the cache is checked
through the public calls: a validated, unmodified table is not read again, any in-place edit is.
"""

from __future__ import annotations

import pytest
import torch

from flashdec._checks import (
    AppendStats,
    PagedDecodeDims,
    paged_decode_stats,
    query_len_stats,
)
from flashdec.kernels import (
    append,
    clear_validation_cache,
    decode,
    fused_rope_kv_append,
    kv_append,
    paged_decode,
    validation,
)
from flashdec.reference import apply_rope, paged_decode_attention_ref
from tests.helpers import TOLERANCES, make_paged_kv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _dims(tables, lens, num_blocks, block_size) -> PagedDecodeDims:
    return PagedDecodeDims(len(lens), 2, 16, num_blocks, 1, block_size, tables.shape[1])


def _random_metadata(batch, width, block_size, gen, dtype=torch.int32):
    lens = torch.randint(0, width * block_size + 1, (batch,), generator=gen)
    lens[0] = 0
    tables = torch.randint(0, 50, (batch, width), generator=gen)
    used = (lens + block_size - 1) // block_size
    junk = torch.arange(width)[None, :] >= used[:, None]
    # entries past the used blocks are unspecified: make them wildly out of range
    tables[junk] = torch.randint(-(2**30), 2**30, (int(junk.sum()),), generator=gen)
    return tables.to(dtype), lens.to(dtype)


@pytest.mark.parametrize(
    ("batch", "width", "block_size"),
    [(1, 1, 8), (3, 5, 16), (17, 9, 4), (40, 3, 32), (70, 2, 16), (2, 1100, 1)],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_decode_stats_kernel_matches_torch(batch, width, block_size, dtype, device, monkeypatch):
    monkeypatch.setattr(validation, "_MAX_PROGRAMS", 2)  # programs loop over several row blocks
    gen = torch.Generator().manual_seed(batch * 7 + width)
    tables, lens = _random_metadata(batch, width, block_size, gen, dtype)
    dims = _dims(tables, lens, 50, block_size)
    got = validation.decode_metadata_stats(tables.to(device), lens.to(device), dims)
    assert got == paged_decode_stats(tables, lens, dims)


@pytest.mark.parametrize("window", [1, 3, 8, 20, 1000])
@pytest.mark.parametrize(("batch", "width", "block_size"), [(3, 5, 4), (17, 9, 8), (2, 1100, 1)])
def test_decode_stats_with_a_window_read_only_the_window(window, batch, width, block_size, device):
    """Entries of blocks wholly before a row's window are not read (junk there passes); the
    total counts the attended tokens."""
    gen = torch.Generator().manual_seed(batch + window)
    tables, lens = _random_metadata(batch, width, block_size, gen)
    first = (lens - window).clamp(min=0) // block_size
    before = torch.arange(width)[None, :] < first[:, None]
    tables[before] = -(2**30)  # released blocks: anything
    dims = _dims(tables, lens, 50, block_size)
    got = validation.decode_metadata_stats(tables.to(device), lens.to(device), dims, window)
    assert got == paged_decode_stats(tables, lens, dims, window)
    assert got.total_len == int(lens.clamp(max=window).sum())
    assert got.min_id is None or got.min_id >= 0


def test_decode_stats_of_strided_metadata_and_long_lengths(device):
    gen = torch.Generator().manual_seed(3)
    tables, lens = _random_metadata(6, 7, 8, gen)
    wide = torch.full((6, 14), -1, dtype=torch.int32)
    wide[:, ::2] = tables
    lens_wide = torch.zeros(12, dtype=torch.int32)
    lens_wide[::2] = lens
    lens_wide[2] = 10**6  # past the table's capacity: only the table's width is read
    strided, strided_lens = wide[:, ::2], lens_wide[::2]
    dims = _dims(strided, strided_lens, 50, 8)
    got = validation.decode_metadata_stats(strided.to(device), strided_lens.to(device), dims)
    assert got == paged_decode_stats(strided, strided_lens, dims)
    assert got.max_len == 10**6


@pytest.mark.parametrize("window", [None, 1, 5, 1000])
@pytest.mark.parametrize(("batch", "width", "block_size"), [(1, 3, 8), (17, 9, 4), (40, 3, 32)])
def test_extend_stats_kernel_matches_torch(window, batch, width, block_size, device, monkeypatch):
    """The query-length stats (including bad values: 0, negative, above seq_len) and, with a
    window, the entries read from each row's first new token's window on."""
    monkeypatch.setattr(validation, "_MAX_PROGRAMS", 2)
    gen = torch.Generator().manual_seed(batch * 5 + (window or 0))
    tables, lens = _random_metadata(batch, width, block_size, gen)
    qlens = torch.randint(-1, 7, (batch,), generator=gen).to(torch.int32)
    if window is not None:
        first = (lens - window - qlens + 1).clamp(min=0) // block_size
        tables[torch.arange(width)[None, :] < first[:, None]] = -(2**30)  # never read
    dims = _dims(tables, lens, 50, block_size)
    stats, queries = validation.extend_metadata_stats(
        tables.to(device), lens.to(device), qlens.to(device), dims, window
    )
    assert stats == paged_decode_stats(tables, lens, dims, window, qlens)
    assert queries == query_len_stats(qlens, lens)
    assert queries.total == int(qlens.sum()) and queries.min_len == int(qlens.min())


def _append_stats_torch(ids, offsets, positions) -> AppendStats:
    pairs = torch.stack([ids.long(), offsets.long()], 1)
    same = (pairs[:, None, :] == pairs[None, :, :]).all(-1)
    dups = int(same.sum()) - len(ids)  # ordered pairs of distinct rows
    return AppendStats(
        int(ids.min()),
        int(ids.max()),
        int(offsets.min()),
        int(offsets.max()),
        None if positions is None else int(positions.min()),
        dups,
    )


@pytest.mark.parametrize("batch", [1, 2, 31, 33, 130])
@pytest.mark.parametrize("with_positions", [False, True])
def test_append_stats_kernel_matches_torch(batch, with_positions, device, monkeypatch):
    monkeypatch.setattr(validation, "_MAX_PROGRAMS", 2)  # programs loop over several row blocks
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(-3, 40, (batch,), generator=gen, dtype=torch.int32)
    offsets = torch.randint(0, 4, (batch,), generator=gen)
    positions = torch.randint(-2, 9, (batch,), generator=gen) if with_positions else None
    got = validation.append_metadata_stats(
        ids.to(device), offsets.to(device), None if positions is None else positions.to(device)
    )
    assert got == _append_stats_torch(ids, offsets, positions)
    distinct = torch.randperm(4 * batch, generator=gen)  # distinct slots: no duplicates
    got = validation.append_metadata_stats(
        (distinct // 4).to(device), (distinct % 4).to(device), None
    )
    assert got.duplicate_slots == 0


# --------------------------------------------------------------------------------------------
# the cache, through the public calls
# --------------------------------------------------------------------------------------------
@pytest.fixture
def reads(monkeypatch):
    """Counts the stats reads of decode and of the append calls."""
    count = {"decode": 0, "append": 0}

    def counting(module, name, kind):
        real = getattr(module, name)

        def wrapper(*args):
            count[kind] += 1
            return real(*args)

        monkeypatch.setattr(module, name, wrapper)

    counting(paged_decode, "decode_metadata_stats", "decode")
    counting(append, "append_metadata_stats", "append")
    return count


def _decode_case(device, seq_lens=(37, 0, 9)):
    k, v, tables, lens, _, _ = make_paged_kv(list(seq_lens), 2, 16, 8, torch.float32, device)
    q = torch.randn(len(seq_lens), 4, 16, generator=torch.Generator().manual_seed(5)).to(device)
    return q, k, v, tables, lens


def _assert_decode_matches(out, q, k, v, tables, lens):
    atol, rtol = TOLERANCES[torch.float32]
    ref = paged_decode_attention_ref(q, k, v, tables, lens)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_decode_reads_once_per_unmodified_metadata(reads, device):
    q, k, v, tables, lens = _decode_case(device)
    decode(q, k, v, tables, lens)
    decode(q, k, v, tables, lens)
    assert reads["decode"] == 1
    decode(q, k, v, tables.clone(), lens)  # a fresh tensor: read again
    assert reads["decode"] == 2
    clear_validation_cache()
    decode(q, k, v, tables, lens)
    assert reads["decode"] == 3


def test_in_place_edit_invalidates(reads, device):
    q, k, v, tables, lens = _decode_case(device)
    _assert_decode_matches(decode(q, k, v, tables, lens), q, k, v, tables, lens)
    tables[0, 1] = k.shape[0]  # out of range, in a used entry
    with pytest.raises(ValueError, match="block id"):
        decode(q, k, v, tables, lens)
    with pytest.raises(ValueError, match="block id"):  # a rejected table is never cached
        decode(q, k, v, tables, lens)
    tables[0, 1] = tables[0, 0]  # valid again, through another in-place write
    _assert_decode_matches(decode(q, k, v, tables, lens), q, k, v, tables, lens)
    lens.add_(1000)  # the lengths too
    with pytest.raises(ValueError, match="seq_lens"):
        decode(q, k, v, tables, lens)
    assert reads["decode"] == 5


def test_unused_table_entries_are_ignored(device):
    q, k, v, tables, lens = _decode_case(device, seq_lens=(9, 0, 17))
    wide = torch.full((3, tables.shape[1] + 4), -7, dtype=torch.int32, device=device)
    wide[:, : tables.shape[1]] = tables
    wide[0, 2:] = 10**9  # request 0 uses 2 blocks of 8 tokens
    wide[1, :] = -(2**31)  # request 1 uses none
    out = decode(q, k, v, wide, lens)
    _assert_decode_matches(out, q, k, v, tables, lens)


def test_inference_tensors_are_never_cached(reads, device):
    q, k, v, tables, lens = _decode_case(device)
    with torch.inference_mode():
        tables_i, lens_i = tables.clone(), lens.clone()
    decode(q, k, v, tables_i, lens_i)
    decode(q, k, v, tables_i, lens_i)
    assert reads["decode"] == 2


def test_the_cache_is_bounded_and_keys_need_the_same_objects():
    clear_validation_cache()
    keep = []
    for i in range(validation._MAX_CACHED + 10):
        a, b = torch.zeros(1), torch.zeros(1)
        keep.append((a, b))
        validation.remember(("test", i), i, a, b)
    assert len(validation._VALIDATED) == validation._MAX_CACHED
    a, b = keep[-1]
    key = ("test", len(keep) - 1)
    assert validation.lookup(key, a, b) == len(keep) - 1
    assert validation.lookup(key, b, a) is None  # another object under the same key
    assert key not in validation._VALIDATED
    clear_validation_cache()
    assert not validation._VALIDATED


def _append_case(device, batch=4):
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(6, 2, 8, 16, generator=gen).to(device)
    v_cache = torch.randn(6, 2, 8, 16, generator=gen).to(device)
    slots = torch.tensor([17, 3, 40, 26])[:batch]
    return {
        "q": torch.randn(batch, 4, 16, generator=gen).to(device),
        "k": torch.randn(batch, 2, 16, generator=gen).to(device),
        "v": torch.randn(batch, 2, 16, generator=gen).to(device),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_ids": (slots // 8).to(device),
        "offsets": (slots % 8).to(device=device, dtype=torch.int32),
        "positions": torch.randint(0, 100, (batch,), generator=gen).to(device),
    }


def _fused(t, **kwargs):
    return fused_rope_kv_append(
        t["q"],
        t["k"],
        t["v"],
        t["k_cache"],
        t["v_cache"],
        t["block_ids"],
        t["offsets"],
        t["positions"],
        **kwargs,
    )


def test_append_calls_read_once_and_see_in_place_edits(reads, device):
    t = _append_case(device)
    kv_append(t["k_cache"], t["v_cache"], t["k"], t["v"], t["block_ids"], t["offsets"])
    kv_append(t["k_cache"], t["v_cache"], t["k"], t["v"], t["block_ids"], t["offsets"])
    assert reads["append"] == 1
    _fused(t)  # positions join the key: a separate entry
    _fused(t)
    assert reads["append"] == 2
    t["offsets"][1] = t["offsets"][0]
    t["block_ids"][1] = t["block_ids"][0]  # now two rows share a slot
    k_before, v_before = t["k_cache"].clone(), t["v_cache"].clone()
    with pytest.raises(ValueError, match="same"):
        _fused(t)
    with pytest.raises(ValueError, match="same"):
        kv_append(t["k_cache"], t["v_cache"], t["k"], t["v"], t["block_ids"], t["offsets"])
    t["block_ids"][1] = 5  # slot (5, 0): free again
    t["positions"][2] = -1
    with pytest.raises(ValueError, match="positions"):
        _fused(t)
    assert torch.equal(t["k_cache"], k_before) and torch.equal(t["v_cache"], v_before)
    t["positions"][2] = 5
    q_rot = _fused(t)
    ref = apply_rope(t["q"], t["positions"])
    torch.testing.assert_close(q_rot, ref, atol=2e-3, rtol=2e-3)
    assert reads["append"] == 6
