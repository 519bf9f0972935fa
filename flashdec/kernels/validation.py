"""Range checks of paged metadata on the device, read back in one small transfer, and a cache of
what they established.

The public eager calls (``decode`` and ``extend`` without a workspace, ``kv_append``,
``fused_rope_kv_append``) must reject out-of-range ids before a kernel reads or writes through
them. Copying a block table to the host for that costs more than the attention itself, so one
tiny kernel reduces the metadata to a few numbers per program (min/max/sum of the lengths, of
the query lengths, min/max of the *used* block ids; or min/max of ids, offsets and positions and
a count of rows sharing a slot) and the host reads those back at once.
:func:`flashdec._checks.check_paged_decode_stats` / :func:`~flashdec._checks.check_append_stats`
then judge them.

What a read established is cached per metadata *identity*: the tensor object (held by weak
reference), its data pointer, shape, strides, dtype, device and PyTorch version counter, plus the
cache geometry. Every in-place write through PyTorch bumps the version counter, so an edited
table is checked again; a tensor written behind PyTorch's back (a custom kernel, a CUDA-graph
replay, ``.data``, a NumPy or DLPack view) must be passed as a fresh tensor, or the cache
emptied with :func:`clear_validation_cache`. Inference-mode tensors have no version counter and
are never cached.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

import torch
import triton
import triton.language as tl

from flashdec._checks import AppendStats, PagedDecodeDims, PagedDecodeStats, QueryLenStats
from flashdec.kernels._runtime import Launcher

# stands for "no value" in the min/max reductions (ids and lengths are far smaller)
_BIG = tl.constexpr(2**62)
_STATS_WIDTH = tl.constexpr(16)  # int64 slots per program in the stats output
_MAX_PROGRAMS = 16  # enough to spread a large table; few rows to read back and reduce
_DECODE_TILE = 1024  # table entries per loop step of one program
_APPEND_COLS = 64


@triton.jit(do_not_specialize=["batch"])  # one kernel for every batch size (no recompiles)
def _decode_metadata_kernel(
    tables_ptr,
    lens_ptr,
    qlens_ptr,  # read only with QUERIES
    out_ptr,
    batch,
    max_blocks,
    block_size,
    stride_tb,
    stride_tn,
    stride_l,
    stride_q,
    window,
    WINDOWED: tl.constexpr,
    QUERIES: tl.constexpr,  # extend: query_lens given (min/max/sum, excess over seq_lens)
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    # per program: min/max of seq_lens, the sum of the attended lengths, and min/max of the
    # table entries its rows read; with QUERIES also min/max/sum of query_lens and the largest
    # query_len - seq_len
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_r0 = tl.arange(0, ROWS)
    offs_c0 = tl.arange(0, COLS)
    len_min = tl.full([ROWS], _BIG, tl.int64)
    len_max = tl.full([ROWS], -_BIG, tl.int64)
    len_sum = tl.zeros([ROWS], tl.int64)
    id_min = tl.full([ROWS, COLS], _BIG, tl.int64)
    id_max = tl.full([ROWS, COLS], -_BIG, tl.int64)
    q_min = tl.full([ROWS], _BIG, tl.int64)
    q_max = tl.full([ROWS], -_BIG, tl.int64)
    q_excess = tl.full([ROWS], -_BIG, tl.int64)
    q_sum = tl.zeros([ROWS], tl.int64)
    for r0 in range(pid * ROWS, batch, num_programs * ROWS):
        offs_r = r0 + offs_r0
        valid_r = offs_r < batch
        lens = tl.load(lens_ptr + offs_r * stride_l, mask=valid_r, other=0).to(tl.int64)
        len_min = tl.minimum(len_min, tl.where(valid_r, lens, _BIG))
        len_max = tl.maximum(len_max, tl.where(valid_r, lens, -_BIG))
        # entries past a request's used blocks are unspecified: never read
        used = tl.minimum((tl.maximum(lens, 0) + block_size - 1) // block_size, max_blocks)
        rows = tables_ptr + offs_r.to(tl.int64)[:, None] * stride_tb
        if QUERIES:
            qls = tl.load(qlens_ptr + offs_r * stride_q, mask=valid_r, other=0).to(tl.int64)
            q_min = tl.minimum(q_min, tl.where(valid_r, qls, _BIG))
            q_max = tl.maximum(q_max, tl.where(valid_r, qls, -_BIG))
            q_excess = tl.maximum(q_excess, tl.where(valid_r, qls - lens, -_BIG))
            q_sum += tl.where(valid_r, qls, 0)
            # the first new token's window reaches query_len - 1 tokens further back
            reach = window + qls - 1
        else:
            reach = window
        if WINDOWED:
            # nor are those of blocks wholly before the window (a cache may have released them)
            len_sum += tl.minimum(lens, reach)
            first = tl.maximum(lens - reach, 0) // block_size
            first = tl.where(valid_r, first, max_blocks)
            c_lo = (tl.min(first, 0) // COLS * COLS).to(tl.int32)
        else:
            len_sum += lens
            first = tl.zeros([ROWS], tl.int64)
            c_lo = 0
        for c0 in range(c_lo, tl.max(used, 0).to(tl.int32), COLS):
            offs_c = c0 + offs_c0
            m = offs_c[None, :] < used[:, None]
            if WINDOWED:
                m = m & (offs_c[None, :] >= first[:, None])
            ids = tl.load(rows + offs_c[None, :] * stride_tn, mask=m, other=0).to(tl.int64)
            id_min = tl.minimum(id_min, tl.where(m, ids, _BIG))
            id_max = tl.maximum(id_max, tl.where(m, ids, -_BIG))
    out = out_ptr + pid * _STATS_WIDTH
    tl.store(out, tl.min(len_min, 0))
    tl.store(out + 1, tl.max(len_max, 0))
    tl.store(out + 2, tl.sum(len_sum, 0))
    tl.store(out + 3, tl.min(tl.min(id_min, 1), 0))
    tl.store(out + 4, tl.max(tl.max(id_max, 1), 0))
    if QUERIES:
        tl.store(out + 5, tl.min(q_min, 0))
        tl.store(out + 6, tl.max(q_max, 0))
        tl.store(out + 7, tl.max(q_excess, 0))
        tl.store(out + 8, tl.sum(q_sum, 0))


@triton.jit(do_not_specialize=["batch"])  # one kernel for every batch size (no recompiles)
def _append_metadata_kernel(
    ids_ptr,
    offsets_ptr,
    positions_ptr,
    out_ptr,
    batch,
    stride_i,
    stride_o,
    stride_p,
    HAS_POSITIONS: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    # per program: min/max of ids and offsets, min of positions, and how many (row, other row)
    # pairs of its rows target the same (id, offset) slot
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_r0 = tl.arange(0, ROWS)
    offs_c0 = tl.arange(0, COLS)
    id_min = tl.full([ROWS], _BIG, tl.int64)
    id_max = tl.full([ROWS], -_BIG, tl.int64)
    off_min = tl.full([ROWS], _BIG, tl.int64)
    off_max = tl.full([ROWS], -_BIG, tl.int64)
    pos_min = tl.full([ROWS], _BIG, tl.int64)
    dups = tl.zeros([ROWS], tl.int32)
    for r0 in range(pid * ROWS, batch, num_programs * ROWS):
        offs_r = r0 + offs_r0
        valid_r = offs_r < batch
        ids_r = tl.load(ids_ptr + offs_r * stride_i, mask=valid_r, other=0).to(tl.int64)
        slot_r = tl.load(offsets_ptr + offs_r * stride_o, mask=valid_r, other=0).to(tl.int64)
        id_min = tl.minimum(id_min, tl.where(valid_r, ids_r, _BIG))
        id_max = tl.maximum(id_max, tl.where(valid_r, ids_r, -_BIG))
        off_min = tl.minimum(off_min, tl.where(valid_r, slot_r, _BIG))
        off_max = tl.maximum(off_max, tl.where(valid_r, slot_r, -_BIG))
        if HAS_POSITIONS:
            pos = tl.load(positions_ptr + offs_r * stride_p, mask=valid_r, other=0).to(tl.int64)
            pos_min = tl.minimum(pos_min, tl.where(valid_r, pos, _BIG))
        for c0 in range(0, batch, COLS):
            offs_c = c0 + offs_c0
            valid_c = offs_c < batch
            ids_c = tl.load(ids_ptr + offs_c * stride_i, mask=valid_c, other=0).to(tl.int64)
            slot_c = tl.load(offsets_ptr + offs_c * stride_o, mask=valid_c, other=0).to(tl.int64)
            same = (ids_r[:, None] == ids_c[None, :]) & (slot_r[:, None] == slot_c[None, :])
            same = same & valid_r[:, None] & valid_c[None, :]
            same = same & (offs_r[:, None] != offs_c[None, :])
            dups += tl.sum(same.to(tl.int32), 1)
    out = out_ptr + pid * _STATS_WIDTH
    tl.store(out, tl.min(id_min, 0))
    tl.store(out + 1, tl.max(id_max, 0))
    tl.store(out + 2, tl.min(off_min, 0))
    tl.store(out + 3, tl.max(off_max, 0))
    tl.store(out + 4, tl.min(pos_min, 0))
    tl.store(out + 5, tl.sum(dups, 0).to(tl.int64))


_DECODE_METADATA = Launcher(_decode_metadata_kernel)
_APPEND_METADATA = Launcher(_append_metadata_kernel)


def decode_metadata_stats(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: PagedDecodeDims,
    window: int | None = None,
) -> PagedDecodeStats:
    """:class:`PagedDecodeStats` of validated-shape metadata: one launch, one small read. With a
    sliding ``window`` only the entries of blocks holding a row's last ``window`` tokens count
    (the same as :func:`flashdec._checks.paged_decode_stats`)."""
    if dims.batch == 0:
        return PagedDecodeStats(0, 0, 0, None, None)
    return _decode_stats(_metadata_columns(block_tables, seq_lens, None, dims, window))


def extend_metadata_stats(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    dims: PagedDecodeDims,
    window: int | None = None,
) -> tuple[PagedDecodeStats, QueryLenStats]:
    """:func:`decode_metadata_stats` of an extend call (batch > 0), and its
    :class:`QueryLenStats`, in the same launch and read. With a ``window`` a row's entries count
    from its first new token's window on (``paged_decode_stats(..., query_lens=)``)."""
    cols = _metadata_columns(block_tables, seq_lens, query_lens, dims, window)
    queries = QueryLenStats(min(cols[5]), max(cols[6]), max(cols[7]), sum(cols[8]))
    return _decode_stats(cols), queries


