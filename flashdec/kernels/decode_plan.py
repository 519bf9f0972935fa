"""Launch planning for the paged decode kernel: split-KV heuristic, tile table, workspace.

A :class:`DecodePlan` is computed once per batch layout (like FlashInfer's ``plan()``) and fixes
everything the launch needs: tile sizes, warps, pipeline depth and — the part that matters most
for speed — how many splits each request's KV is cut into. A :class:`DecodeWorkspace` holds the
fixed-address buffers one plan needs, so a ``decode`` call with it allocates nothing and never
synchronises with the host (CUDA-graph capturable).

Split-KV heuristic: the work is counted in token-heads (tokens x KV heads) over the whole batch
and cut into equal pieces, sized so that about ``programs_per_sm`` work items land on every SM
(rounded down: a third program on a few SMs would double their time). A long request therefore
gets many splits and a short one few, which keeps a skewed batch (one long request among many
short ones) nearly as fast as a uniform one. When the batch alone gives every SM enough
(request, KV head) programs, only requests longer than the mean are split. The tile width and
pipeline depth then follow from how many programs share an SM (:func:`default_kernel_config`).
Measurements behind every constant: ``benchmarks/results/decode_tuning.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from flashdec._checks import (
    FLOAT_DTYPES,
    FP8_DTYPE,
    check_kv_layout,
    check_positive_int,
    check_window,
    kv_dtype_matches,
)
from flashdec.kernels._runtime import next_power_of_2, sm_count

# Split path: (split, KV head) work items the heuristic aims for per SM. Two wide-tile programs
# per SM keep enough loads in flight; more splits only add partial-output traffic and merge work.
DEFAULT_PROGRAMS_PER_SM = 2
# Without splitting, this many (request, KV head) programs per SM already keep the GPU busy:
# then only requests longer than the batch's mean length are split (skewed batches).
NO_SPLIT_PROGRAMS_PER_SM = 1.5
# Cap on split-path programs per SM; beyond it programs loop over several work items.
MAX_PROGRAMS_PER_SM = 16
# A split shorter than this costs more in set-up and merge traffic than it gains in parallelism.
DEFAULT_MIN_TOKENS_PER_SPLIT = 128
# Upper bound on splits per request (keeps the merge loop and the workspace small).
MAX_SPLITS = 1024
# Merge launch: head dims per program. It runs where few (request, query head) pairs merge many
# splits (MQA, small KV at batch 1), so the head dimension is cut too: 32 float32 dims are one
# 128-byte line of each partial row, and head_dim 128 gives four times the programs.
MERGE_BLOCK_D = 32
# Merge launch without slices (enough (request, query head) pairs): splits per loop step.
MERGE_BLOCK_S = 32
# In-kernel merge ("the last split merges"): the last stage-1 program of a (request, KV head) to
# finish merges its G query heads' partials, saving the merge launch (~10 us of host time, 2-3 us
# of device gap even in a CUDA graph). One program then reads G x splits partial rows, a few
# chunks of up to MERGE_TILE_ELEMS floats; past this many rows a separate merge launch (one
# program per request x query head x MERGE_BLOCK_D dims) is faster (MQA with hundreds of splits).
FUSED_MERGE_MAX_ROWS = 256
MERGE_TILE_ELEMS = 8192
# K+V bytes one loop iteration gathers. A wide tile keeps more bytes in flight per program, which
# is what counts when only a few programs share an SM; a narrow one halves the shared memory of
# the three pipeline stages, so twice as many programs fit on an SM. What matters most is that
# the programs of a launch fit in whole waves (H200: benchmarks/results/decode_tuning.md):
# - up to 3 programs per SM: wide tile, 3 stages (about 3 resident per SM: one wave);
# - up to 6 per SM: narrow tile, 3 stages (about 6 resident: still one wave);
# - more: several waves anyway; wide tile, 2 stages (about 4 resident).
WIDE_TILE_BYTES = 32 * 1024
NARROW_TILE_BYTES = 16 * 1024
WIDE_TILE_MAX_PROGRAMS_PER_SM = 3
NARROW_TILE_MAX_PROGRAMS_PER_SM = 6
# one load (programs per SM) inside each of those three regimes
LOAD_REGIMES = (0.0, WIDE_TILE_MAX_PROGRAMS_PER_SM + 1.0, NARROW_TILE_MAX_PROGRAMS_PER_SM + 1.0)
# FP8 (e4m3) KV: how the kernel turns the one-byte tiles into MMA operands (DecodePlan fields).
# fp8_compute: the dots' dtype. "f16" folds the logit factor (sm_scale * log2(e) * k_scale) into
# q and runs both dots in fp16 (e4m3 -> fp16 is one cvt per two values on sm_90); "q" converts
# the tiles to q's dtype (e4m3 -> bf16 takes three cvts per two values).
FP8_COMPUTE_CHOICES = ("f16", "q")
DEFAULT_FP8_COMPUTE = "f16"
# fp8_staging: which tiles are converted in their load layout and reach the operand layout
# through shared memory as 16-bit values ("none": Triton reads e4m3 straight into the operand
# layout, V one byte per shared-memory load). benchmarks/results/decode_fp8_sass.md counts the
# sm_90 code of each choice ("kv" issues the fewest instructions per byte), but timed on the H200
# (decode_tuning_fp8.md, 32/8/128 B=16 L=16384) staging V alone is faster: f16/v 228 us against
# f16/kv 279 us and the old kernel (q/none) 335 us at the same tile.
FP8_STAGING_CHOICES = ("none", "v", "kv")
DEFAULT_FP8_STAGING = "v"
# fp8_tile: how default_kernel_config sizes an FP8 tile. "tokens": as many tokens as a tile of
# q's dtype (half its bytes); "bytes": as many bytes (twice the tokens, up to 256). Measured on
# the H200 (same shape): f16/v/bytes 187 us, the fastest variant (bf16 KV: 245 us; FlashInfer's
# FP8 decode: 203 us).
FP8_TILE_CHOICES = ("tokens", "bytes")
DEFAULT_FP8_TILE = "bytes"


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options of the decode kernel."""

    block_n: int  # tokens per loop iteration (gathered from one or several pages)
    num_warps: int
    num_stages: int


