"""Launch planning for the paged extend kernel (several new tokens per request): tile shape,
split-KV, workspace.

An :class:`ExtendPlan` fixes what a launch needs once per batch layout, like
:class:`~flashdec.kernels.decode_plan.DecodePlan`: the query tile, the KV tile, warps and pipeline
depth, and how many splits each tile's KV range is cut into. An :class:`ExtendWorkspace` holds the
fixed-address buffers of one plan, so that ``extend(..., workspace=ws)`` allocates nothing and
never synchronises with the host (CUDA-graph capturable).

The query tile packs the new tokens of one request times the ``G = Hq / Hkv`` query heads of one
KV head into its ``BLOCK_M`` rows (row ``r``: token ``r // G``, head ``r % G``), so that the K/V
a program loads serve all G heads, and a verification step of a few tokens still fills a
tensor-core tile (4 tokens x group 4 = 16 rows). ``BLOCK_M`` follows the longest request's rows
(``max_query_len * G``): a prompt chunk gets the FlashAttention-2 tile of 128 rows (compute
bound), a verification step the smallest power of two >= 16 that holds all its rows, so its
KV is read once per (request, KV head) — memory bound, tiled like decode.

The grid is an upper bound on the tiles, ``(total_q * G + batch * (BLOCK_M - 1)) // BLOCK_M``,
times the KV heads and the splits; each program finds its request from the device-side
``query_lens`` (a prefix sum over the batch), so a plan serves any batch of at most ``batch``
requests and ``total_q`` rows, whatever their lengths, and programs past the last tile exit.

Split-KV (few tiles over long contexts: a verification step at batch 1, a short chunk over 32k
tokens) reuses decode's heuristic, counted in tiles instead of requests: the work is cut so that
about ``programs_per_sm`` programs land on every SM, never below a minimum split length, and
never into more than :data:`MAX_MERGE_ROWS` partial rows per tile. The last split of a tile to
finish merges the partial results by log-sum-exp in the same launch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch

from flashdec._checks import (
    check_positive_int,
    check_window,
)
from flashdec.kernels._runtime import next_power_of_2, sm_count
from flashdec.kernels.decode_plan import (
    DEFAULT_MIN_TOKENS_PER_SPLIT,
    DEFAULT_PROGRAMS_PER_SM,
    LOAD_REGIMES,
    MAX_SPLITS,
    AttentionPlanShape,
    KernelConfig,
    balance_splits,
    check_attention_plan_args,
    default_kernel_config,
    split_count,
    target_tokens_per_split,
)

# Query rows of a prompt chunk's tile (tokens x group heads): the FlashAttention-2 tile, compute
# bound; head_dim 256 halves it (the fp32 accumulator is BLOCK_M x 256).
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_M_256 = 64
# The batch scan's width (a constexpr): at least 64 so that every batch of a serving loop with up
# to 64 requests shares one compiled kernel (a wider masked scan costs nothing measurable).
MIN_BLOCK_B = 64
# K+V bytes per loop step of a prompt chunk's tile (in q's dtype).
PREFILL_TILE_BYTES = 32 * 1024
# A split of a 128-row tile writes and merges 128 partial rows: longer splits than decode's.
PREFILL_MIN_TOKENS_PER_SPLIT = 512
# Partial rows one tile's merge reads at most (an automatic split count stops there): a single
# program merges them, so a 64-row tile cut 65 ways (a verification step at batch 1 over 32k
# tokens) spends longer merging than reading its keys.
MAX_MERGE_ROWS = 1024


def default_block_m(max_query_len: int, group: int, head_dim: int) -> int:
    """Query rows per tile: every row of the longest request when they fit in a prefill tile,
    else the prefill tile (>= 16 rows so ``tl.dot`` runs on tensor cores)."""
    cap = PREFILL_BLOCK_M if head_dim <= 128 else PREFILL_BLOCK_M_256
    return min(cap, max(16, next_power_of_2(max_query_len * group)))


def extend_kernel_config(
    block_m: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    programs_per_sm: float = 0.0,
    kv_dtype: torch.dtype | None = None,
) -> KernelConfig:
    """KV tile, warps and stages for a tile of ``block_m`` query rows.

    Up to 32 rows the kernel is decode with a few more rows: memory bound, and decode's tuned
    table applies (:func:`~flashdec.kernels.decode_plan.default_kernel_config`). Wider tiles are
    compute bound, FlashAttention-2 style: :data:`PREFILL_TILE_BYTES` of K and V per step (64
    keys at head_dim 128 in bf16), counted in q's dtype (an FP8 tile is converted to it on chip
    and staged at that size), three pipeline stages while the query tile and the stages fit in
    shared memory (128 x 128 bf16: 32 KiB + 3 x 32 KiB), two beyond (head_dim 256, fp32), and
    8 warps for 128 rows or head_dim 256. First choices, to be confirmed by
    ``benchmarks/bench_extend.py --sweep``.
    """
    block_d = max(16, next_power_of_2(head_dim))
    if block_m <= 32:
        return default_kernel_config(
            head_dim, dtype, programs_per_sm=programs_per_sm, kv_dtype=kv_dtype
        )
    elem = torch.empty((), dtype=dtype).element_size()
    block_n = min(128, max(16, PREFILL_TILE_BYTES // (2 * block_d * elem)))
    num_stages = 3 if block_d * elem <= 256 else 2
    num_warps = 8 if block_m >= 128 or block_d >= 256 else 4
    return KernelConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages)


@dataclass(frozen=True)
class ExtendPlan(AttentionPlanShape):
    """Launch configuration of one paged extend batch layout (see :func:`plan_extend`)."""

    batch: int  # at most this many requests
    total_q: int  # at most this many new tokens (q's rows) over the batch
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # the cache's page size
    max_seq_len: int  # sizes the splits; longer requests stay correct (their last split)
    max_query_len: int  # sizes the query tile; longer requests stay correct (more tiles)
    max_blocks_per_seq: int
    dtype: torch.dtype
    device: torch.device
    kv_layout: str
    num_splits: int  # splits per tile; 1 = single pass
    tokens_per_split: int  # a multiple of block_n; a tile's last split takes any excess
    block_m: int  # query rows per tile (tokens x group heads), >= 16
    block_d: int
    block_n: int  # keys per loop step
    num_warps: int
    num_stages: int
    max_tiles: int  # the grid's tile slots: an upper bound over every batch the plan serves
    block_b: int  # requests scanned to find a tile's request (power of two >= batch, >= 64)
    sm_count: int
    window: int | None = None  # sliding window: query at p attends to (p - window, p]
    kv_dtype: torch.dtype | None = None  # the cache's dtype (None: q's); float8_e4m3fn = FP8

    @property
    def num_programs(self) -> int:
        return self.max_tiles * self.num_kv_heads * self.num_splits

    def allocate_workspace(self) -> ExtendWorkspace:
        return ExtendWorkspace.allocate(self)


@dataclass(frozen=True)
class ExtendWorkspace:
    """Fixed-address buffers for ``extend(..., workspace=ws)``: no allocation, no host sync.

    ``out [total_q, Hq, D]`` is the default output. A split plan also has ``partial_out
    [max_tiles, Hkv, num_splits, block_m, D]`` and ``partial_lse [max_tiles, Hkv, num_splits,
    block_m]`` (float32: each split's normalised output and log2-sum-exp per tile row) and
    ``counters [max_tiles, Hkv]`` int32, the splits of each tile that have stored their partials
    (zero before a launch, and every launch leaves them zero, so CUDA-graph replays start
    clean); a single-pass plan leaves those three empty. One workspace serves every layer of a
    step, on one stream.
    """

    plan: ExtendPlan
    out: torch.Tensor
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, plan: ExtendPlan) -> ExtendWorkspace:
        if not isinstance(plan, ExtendPlan):
            raise TypeError(f"plan must be an ExtendPlan, got {type(plan).__name__}")
        out = torch.empty(
            plan.total_q, plan.num_q_heads, plan.head_dim, dtype=plan.dtype, device=plan.device
        )
        return cls(plan, out, *allocate_partials(plan))


def allocate_partials(plan: ExtendPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split plan's ``partial_out``, ``partial_lse`` and zeroed ``counters`` (see
    :class:`ExtendWorkspace`); empty tensors for a single-pass plan."""
    tiles = plan.max_tiles if plan.uses_split else 0
    hkv, splits, rows, dev = plan.num_kv_heads, plan.num_splits, plan.block_m, plan.device
    return (
        torch.empty(tiles, hkv, splits, rows, plan.head_dim, dtype=torch.float32, device=dev),
        torch.empty(tiles, hkv, splits, rows, dtype=torch.float32, device=dev),
        torch.zeros(tiles, hkv, dtype=torch.int32, device=dev),
    )


def max_tiles(batch: int, total_q: int, group: int, block_m: int) -> int:
    """Upper bound on ``sum_b ceil(query_len_b * group / block_m)`` over every split of
    ``total_q`` tokens into ``batch`` requests (at least one tile per request)."""
    return max(1, (total_q * group + batch * (block_m - 1)) // block_m)


def plan_extend(
    batch: int,
    total_q: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_layout: str = "token_major",
    max_blocks_per_seq: int | None = None,
    *,
    max_query_len: int | None = None,
    window: int | None = None,
    kv_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    tokens_per_split: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM,
    min_tokens_per_split: int | None = None,
) -> ExtendPlan:
    """Compute the launch configuration of an extend batch layout.

    The plan serves every call with at most ``batch`` requests and ``total_q`` new tokens (q's
    rows). ``max_seq_len`` (the longest request, new tokens included) and ``max_query_len`` (its
    most new tokens; default ``total_q - batch + 1``) only size the tiles and splits: longer
    requests are still computed correctly. ``window`` makes every launch of the plan a
    sliding-window one. ``kv_dtype=torch.float8_e4m3fn`` plans an FP8 cache beside fp16/bf16
    ``dtype``.

    ``num_splits`` / ``tokens_per_split`` force the split, ``block_m`` / ``block_n`` (powers of
    two >= 16) / ``num_warps`` / ``num_stages`` override the tile table (tests, tuning).
    """
    for name, value in (
        ("batch", batch),
        ("total_q", total_q),
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
    ):
        check_positive_int(name, value)
    check_positive_int("max_seq_len", max_seq_len, minimum=0)
    if total_q < batch:
        raise ValueError(f"total_q ({total_q}) must be >= batch ({batch}): one token each at least")
    window = check_window(window)
    kv_dtype, device = check_attention_plan_args(
        num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype, kv_layout, device
    )
    if max_query_len is None:
        max_query_len = total_q - batch + 1
    check_positive_int("max_query_len", max_query_len)
    max_query_len = min(max_query_len, total_q)
    if max_blocks_per_seq is None:
        max_blocks_per_seq = max(1, math.ceil(max_seq_len / block_size))
    check_positive_int("max_blocks_per_seq", max_blocks_per_seq)
    group = num_q_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))

    if block_m is None:
        block_m = default_block_m(max_query_len, group, head_dim)
    else:
        _check_tile("block_m", block_m)
    tiles = max_tiles(batch, total_q, group, block_m)
    num_sms = sm_count(device)
    # keys a tile reads: its request's context and new tokens, or the first new token's window
    read_len = max(1, max_seq_len)
    if window is not None:
        read_len = min(read_len, window + max_query_len - 1)
    # tiles a typical batch fills (the grid's bound counts a partial tile for every request)
    rows_per_request = math.ceil(total_q * group / batch)
    expected_tiles = batch * math.ceil(rows_per_request / block_m)
    if min_tokens_per_split is None:
        min_tokens_per_split = (
            DEFAULT_MIN_TOKENS_PER_SPLIT if block_m <= 64 else PREFILL_MIN_TOKENS_PER_SPLIT
        )
    check_positive_int("min_tokens_per_split", min_tokens_per_split)
    if num_splits is not None:
        check_positive_int("num_splits", num_splits)
    if tokens_per_split is not None:
        check_positive_int("tokens_per_split", tokens_per_split)
    target = None
    if num_splits is None and tokens_per_split is None:
        merge_bound = math.ceil(read_len / max(1, MAX_MERGE_ROWS // block_m))
        target = target_tokens_per_split(
            expected_tiles,
            expected_tiles * read_len,
            read_len,
            num_kv_heads,
            num_sms,
            programs_per_sm=programs_per_sm,
            min_tokens_per_split=max(min_tokens_per_split, merge_bound),
        )
        will_split = split_count(read_len, target) > 1
    elif num_splits is not None:
        will_split = num_splits > 1
    else:
        will_split = tokens_per_split < read_len
    load = 0.0 if will_split else expected_tiles * num_kv_heads / num_sms
    config = extend_kernel_config(block_m, head_dim, dtype, programs_per_sm=load, kv_dtype=kv_dtype)
    if block_n is not None:
        _check_tile("block_n", block_n)
        config = dataclasses.replace(config, block_n=block_n)
    if num_warps is not None:
        check_positive_int("num_warps", num_warps)
        if num_warps & (num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {num_warps}")
        config = dataclasses.replace(config, num_warps=num_warps)
    if num_stages is not None:
        check_positive_int("num_stages", num_stages)
        config = dataclasses.replace(config, num_stages=num_stages)
    bn = config.block_n

    if tokens_per_split is not None:
        if tokens_per_split % bn:
            raise ValueError(f"tokens_per_split must be a multiple of block_n={bn}")
        splits = num_splits or max(1, math.ceil(read_len / tokens_per_split))
        per_split = tokens_per_split
    elif num_splits is not None:
        splits = num_splits
        per_split = max(bn, math.ceil(math.ceil(read_len / splits) / bn) * bn)
    else:
        splits, per_split = balance_splits(read_len, target, bn)
    if splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be <= {MAX_SPLITS}, got {splits}")

    return ExtendPlan(
        batch=batch,
        total_q=total_q,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_seq_len=max_seq_len,
        max_query_len=max_query_len,
        max_blocks_per_seq=max_blocks_per_seq,
        dtype=dtype,
        device=device,
        kv_layout=kv_layout,
        num_splits=splits,
        tokens_per_split=per_split,
        block_m=block_m,
        block_d=block_d,
        block_n=bn,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        max_tiles=tiles,
        block_b=max(MIN_BLOCK_B, next_power_of_2(batch)),
        sm_count=num_sms,
        window=window,
        kv_dtype=kv_dtype,
    )


def extend_plan_variants(
    max_batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    max_blocks_per_seq: int,
    window: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> list[ExtendPlan]:
    """One plan per kernel variant that :func:`plan_extend` can choose for calls of up to
    ``max_batch`` requests of this geometry: each compile-time choice (query tile height, KV
    tile, warps and stages, single pass or split, batch tile), planned for one new token per
    request. Launching each once builds every kernel such calls can need (a warm start), so
    that no serving step waits for a compile."""
    check_positive_int("max_batch", max_batch)
    cap = PREFILL_BLOCK_M if head_dim <= 128 else PREFILL_BLOCK_M_256
    heights = [16 << i for i in range((cap // 16).bit_length())]
    top = max(MIN_BLOCK_B, next_power_of_2(max_batch))
    # batch sizes whose batch tile (block_b) is each power of two from MIN_BLOCK_B to top
    batches = [1] + [MIN_BLOCK_B << i for i in range(1, (top // MIN_BLOCK_B).bit_length())]
    variants = []
    for block_m in heights:
        for num_splits in (1, 2):
            # a single-pass launch's KV tile follows its load; a split one is planned at load 0
            loads = LOAD_REGIMES if num_splits == 1 else (0.0,)
            configs = dict.fromkeys(
                extend_kernel_config(
                    block_m, head_dim, dtype, programs_per_sm=load, kv_dtype=kv_dtype
                )
                for load in loads
            )
            for config, batch in itertools.product(configs, batches):
                variants.append(
                    plan_extend(
                        batch,
                        batch,
                        num_q_heads,
                        num_kv_heads,
                        head_dim,
                        block_size,
                        2 * config.block_n,
                        dtype,
                        device,
                        max_blocks_per_seq=max_blocks_per_seq,
                        max_query_len=1,
                        window=window,
                        kv_dtype=kv_dtype,
                        num_splits=num_splits,
                        block_m=block_m,
                        block_n=config.block_n,
                        num_warps=config.num_warps,
                        num_stages=config.num_stages,
                    )
                )
    return variants


def _check_tile(name: str, value: object) -> None:
    check_positive_int(name, value, minimum=16)
    if value & (value - 1):  # type: ignore[operator]
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