def _metadata_columns(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    dims: PagedDecodeDims,
    window: int | None,
) -> list[tuple[int, ...]]:
    """The stats kernel's output, one tuple per slot over its programs (the one read)."""
    rows = 16  # fixed: a constexpr per batch size would compile a kernel per size class
    programs = min(triton.cdiv(dims.batch, rows), _MAX_PROGRAMS)
    out = torch.empty(programs, _STATS_WIDTH.value, dtype=torch.int64, device=seq_lens.device)
    qlens = seq_lens if query_lens is None else query_lens  # a stand-in pointer, never read
    _DECODE_METADATA(
        programs,
        (block_tables, seq_lens, qlens, out),
        (
            dims.batch,
            dims.max_blocks_per_seq,
            dims.block_size,
            block_tables.stride(0),
            block_tables.stride(1),
            seq_lens.stride(0),
            qlens.stride(0),
            0 if window is None else window,
        ),
        (window is not None, query_lens is not None, rows, _DECODE_TILE // rows),
        num_warps=4,
    )
    return list(zip(*out.tolist(), strict=True))  # the one device -> host transfer


def _decode_stats(cols: list[tuple[int, ...]]) -> PagedDecodeStats:
    min_id = min(cols[3])
    used = min_id != _BIG.value
    return PagedDecodeStats(
        min(cols[0]),
        max(cols[1]),
        sum(cols[2]),
        min_id if used else None,
        max(cols[4]) if used else None,
    )


def append_metadata_stats(
    block_ids: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor | None
) -> AppendStats:
    """:class:`AppendStats` of validated-shape slot metadata (batch > 0): one launch, one small
    read."""
    batch = block_ids.shape[0]
    rows = 32  # fixed, as in _metadata_columns
    programs = min(triton.cdiv(batch, rows), _MAX_PROGRAMS)
    out = torch.empty(programs, _STATS_WIDTH.value, dtype=torch.int64, device=block_ids.device)
    has_positions = positions is not None
    pos = positions if has_positions else block_ids  # a stand-in pointer, never read
    _APPEND_METADATA(
        programs,
        (block_ids, offsets, pos, out),
        (batch, block_ids.stride(0), offsets.stride(0), pos.stride(0)),
        (has_positions, rows, _APPEND_COLS),
        num_warps=4,
    )
    cols = list(zip(*out.tolist(), strict=True))  # the one device -> host transfer
    return AppendStats(
        min(cols[0]),
        max(cols[1]),
        min(cols[2]),
        max(cols[3]),
        min(cols[4]) if has_positions else None,
        sum(cols[5]),
    )


# --------------------------------------------------------------------------------------------
# the validation cache
# --------------------------------------------------------------------------------------------
_MAX_CACHED = 256
_VALIDATED: dict[Hashable, tuple[tuple[weakref.ref | None, ...], object]] = {}


def metadata_key(tensor: torch.Tensor) -> Hashable:
    """Identity of a metadata tensor's current contents as far as PyTorch can tell.

    Raises RuntimeError for inference tensors (no version counter). ``id`` alone could be reused
    by a new tensor at a recycled address; the weak reference kept beside each entry rules that
    out.
    """
    return (
        id(tensor),
        tensor.data_ptr(),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor._version,
    )


def lookup(
    key: Hashable, first: torch.Tensor, second: torch.Tensor, third: torch.Tensor | None = None
) -> object | None:
    """What was validated under ``key`` for exactly these tensor objects, or None."""
    entry = _VALIDATED.get(key)
    if entry is None:
        return None
    (ref1, ref2, ref3), value = entry
    if ref1() is first and ref2() is second and (ref3 is None or ref3() is third):
        return value
    del _VALIDATED[key]  # a dead tensor's id was reused
    return None


def remember(
    key: Hashable,
    value: object,
    first: torch.Tensor,
    second: torch.Tensor,
    third: torch.Tensor | None = None,
) -> None:
    if len(_VALIDATED) >= _MAX_CACHED:
        del _VALIDATED[next(iter(_VALIDATED))]  # oldest first
    refs = (weakref.ref(first), weakref.ref(second), None if third is None else weakref.ref(third))
    _VALIDATED[key] = (refs, value)


def clear_validation_cache() -> None:
    """Forget every validated metadata tensor: the next eager ``decode`` / ``extend`` /
    ``kv_append`` / ``fused_rope_kv_append`` checks its metadata again. Needed only after
    writing a metadata tensor behind PyTorch's back (see :mod:`flashdec.kernels.validation`)."""
    _VALIDATED.clear()