def default_kernel_config(
    head_dim: int,
    dtype: torch.dtype,
    *,
    programs_per_sm: float = 0.0,
    kv_dtype: torch.dtype | None = None,
    fp8_tile: str = DEFAULT_FP8_TILE,
) -> KernelConfig:
    """The tuned defaults for a launch of about ``programs_per_sm`` programs per SM.

    ``block_n`` is sized so that one iteration gathers :data:`WIDE_TILE_BYTES` (or
    :data:`NARROW_TILE_BYTES`) of K and V, with four warps for every head_dim. The query group
    size does not change the choice (measured for 1 to 32).
    An FP8 cache (``kv_dtype``) counts its tile in q's dtype, or with ``fp8_tile="bytes"`` in
    its own one-byte elements (see :data:`FP8_TILE_CHOICES`).
    """
    block_d = max(16, next_power_of_2(head_dim))
    elem = torch.empty((), dtype=dtype).element_size()
    max_block_n = 128
    if kv_dtype == FP8_DTYPE and fp8_tile == "bytes":
        elem, max_block_n = 1, 256
    if programs_per_sm <= WIDE_TILE_MAX_PROGRAMS_PER_SM:
        tile_bytes, num_stages = WIDE_TILE_BYTES, 3
    elif programs_per_sm <= NARROW_TILE_MAX_PROGRAMS_PER_SM:
        tile_bytes, num_stages = NARROW_TILE_BYTES, 3
    else:
        tile_bytes, num_stages = WIDE_TILE_BYTES, 2
    block_n = min(max_block_n, max(16, tile_bytes // (2 * block_d * elem)))
    # head_dim 256 too: eight warps were 7-26% slower than four on every 16/8/256 shape swept
    # on the H200 (tune256, benchmarks/results/decode_tuning_256.md; bf16, page 16)
    return KernelConfig(block_n=block_n, num_warps=4, num_stages=num_stages)


class AttentionPlanShape:
    """What a decode and an extend plan derive alike from their fields (``dtype``, ``kv_dtype``,
    ``num_q_heads``, ``num_kv_heads``, ``num_splits``)."""

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def uses_split(self) -> bool:
        return self.num_splits > 1


@dataclass(frozen=True)
class DecodePlan(AttentionPlanShape):
    """Launch configuration of one paged decode batch layout (see :func:`plan_decode`)."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # the cache's page size
    max_seq_len: int  # the longest request the plan was sized for (longer ones stay correct)
    max_blocks_per_seq: int
    dtype: torch.dtype
    device: torch.device
    kv_layout: str
    num_splits: int  # splits per request; 1 = single pass, no merge kernel
    tokens_per_split: int  # a multiple of block_n; the last split also takes any excess
    block_g: int  # packed query rows per program (>= 16 so tl.dot uses tensor cores)
    block_d: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_block_s: int  # merge launch: splits per loop step
    merge_block_d: int  # merge launch: head dims per program
    sm_count: int
    num_programs: int  # split path: stage-1 programs (each takes work items round-robin)
    block_b: int  # split path: requests scanned for the work list (power of two >= batch)
    window: int | None = None  # sliding window: attend to each request's last `window` tokens
    kv_dtype: torch.dtype | None = None  # the cache's dtype (None: q's); float8_e4m3fn = FP8 KV
    # split path: the last split of each (request, KV head) merges (needs the workspace's
    # arrival counters); False: a second launch merges
    fused_merge: bool = False
    fp8_compute: str | None = None  # FP8 KV: the dots' dtype, "f16" or "q" (None: float KV)
    fp8_staging: str | None = None  # FP8 KV: tiles staged as 16-bit, "none"/"v"/"kv"

    @property
    def merge_block_g(self) -> int:
        """In-kernel merge: query heads merged at once (the group, padded to a power of two)."""
        return next_power_of_2(self.group_size)

    @property
    def merge_chunk_splits(self) -> int:
        """In-kernel merge: splits per loop step, so a ``[G, splits, D]`` chunk stays within
        :data:`MERGE_TILE_ELEMS` floats."""
        fit = max(1, MERGE_TILE_ELEMS // (self.merge_block_g * self.block_d))
        return min(1 << (fit.bit_length() - 1), next_power_of_2(self.num_splits))

    def allocate_workspace(self) -> DecodeWorkspace:
        return DecodeWorkspace.allocate(self)


@dataclass(frozen=True)
class DecodeWorkspace:
    """Fixed-address buffers for ``decode(..., workspace=ws)``: no allocation, no host sync.

    ``partial_out [B, Hq, num_splits, D]`` float32 holds each split's normalised output and
    ``partial_lse [B, Hq, num_splits]`` float32 its log2-sum-exp; ``out [B, Hq, D]`` is the
    default output. ``counters [B, Hkv]`` int32 counts the splits of each (request, KV head)
    that have stored their partials, so that the last one merges (a plan's ``fused_merge``); it
    must be zero before a launch and every launch leaves it zero (CUDA-graph replays start
    clean). Without counters (``None``) a split launch merges in a second kernel. One workspace
    can serve every layer of a step, on one stream (calls are stream-ordered).
    """

    plan: DecodePlan
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    out: torch.Tensor
    counters: torch.Tensor | None = None

    @classmethod
    def allocate(cls, plan: DecodePlan) -> DecodeWorkspace:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan, got {type(plan).__name__}")
        b, hq, d, s = plan.batch, plan.num_q_heads, plan.head_dim, plan.num_splits
        return cls(
            plan=plan,
            partial_out=torch.empty(b, hq, s, d, dtype=torch.float32, device=plan.device),
            partial_lse=torch.empty(b, hq, s, dtype=torch.float32, device=plan.device),
            out=torch.empty(b, hq, d, dtype=plan.dtype, device=plan.device),
            counters=torch.zeros(b, plan.num_kv_heads, dtype=torch.int32, device=plan.device),
        )


def target_tokens_per_split(
    batch: int,
    total_tokens: int,
    max_seq_len: int,
    num_kv_heads: int,
    num_sms: int,
    *,
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM,
    min_tokens_per_split: int = DEFAULT_MIN_TOKENS_PER_SPLIT,
) -> int:
    """Tokens per split before rounding: a request longer than this is split.

    Work is measured in token-heads over the whole batch, so every split carries about the same
    number of tokens whatever the mix of lengths.
    """
    total_tokens = max(1, total_tokens)
    if batch * num_kv_heads >= NO_SPLIT_PROGRAMS_PER_SM * num_sms:
        per_split = math.ceil(total_tokens / batch)  # split only the longer-than-mean requests
    else:
        per_split = math.ceil(total_tokens * num_kv_heads / (num_sms * programs_per_sm))
    return max(per_split, min_tokens_per_split, math.ceil(max(1, max_seq_len) / MAX_SPLITS))


def split_count(max_seq_len: int, target: int) -> int:
    """Splits of the longest request: rounded down, so the work items never exceed the target
    (2.2 programs per SM would leave most SMs idle while a few run their third program)."""
    return max(1, max(1, max_seq_len) // max(1, target))


def balance_splits(max_seq_len: int, target: int, block_n: int) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)``: the longest request cut into equal block_n multiples
    (a 2-way split of 4096 tokens is 2 x 2048, not 3972 + 124)."""
    max_seq_len = max(1, max_seq_len)
    splits = split_count(max_seq_len, target)
    if splits <= 1:
        return 1, math.ceil(max_seq_len / block_n) * block_n
    per_split = math.ceil(math.ceil(max_seq_len / splits) / block_n) * block_n
    return math.ceil(max_seq_len / per_split), per_split


def check_attention_plan_args(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
    kv_layout: str,
    device: torch.device | str,
) -> tuple[torch.dtype, torch.device]:
    """The checks a decode and an extend plan share (after their positive-int checks); returns
    the cache dtype (``kv_dtype`` or ``dtype``) and the device, a bare ``"cuda"`` resolved to the
    current device so that it compares equal to ``q.device``."""
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if head_dim > 256:
        raise ValueError(f"head_dim must be <= 256, got {head_dim}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, got {dtype}")
    if kv_dtype is None:
        kv_dtype = dtype
    elif not kv_dtype_matches(dtype, kv_dtype):
        raise TypeError(
            f"kv_dtype must be dtype ({dtype}) or, beside float16/bfloat16, {FP8_DTYPE}; got "
            f"{kv_dtype}"
        )
    check_kv_layout(kv_layout)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return kv_dtype, device


def plan_decode(
    batch: int,
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
    total_tokens: int | None = None,
    num_splits: int | None = None,
    tokens_per_split: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM,
    min_tokens_per_split: int = DEFAULT_MIN_TOKENS_PER_SPLIT,
    window: int | None = None,
    kv_dtype: torch.dtype | None = None,
    fused_merge: bool | None = None,
    fp8_compute: str | None = None,
    fp8_staging: str | None = None,
    fp8_tile: str | None = None,
) -> DecodePlan:
    """Compute the launch configuration for one batch layout.

    ``max_seq_len`` bounds the lengths the plan is sized for (e.g. ``max_blocks_per_seq *
    block_size`` for a CUDA graph); longer requests are still computed correctly, by their last
    split. ``total_tokens`` (sum of the batch's lengths, default ``batch * max_seq_len``) feeds the
    split heuristic. ``num_splits`` / ``tokens_per_split`` force the split (tests, tuning);
    ``block_n`` / ``num_warps`` / ``num_stages`` override the tile table.

    ``window`` (a sliding-window layer group) makes every launch of the plan attend to each
    request's last ``window`` positions only; the splits then cut that range, so the heuristic
    sizes them for ``min(max_seq_len, window)`` tokens per request (and ``total_tokens``, the
    tokens attended, is capped at ``batch * window``).

    ``dtype`` is q's (and the output's); ``kv_dtype`` the cache's when it differs: an FP8 cache
    (``torch.float8_e4m3fn``) beside fp16/bf16 q. ``fp8_compute`` (:data:`FP8_COMPUTE_CHOICES`)
    and ``fp8_staging`` (:data:`FP8_STAGING_CHOICES`) choose how the kernel converts FP8 tiles,
    ``fp8_tile`` (:data:`FP8_TILE_CHOICES`) how the default tile is sized (defaults
    :data:`DEFAULT_FP8_COMPUTE`, :data:`DEFAULT_FP8_STAGING`, :data:`DEFAULT_FP8_TILE`; any of
    them given for a float cache: ValueError).

    ``fused_merge`` (split plans): whether the last split of each (request, KV head) merges the
    splits in the same launch; by default when a merge reads at most
    :data:`FUSED_MERGE_MAX_ROWS` partial rows (query group x splits), else a second launch.
    """
    for name, value in (
        ("batch", batch),
        ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
    ):
        check_positive_int(name, value)
    check_positive_int("max_seq_len", max_seq_len, minimum=0)
    window = check_window(window)
    if fused_merge is not None and not isinstance(fused_merge, bool):
        raise TypeError(f"fused_merge must be a bool or None, got {type(fused_merge).__name__}")
    kv_dtype, device = check_attention_plan_args(
        num_q_heads, num_kv_heads, head_dim, dtype, kv_dtype, kv_layout, device
    )
    fp8_compute, fp8_staging, fp8_tile = _fp8_options(kv_dtype, fp8_compute, fp8_staging, fp8_tile)
    if max_blocks_per_seq is None:
        max_blocks_per_seq = max(1, math.ceil(max_seq_len / block_size))
    check_positive_int("max_blocks_per_seq", max_blocks_per_seq)
    group = num_q_heads // num_kv_heads
    # what one request's splits cut: its last `window` tokens at most (the kernel starts the
    # range at a tile boundary, and the last split absorbs those few extra tokens)
    read_len = max_seq_len if window is None else min(max_seq_len, window)
    if total_tokens is not None and window is not None:
        total_tokens = min(total_tokens, batch * read_len)

    num_sms = sm_count(device)
    if num_splits is not None:
        check_positive_int("num_splits", num_splits)
    if tokens_per_split is not None:
        check_positive_int("tokens_per_split", tokens_per_split)
    # The split decision comes first: the tile width follows from how many programs share an SM.
    target = None
    if num_splits is None and tokens_per_split is None:
        target = target_tokens_per_split(
            batch,
            batch * read_len if total_tokens is None else total_tokens,
            read_len,
            num_kv_heads,
            num_sms,
            programs_per_sm=programs_per_sm,
            min_tokens_per_split=min_tokens_per_split,
        )
        will_split = split_count(read_len, target) > 1
    elif num_splits is not None:
        will_split = num_splits > 1
    else:
        will_split = tokens_per_split < read_len
    # the split path aims at DEFAULT_PROGRAMS_PER_SM work items per SM; a single pass runs one
    # program per (request, KV head)
    load = 0.0 if will_split else batch * num_kv_heads / num_sms
    config = default_kernel_config(
        head_dim,
        dtype,
        programs_per_sm=load,
        kv_dtype=kv_dtype,
        fp8_tile=fp8_tile or DEFAULT_FP8_TILE,
    )
    if not will_split and load > NARROW_TILE_MAX_PROGRAMS_PER_SM and read_len < config.block_n:
        # many short requests (several waves of programs): one loop iteration each, so a tile
        # sized to the context and no pipeline stages; the smaller tile lets more programs share
        # an SM to hide the dependent loads (length -> page id -> K/V) of each. (Small batches
        # keep the default tile: a CUDA graph replayed past its plan's length bucket then tiles
        # exactly as a fresh plan does.)
        config = KernelConfig(max(16, next_power_of_2(read_len)), config.num_warps, 1)
    if block_n is not None:
        check_positive_int("block_n", block_n, minimum=16)
        if block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        config = dataclasses.replace(config, block_n=block_n)
    if num_warps is not None:
        check_positive_int("num_warps", num_warps)
        config = dataclasses.replace(config, num_warps=num_warps)
    if num_stages is not None:
        check_positive_int("num_stages", num_stages)
        config = dataclasses.replace(config, num_stages=num_stages)
    bn = config.block_n

    if tokens_per_split is not None:
        if tokens_per_split % bn:
            raise ValueError(f"tokens_per_split must be a multiple of block_n={bn}")
        splits = max(1, math.ceil(read_len / tokens_per_split))
        if num_splits is not None:
            splits = num_splits
        per_split = tokens_per_split
    elif num_splits is not None:
        splits = num_splits
        per_split = max(bn, math.ceil(math.ceil(max(1, read_len) / splits) / bn) * bn)
    else:
        splits, per_split = balance_splits(read_len, target, bn)
    if splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be <= {MAX_SPLITS}, got {splits}")
    if fused_merge is None:
        fused_merge = group * splits <= FUSED_MERGE_MAX_ROWS
    # Work items of the split path: (split, KV head) pairs; with known lengths each request
    # has at most ceil(len / per_split) <= len / per_split + 1 splits.
    items = batch * num_kv_heads * splits
    if total_tokens is not None:
        items = min(items, num_kv_heads * (batch + math.ceil(total_tokens / per_split)))
    num_programs = max(1, min(items, num_sms * MAX_PROGRAMS_PER_SM))
    # merge launch: with fewer (request, query head) pairs than SMs, each pair's head dims are
    # cut in MERGE_BLOCK_D slices and a loop step loads a [splits, dims] tile of up to
    # MERGE_TILE_ELEMS floats (256 splits at once); a batch with enough pairs keeps one program
    # per pair and MERGE_BLOCK_S splits per step (four times the programs, most of them merging
    # a few splits, cost a skewed MQA batch 37 -> 47 us on the H200)
    block_d = max(16, next_power_of_2(head_dim))
    if batch * num_q_heads < num_sms:
        merge_block_d = min(block_d, MERGE_BLOCK_D)
        merge_block_s = min(next_power_of_2(splits), MERGE_TILE_ELEMS // merge_block_d)
    else:
        merge_block_d, merge_block_s = block_d, min(next_power_of_2(splits), MERGE_BLOCK_S)

    return DecodePlan(
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_seq_len=max_seq_len,
        max_blocks_per_seq=max_blocks_per_seq,
        dtype=dtype,
        device=device,
        kv_layout=kv_layout,
        num_splits=splits,
        tokens_per_split=per_split,
        block_g=max(16, next_power_of_2(group)),
        block_d=block_d,
        block_n=bn,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        merge_block_s=merge_block_s,
        merge_block_d=merge_block_d,
        sm_count=num_sms,
        num_programs=num_programs,
        block_b=next_power_of_2(batch),
        window=window,
        kv_dtype=kv_dtype,
        fused_merge=fused_merge and splits > 1,
        fp8_compute=fp8_compute,
        fp8_staging=fp8_staging,
    )


def _fp8_options(
    kv_dtype: torch.dtype, *values: object
) -> tuple[str | None, str | None, str | None]:
    """``fp8_compute``, ``fp8_staging``, ``fp8_tile`` checked: the defaults for an FP8 cache,
    None for a float one."""
    options = zip(
        ("fp8_compute", "fp8_staging", "fp8_tile"),
        values,
        (FP8_COMPUTE_CHOICES, FP8_STAGING_CHOICES, FP8_TILE_CHOICES),
        (DEFAULT_FP8_COMPUTE, DEFAULT_FP8_STAGING, DEFAULT_FP8_TILE),
        strict=True,
    )
    out = []
    for name, value, choices, default in options:
        if value is None:
            out.append(default if kv_dtype == FP8_DTYPE else None)
            continue
        if kv_dtype != FP8_DTYPE:
            raise ValueError(f"{name} applies only to {FP8_DTYPE} caches; this one is {kv_dtype}")
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        out.append(value)
    return out[0], out[1], out[2]
