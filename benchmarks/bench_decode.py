"""Paged decode attention, graph-timed: FlashDec against FlashInfer's best of four paths.

The review method (issue 10; shared GPU notes, "How kernel ratios are judged"):

- both sides are captured in a CUDA graph, ``--calls`` calls per graph; a call's time is the
  median replay time (``triton.testing.do_bench``, L2 flushed before each replay) / calls;
- FlashDec runs through its planned path: ``plan_decode`` once, ``decode(..., workspace=ws)``;
- FlashInfer 0.6.15.post1 (``BatchDecodeWithPagedKVCacheWrapper``) runs all four of its paths,
  HND/NHD x tensor-core/CUDA-core, and the fastest counts (the winner is recorded). HND reads
  FlashDec's own K/V tensors (``[pages, Hkv, page, D]``: the same memory); NHD needs its own
  ``[pages, page, Hkv, D]`` copy of the same values;
- random data, random page ids, both sides in one process. Ratio = FlashDec / FlashInfer best.

The matrix: head configurations of the Llama, Qwen2/2.5/3, Mistral and Gemma families (GQA
groups 1-8 and MQA; head_dim 64, 128, 256), pages 16/32/64, uniform batches (B 1..512, contexts
1..128k), short contexts at large batch (B=1024, L<=64), ragged batches (random lengths, fixed
seed), skewed batches (one long request among many short ones), each paired with the uniform
batch of equal bytes, and shared-prefix batches (every request's first 2,048 tokens on the same
pages, as a prefix cache shares a system prompt), each paired with the same lengths on pages of
their own. ``--quick`` covers every class in about four and a half minutes on an H200. ``--fp8``
adds FlashDec FP8 e4m3 KV (same shape) against FlashDec bf16 and FlashInfer's FP8 decode, with the
output error against the bf16 result. Without FlashInfer the benchmark still runs and says so.

    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick                  # every class, ~4.5 min
    PYTHONPATH=. python3 benchmarks/bench_decode.py                          # the full matrix
    PYTHONPATH=. python3 benchmarks/bench_decode.py --heads 28/4/128 --kinds ragged skewed
    PYTHONPATH=. python3 benchmarks/bench_decode.py --issue25 --fp8 --name decode_issue25
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --fp8 --name decode_fp8
    PYTHONPATH=. python3 benchmarks/bench_decode.py --quick --merge separate --name decode_sep
    python3 benchmarks/bench_decode.py --from-json benchmarks/results/decode.json   # re-render

Writes ``<name>.md``, ``.json`` and ``.png`` (default ``benchmarks/results/decode``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    RESULTS_DIR,
    bar_plot,
    copy_ceiling_tbs,
    environment,
    environment_markdown,
    fmt,
    geomean,
    graph_us_per_call,
    markdown_table,
    read_ceiling_tbs,
    run_in_workers,
    write_results,
)
from flashdec.kernels import decode, launch_decode, plan_decode

FORMAT = 2  # JSON layout of this script's results (1: the eager/graph table before issue 10)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite e4m3 value

# q heads / KV heads / head_dim -> GQA group and models of that shape
HEAD_CONFIGS = {
    "32/8/128": "group 4: Llama-3-8B, Mistral-7B, Qwen3-8B",
    "28/4/128": "group 7: Qwen2/2.5-7B",
    "16/8/256": "group 2, head_dim 256: Gemma-2-9B",
    "32/1/128": "MQA (group 32)",
    "12/2/128": "group 6: Qwen2.5-1.5B",
    "40/8/128": "group 5: Qwen2.5-14B, Qwen3-14B",
    "24/8/128": "group 3: Llama-3.2-3B",
    "64/8/128": "group 8: Llama-3-70B, Qwen2.5-72B",
    "32/32/128": "group 1 (MHA): Llama-2-7B",
    "8/1/256": "MQA, head_dim 256: Gemma-2B",
    "32/8/64": "group 4, head_dim 64: Llama-3.2-1B",
    "14/2/64": "group 7, head_dim 64: Qwen2.5-0.5B",
    "32/4/64": "group 8, head_dim 64",
    "32/4/128": "group 8, small KV: Yi-6B",
}
PRIMARY = "32/8/128"
# the head configs that get every page size of --pages by default (others get the first only)
PAGE_HEADS = ["32/8/128", "28/4/128", "16/8/256", "32/1/128"]
KINDS = ("uniform", "short", "ragged", "skewed", "shared")
FI_PATHS = (("HND", True), ("HND", False), ("NHD", True), ("NHD", False))
# outputs of unit-variance random data differ by about one bf16 ulp (0.03 at |x| < 8); beyond
# this limit one of the two is wrong
DIFF_LIMIT = 0.05

# --quick: every class, the weak shapes of issue 10, five head configs (about 4.5 min on an H200)
QUICK = {
    "heads": ["32/8/128", "28/4/128", "16/8/256", "32/1/128", "12/2/128"],
    "pages": [16, 32, 64],
    "page_heads": ["32/8/128"],
    "shapes": [
        "B=1 L=32768",
        "B=32 L=4096",
        "B=1024 L=17",
        "B=1024 L=64",
        "ragged 48x1..12345",
        "skewed 1x32768+63x1024",
        "shared 64x2240 prefix 2048",
    ],
    # the other families (MHA, groups 3/5/8, head_dim 64) on two target shapes each, last
    "more_heads": ["32/32/128", "24/8/128", "40/8/128", "64/8/128", "32/8/64", "14/2/64"],
    "more_shapes": ["B=1 L=32768", "B=1024 L=17"],
    "warmup": 5.0,
    "rep": 20.0,
    "budget_s": 210.0,
}
QUICK_EXTRA_PAGE_SHAPES = ["B=1 L=32768", "B=32 L=4096"]
# --issue25: the rows of issue 25's kernel table (its exact shapes and head configs) and the
# byte-bound shapes its FP8 row names, in one run (about 4 min on an H200)
ISSUE25 = {
    "heads": ["32/8/128", "28/4/128", "32/4/128", "16/8/256", "32/1/128"],
    "pages": [16, 32],
    "page_heads": ["32/8/128"],
    "shapes": [
        "B=1 L=32768",
        "ragged 4x[12345,777,4097,1]x8",
        "B=48 L=3000",
        "B=512 L=33",
        "B=1024 L=17",
        "skewed 1x32768+63x1024",
        "B=16 L=16384",
        "B=32 L=4096",
    ],
    "extra_page_shapes": ["B=1 L=32768"],
    "warmup": 5.0,
    "rep": 20.0,
    "budget_s": 300.0,
}
# the full matrix measures these shapes at the page sizes after the first
EXTRA_PAGE_SHAPES = [
    "B=1 L=32768",
    "B=16 L=16384",
    "B=32 L=4096",
    "B=512 L=256",
    "B=1024 L=17",
    "ragged 48x1..12345",
    "skewed 1x32768+63x1024",
]


# ---------------------------------------------------------------------------------------------
# the matrix (pure Python: tested on the CPU)


@dataclass(frozen=True)
class Shape:
    """One batch of sequence lengths."""

    label: str
    kind: str  # one of KINDS
    lens: tuple[int, ...]
    pair: str | None = None  # skewed: the uniform batch of equal bytes; its partner: the skewed
    # shared: every request's first ``shared_prefix`` tokens are the same pages (a system prompt
    # the prefix cache shares); its pair holds the same lengths on pages of their own
    shared_prefix: int = 0

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def max_len(self) -> int:
        return max(self.lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.lens)


def uniform_shape(batch: int, length: int, kind: str = "uniform") -> Shape:
    return Shape(f"B={batch} L={length}", kind, (length,) * batch)


def ragged_shape(batch: int, hi: int, lo: int = 1, seed: int = 0) -> Shape:
    """Lengths drawn uniformly from [lo, hi] with a fixed seed (Python's generator: the same
    lengths on every machine)."""
    rng = random.Random(seed * 1_000_003 + batch * 7919 + hi)
    lens = tuple(rng.randint(lo, hi) for _ in range(batch))
    return Shape(f"ragged {batch}x{lo}..{hi}", "ragged", lens)


def pattern_shape(pattern: tuple[int, ...], times: int) -> Shape:
    """A ragged batch of ``pattern`` repeated ``times`` times (issue 25's exact batch)."""
    label = f"ragged {len(pattern)}x[{','.join(map(str, pattern))}]x{times}"
    return Shape(label, "ragged", pattern * times)


def skew_pair(long: int, short: int, num_short: int) -> tuple[Shape, Shape]:
    """One ``long`` request among ``num_short`` short ones, and the uniform batch of the same
    size and the same number of tokens (so the same KV bytes)."""
    batch = num_short + 1
    total = long + short * num_short
    if total % batch:
        raise ValueError(f"{long}+{num_short}x{short} tokens do not split evenly over {batch}")
    skewed_label = f"skewed 1x{long}+{num_short}x{short}"
    uniform_label = f"uniform {batch}x{total // batch}"
    return (
        Shape(skewed_label, "skewed", (long,) + (short,) * num_short, pair=uniform_label),
        Shape(uniform_label, "skewed", (total // batch,) * batch, pair=skewed_label),
    )


def shared_pair(batch: int, length: int, prefix: int) -> tuple[Shape, Shape]:
    """``batch`` requests of ``length`` tokens whose first ``prefix`` share their pages, and the
    same lengths on pages of their own (a decode that reads the prefix once per request reads
    the same bytes in both; only caches can tell them apart)."""
    if not 0 < prefix < length:
        raise ValueError(f"the shared prefix ({prefix}) must be shorter than a request ({length})")
    shared_label = f"shared {batch}x{length} prefix {prefix}"
    own_label = f"unshared {batch}x{length}"
    lens = (length,) * batch
    return (
        Shape(shared_label, "shared", lens, pair=own_label, shared_prefix=prefix),
        Shape(own_label, "shared", lens, pair=shared_label),
    )


def all_shapes(seed: int = 0) -> list[Shape]:
    """Every shape of the matrix, in report order."""
    uniform = [
        (1, 1024),
        (1, 32768),
        (1, 131072),
        (4, 65536),
        (8, 8192),
        (16, 16384),
        (32, 4096),
        (48, 3000),
        (64, 2048),
        (128, 1024),
        (256, 512),
        (512, 256),
    ]
    shapes = [uniform_shape(b, n) for b, n in uniform]
    shapes += [uniform_shape(1024, n, "short") for n in (1, 8, 17, 33, 64)]
    shapes += [uniform_shape(256, 17, "short"), uniform_shape(512, 33, "short")]
    shapes += [
        ragged_shape(b, hi, seed=seed)
        for b, hi in ((48, 12345), (8, 131072), (128, 4096), (1024, 64))
    ]
    shapes += [pattern_shape((12345, 777, 4097, 1), 8)]
    for long, short, n in ((32768, 1024, 63), (131072, 512, 255)):
        shapes += list(skew_pair(long, short, n))
    # a 2,048-token system prompt under 64 and 16 decoding requests (prefix_cache.md's trace)
    for batch in (64, 16):
        shapes += list(shared_pair(batch, 2240, 2048))
    return shapes


def parse_heads(spec: str) -> tuple[int, int, int]:
    """``"Hq/Hkv/D"`` -> (Hq, Hkv, D); ValueError on anything else."""
    parts = spec.split("/")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"head config must look like 32/8/128 (q/kv/head_dim), got {spec!r}")
    hq, hkv, d = (int(x) for x in parts)
    if hq % hkv:
        raise ValueError(f"head config {spec}: {hq} q heads are not a multiple of {hkv} KV heads")
    return hq, hkv, d


def kv_bytes(lens: tuple[int, ...] | list[int], hkv: int, d: int, elem: int) -> int:
    """Bytes of K and V a decode reads (B·L·Hkv·D·2·dtype size)."""
    return sum(lens) * hkv * d * 2 * elem


def shape_selected(shape: Shape, selectors: list[str] | None) -> bool:
    """A selector is a full label (``B=1 L=32768``) or its first word (``B=1``, ``skewed``,
    ``ragged``); a selected skewed batch brings its uniform partner and vice versa."""
    if not selectors:
        return True
    names = {shape.label, shape.label.split(" ")[0]}
    if shape.pair:
        names |= {shape.pair, shape.pair.split(" ")[0]}
    return any(s in names for s in selectors)


@dataclass(frozen=True)
class MatrixCase:
    dtype: str
    heads: str
    page: int
    shape: Shape

    @property
    def key(self) -> tuple[str, str, int, str]:
        return (self.dtype, self.heads, self.page, self.shape.label)


def build_matrix(args: argparse.Namespace) -> tuple[list[MatrixCase], list[str]]:
    """The cases to run, in order, and the ones left out for size (``--max-kv-gib``)."""
    shapes = [
        s for s in all_shapes(args.seed) if s.kind in args.kinds and shape_selected(s, args.shapes)
    ]
    page_heads = set(args.heads if "all" in args.page_heads else args.page_heads)
    more = [h for h in args.more_heads if h not in args.heads]
    cases, too_big = [], []
    for dname in args.dtypes:
        for head in args.heads + more:
            _, hkv, d = parse_heads(head)
            pages = args.pages if head in page_heads else args.pages[:1]
            for page in pages:
                for shape in shapes:
                    if page != args.pages[0] and not shape_selected(shape, args.extra_page_shapes):
                        continue
                    if head in more and not shape_selected(shape, args.more_shapes):
                        continue
                    case = MatrixCase(dname, head, page, shape)
                    if kv_bytes(shape.lens, hkv, d, 2) > args.max_kv_gib * 2**30:
                        too_big.append(" ".join(map(str, case.key)))
                        continue
                    cases.append(case)
    return cases, too_big


# --merge: how a split plan merges (plan_decode's fused_merge)
MERGE_MODES = {"auto": {}, "fused": {"fused_merge": True}, "separate": {"fused_merge": False}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick", action="store_true", help="every class, about 4.5 minutes (H200)"
    )
    preset.add_argument(
        "--issue25", action="store_true", help="issue 25's kernel-table rows, about 4 minutes"
    )
    p.add_argument("--heads", nargs="+", default=None, help="q/kv/head_dim configs")
    p.add_argument(
        "--more-heads",
        nargs="*",
        default=None,
        help="head configs measured after --heads, on --more-shapes only",
    )
    p.add_argument("--more-shapes", nargs="*", default=None, help="shapes for --more-heads")
    p.add_argument("--pages", nargs="+", type=int, default=None, help="page sizes")
    p.add_argument(
        "--page-heads",
        nargs="+",
        default=None,
        help="head configs that get every page size ('all'); the others get the first only",
    )
    p.add_argument(
        "--extra-page-shapes",
        nargs="*",
        default=None,
        help="shapes measured at the page sizes after the first (none given: all)",
    )
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--shapes", nargs="*", default=None, help="labels such as B=1 or skewed")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    p.add_argument("--max-kv-gib", type=float, default=8.0, help="skip larger caches")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--warmup", type=float, default=None, help="ms (default 10; quick 5)")
    p.add_argument("--rep", type=float, default=None, help="ms (default 40; quick 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="add FP8 e4m3 KV rows (bf16 cases)")
    p.add_argument("--sdpa", action="store_true", help="also time gather + SDPA (slow)")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument(
        "--merge",
        default="auto",
        choices=list(MERGE_MODES),
        help="split plans: the plan's choice, in-kernel (last split merges) or a merge launch",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 2) - 2)),
        help="processes that compile kernels before the timing pass (1: none)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="stop adding cases after this")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="decode")
    p.add_argument("--from-json", default=None, help="re-render .md/.png from a saved JSON")
    args = p.parse_args(argv)
    return resolve_args(args)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what the user left unset from the ``--quick`` preset or the full-matrix defaults,
    and check the head configs."""
    preset = QUICK if args.quick else ISSUE25 if args.issue25 else {}
    defaults = {
        "heads": list(HEAD_CONFIGS),
        "more_heads": [],
        "more_shapes": None,
        "pages": [16, 32, 64],
        "page_heads": PAGE_HEADS,
        "shapes": None,
        "warmup": 10.0,
        "rep": 40.0,
        "budget_s": 1e9,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, value))
    if args.extra_page_shapes is None:
        quick = QUICK_EXTRA_PAGE_SHAPES if args.quick else EXTRA_PAGE_SHAPES
        args.extra_page_shapes = preset.get("extra_page_shapes", quick)
    for head in args.heads + args.more_heads:
        parse_heads(head)
    if args.calls < 1:
        raise SystemExit("--calls must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# one problem on the GPU


class Case:
    """One problem: a random paged cache, its block table and FlashInfer's page arrays.

    ``k``/``v`` are token-major ``[pages, Hkv, page, D]`` (FlashInfer's HND); the NHD copy and
    the FP8 copies are made on first use.
    """

    def __init__(self, lens, hq, hkv, d, page, dtype, seed=0, device="cuda", shared_prefix=0):
        dev = self.device = torch.device(device)
        torch.manual_seed(seed)
        self.lens_list = list(lens)
        self.batch = len(lens)
        self.hq, self.hkv, self.d, self.page, self.dtype = hq, hkv, d, page, dtype
        pages = torch.tensor([math.ceil(n / page) for n in lens], device=dev)
        shared = shared_prefix // page  # whole pages: a prefix cache shares full blocks only
        if shared and int(pages.min()) <= shared:
            raise ValueError(f"every request must extend past its {shared_prefix}-token prefix")
        total_pages = int(pages.sum()) - shared * (self.batch - 1)  # physical pages
        max_pages = int(pages.max())
        perm = torch.randperm(total_pages + 1, device=dev, dtype=torch.int32)
        self.k = torch.randn(total_pages + 1, hkv, page, d, device=dev, dtype=dtype)
        self.v = torch.randn_like(self.k)
        self.tables = torch.zeros(self.batch, max_pages, dtype=torch.int32, device=dev)
        used = torch.arange(max_pages, device=dev)[None, :] < pages[:, None]
        own = used.clone()
        own[:, :shared] = False
        self.tables[own] = perm[shared:total_pages]
        self.tables[:, :shared] = perm[:shared]
        self.indices = self.tables[used].contiguous()  # FlashInfer's page list, request by request
        self.shared_pages = shared
        self.lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.indptr = torch.zeros(self.batch + 1, dtype=torch.int32, device=dev)
        self.indptr[1:] = torch.cumsum(pages, 0)
        self.last_page_len = (self.lens - (pages.int() - 1) * page).int()
        self.q = torch.randn(self.batch, hq, d, device=dev, dtype=dtype)
        self.kv_bytes = kv_bytes(self.lens_list, hkv, d, self.k.element_size())
        self.max_len = max(lens)
        self._nhd: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fp8: tuple[torch.Tensor, torch.Tensor, float, float] | None = None

    def plan(self, **overrides):
        return plan_decode(
            self.batch,
            self.hq,
            self.hkv,
            self.d,
            self.page,
            self.max_len,
            self.dtype,
            self.device,
            total_tokens=sum(self.lens_list),
            **overrides,
        )

    def flashdec_fns(self, **overrides):
        """``(plan, api, launch)``: ``api`` is ``decode(..., workspace=ws)``, ``launch`` the
        trusted launcher with the same plan."""
        plan = self.plan(**overrides)
        return (plan, *self.flashdec_fns_for(plan))

    def flashdec_fns_for(self, plan):
        """``(api, launch)`` of ``plan``: ``decode(..., workspace=ws)`` and the trusted
        launcher. An FP8 plan (``kv_dtype=float8_e4m3fn``) reads the FP8 copy of the cache with
        its scales (SPEC §8.5)."""
        ws = plan.allocate_workspace()
        q, t, lens = self.q, self.tables, self.lens
        scale = self.d**-0.5
        if FP8 is not None and plan.kv_dtype == FP8:
            k, v, sk, sv = self.fp8_cache()
            api_scales = {"k_scale": sk, "v_scale": sv}
            launch_scales = {
                "k_scale": torch.full((self.hkv,), sk, device=self.device),
                "v_scale": torch.full((self.hkv,), sv, device=self.device),
            }
        else:
            k, v, api_scales, launch_scales = self.k, self.v, {}, {}

        def api():
            return decode(q, k, v, t, lens, workspace=ws, **api_scales)

        def launch():
            return launch_decode(
                q,
                k,
                v,
                t,
                lens,
                scale,
                plan,
                ws.out,
                ws.partial_out,
                ws.partial_lse,
                self.batch,
                **launch_scales,
                counters=ws.counters,
            )

        return api, launch

    def fp8_cache(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """K and V quantised to e4m3 with one scale each (amax / 448), and the scales."""
        if self._fp8 is None:
            if FP8 is None:
                raise RuntimeError("this torch has no float8_e4m3fn")
            parts = []
            for x in (self.k, self.v):
                scale = max(float(x.abs().amax()) / FP8_MAX, 1e-12)
                parts.append(((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale))
            (k8, sk), (v8, sv) = parts
            self._fp8 = (k8, v8, sk, sv)
        return self._fp8

    def flashdec_fp8_fn(self):
        """``decode`` over the FP8 cache through its own plan (``kv_dtype``) and workspace."""
        return self.flashdec_fns_for(self.plan(kv_dtype=FP8))[0]

    def kv_for(self, layout: str, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) pair in FlashInfer's ``layout``: HND is the cache itself, NHD a copy."""
        k, v = (self.fp8_cache()[:2]) if fp8 else (self.k, self.v)
        if layout == "HND":
            return k, v
        key = f"{layout}-{'fp8' if fp8 else 'native'}"
        if key not in self._nhd:
            self._nhd[key] = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
        return self._nhd[key]

    def flashinfer_fn(
        self,
        flashinfer,
        tensor_cores: bool,
        workspace: torch.Tensor,
        layout: str = "HND",
        fp8: bool = False,
    ):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, layout, use_tensor_cores=tensor_cores
        )
        wrapper.plan(
            self.indptr,
            self.indices,
            self.last_page_len,
            self.hq,
            self.hkv,
            self.d,
            self.page,
            q_data_type=self.dtype,
            kv_data_type=FP8 if fp8 else self.dtype,
        )
        kv = self.kv_for(layout, fp8)
        out = torch.empty_like(self.q)
        if fp8:
            _, _, sk, sv = self.fp8_cache()
            return lambda: wrapper.run(self.q, kv, k_scale=sk, v_scale=sv, out=out)
        return lambda: wrapper.run(self.q, kv, out=out)

    def sdpa_fn(self):
        """Gather + SDPA in plain PyTorch (a slow, independent check)."""
        b, hkv, d = self.batch, self.hkv, self.d
        idx = self.tables.long()
        length = idx.shape[1] * self.page
        mask = torch.arange(length, device=self.device)[None, :] < self.lens[:, None]
        mask = mask[:, None, None, :]

        def run():
            k = self.k[idx].permute(0, 2, 1, 3, 4).reshape(b, hkv, length, d)
            v = self.v[idx].permute(0, 2, 1, 3, 4).reshape(b, hkv, length, d)
            out = torch.nn.functional.scaled_dot_product_attention(
                self.q[:, :, None, :], k, v, attn_mask=mask, enable_gqa=self.hq != hkv
            )
            return out[:, :, 0]

        return run


def load_flashinfer():
    try:
        import flashinfer

        return flashinfer, None
    except Exception as exc:  # missing wheel, failed JIT set-up, ...
        return None, f"{type(exc).__name__}: {exc}"


def flashinfer_workspace() -> torch.Tensor:
    """FlashInfer's float workspace (split-KV partials); zeroed before first use, as it asks."""
    return torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def graph_time(fn, args) -> tuple[float | None, str | None]:
    """Graph-timed microseconds per call, or the error that stopped it."""
    try:
        fn()
        torch.cuda.synchronize()
        return graph_us_per_call(fn, args.calls, args.warmup, args.rep), None
    except Exception as exc:
        torch.cuda.synchronize()
        return None, short_error(exc)


def fi_path_name(layout: str, tensor_cores: bool) -> str:
    return f"{layout}-{'tc' if tensor_cores else 'cc'}"


def flashinfer_best(case: Case, flashinfer, fi_ws, args, fp8: bool = False) -> dict[str, Any]:
    """Every FlashInfer path graph-timed: ``{"us": {path: us|None}, "errors": {path: str},
    "best_path", "best_us", "best_fn"}``."""
    times: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    fns = {}
    for layout, tc in FI_PATHS:
        name = fi_path_name(layout, tc)
        try:
            fns[name] = case.flashinfer_fn(flashinfer, tc, fi_ws, layout, fp8=fp8)
        except Exception as exc:
            torch.cuda.synchronize()
            times[name], errors[name] = None, short_error(exc)
            continue
        times[name], err = graph_time(fns[name], args)
        if err:
            errors[name] = err
    ok = {k: v for k, v in times.items() if v}
    best = min(ok, key=ok.get) if ok else None
    return {
        "us": times,
        "errors": errors,
        "best_path": best,
        "best_us": ok.get(best) if best else None,
        "best_fn": fns.get(best),
    }


def plan_summary(plan) -> dict[str, Any]:
    return {
        "splits": plan.num_splits,
        "tokens_per_split": plan.tokens_per_split,
        "block_n": plan.block_n,
        "warps": plan.num_warps,
        "stages": plan.num_stages,
        "programs": plan.num_programs,
        "fused_merge": plan.fused_merge,
    }


def base_row(mc: MatrixCase) -> dict[str, Any]:
    hq, hkv, d = parse_heads(mc.heads)
    s = mc.shape
    return {
        "dtype": mc.dtype,
        "heads": mc.heads,
        "group": hq // hkv,
        "num_kv_heads": hkv,
        "head_dim": d,
        "page": mc.page,
        "shape": s.label,
        "kind": s.kind,
        "pair": s.pair,
        "batch": s.batch,
        "max_len": s.max_len,
        "total_tokens": s.total_tokens,
        "kv_mib": kv_bytes(s.lens, hkv, d, DTYPES[mc.dtype].itemsize) / 2**20,
        # what is stored: a shared prefix once (kv_mib counts it per request, as a decode reads)
        "stored_kv_mib": kv_bytes(
            [n - s.shared_prefix for n in s.lens[1:]] + list(s.lens[:1]),
            hkv,
            d,
            DTYPES[mc.dtype].itemsize,
        )
        / 2**20,
    }


def finish_row(row: dict[str, Any], ceilings: dict[str, float]) -> dict[str, Any]:
    """Derived columns: TB/s, % of the copy and read ceilings, the ratio to FlashInfer's best."""
    nbytes = row["kv_mib"] * 2**20
    us, fi = row.get("fd_us"), row.get("fi_best_us")
    if us:
        row["tbs"] = nbytes / (us * 1e-6) / 1e12
        row["pct_copy"] = 100 * row["tbs"] / ceilings["copy_tbs"]
        row["pct_read"] = 100 * row["tbs"] / ceilings["read_tbs"]
    if fi:
        row["fi_pct_copy"] = 100 * nbytes / (fi * 1e-6) / 1e12 / ceilings["copy_tbs"]
    row["ratio"] = us / fi if us and fi else None
    fp8 = row.get("fp8")
    if fp8:
        f_us, fi8 = fp8.get("fd_us"), fp8.get("fi_best_us")
        fp8["pct_copy"] = (
            100 * nbytes / 2 / (f_us * 1e-6) / 1e12 / ceilings["copy_tbs"] if f_us else None
        )
        fp8["speedup_vs_bf16"] = us / f_us if us and f_us else None
        fp8["ratio_vs_fi_fp8"] = f_us / fi8 if f_us and fi8 else None
    return row


def output_error(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = out.float() - ref.float()
    return {
        "max_abs": diff.abs().max().item(),
        "rel_l2": (diff.norm() / ref.float().norm().clamp_min(1e-30)).item(),
    }


def measure(mc: MatrixCase, args, flashinfer, fi_ws, ceilings) -> dict[str, Any]:
    """Time one case. A path that fails is recorded in the row; a case that cannot even be
    built (e.g. out of memory) raises, and :func:`run` records that."""
    row = base_row(mc)
    hq, hkv, d = parse_heads(mc.heads)
    case = Case(
        list(mc.shape.lens),
        hq,
        hkv,
        d,
        mc.page,
        DTYPES[mc.dtype],
        seed=args.seed,
        shared_prefix=mc.shape.shared_prefix,
    )
    try:
        plan = case.plan(**MERGE_MODES[args.merge])
        row["plan"] = plan_summary(plan)
        api, _ = case.flashdec_fns_for(plan)
        row["fd_us"], row["fd_error"] = graph_time(api, args)
        fd_out = api().clone() if row["fd_us"] else None
        if flashinfer is not None:
            fi = flashinfer_best(case, flashinfer, fi_ws, args)
            row["fi_us"], row["fi_errors"] = fi["us"], fi["errors"]
            row["fi_best_path"], row["fi_best_us"] = fi["best_path"], fi["best_us"]
            if fd_out is not None and fi["best_fn"] is not None:
                row["max_abs_diff_vs_fi"] = output_error(fd_out, fi["best_fn"]())["max_abs"]
            del fi
        if args.sdpa:  # a plain PyTorch gather + SDPA, graph-timed the same way
            sdpa = case.sdpa_fn()
            row["sdpa_us"], row["sdpa_error"] = graph_time(sdpa, args)
            if fd_out is not None and row["sdpa_us"]:
                row["max_abs_diff_vs_sdpa"] = output_error(fd_out, sdpa())["max_abs"]
        if args.fp8 and mc.dtype == "bf16":
            row["fp8"] = measure_fp8(case, args, flashinfer, fi_ws, fd_out)
    finally:
        del case
        torch.cuda.empty_cache()
    return finish_row(row, ceilings)


def measure_fp8(case: Case, args, flashinfer, fi_ws, bf16_out) -> dict[str, Any]:
    res: dict[str, Any] = {}
    try:
        fn = case.flashdec_fp8_fn()
        res["fd_us"], res["fd_error"] = graph_time(fn, args)
        if res["fd_us"] and bf16_out is not None:
            res["fd_error_vs_bf16"] = output_error(fn(), bf16_out)
    except Exception as exc:
        torch.cuda.synchronize()
        res["fd_us"], res["fd_error"] = None, short_error(exc)
    if flashinfer is not None:
        fi = flashinfer_best(case, flashinfer, fi_ws, args, fp8=True)
        res["fi_us"], res["fi_errors"] = fi["us"], fi["errors"]
        res["fi_best_path"], res["fi_best_us"] = fi["best_path"], fi["best_us"]
        if fi["best_fn"] is not None and bf16_out is not None:
            res["fi_error_vs_bf16"] = output_error(fi["best_fn"](), bf16_out)
    return res


# ---------------------------------------------------------------------------------------------
# report (pure Python: tested on the CPU from fake rows)


def is_mqa(row: dict[str, Any]) -> bool:
    return row["num_kv_heads"] == 1


def pair_ratios(rows: list[dict[str, Any]], kind: str = "skewed") -> list[dict[str, Any]]:
    """Time of each ``kind`` batch (skewed, or shared prefix) / time of its partner (the
    uniform batch of equal bytes, or the same lengths on pages of their own), per (dtype, heads,
    page) and pair."""
    index = {(r["dtype"], r["heads"], r["page"], r["shape"]): r for r in rows}
    out = []
    for r in rows:
        if r["kind"] != kind or not r["shape"].startswith(kind) or not r.get("pair"):
            continue
        u = index.get((r["dtype"], r["heads"], r["page"], r["pair"]))
        if u is None:
            continue
        item = {k: r[k] for k in ("dtype", "heads", "page", "shape")}
        item["uniform"] = u["shape"]
        item["fd"] = r["fd_us"] / u["fd_us"] if r.get("fd_us") and u.get("fd_us") else None
        fi_s, fi_u = r.get("fi_best_us"), u.get("fi_best_us")
        item["fi"] = fi_s / fi_u if fi_s and fi_u else None
        item["fd_us"], item["uniform_fd_us"] = r.get("fd_us"), u.get("fd_us")
        out.append(item)
    return out


def skew_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Skewed batch time / time of its uniform partner (:func:`pair_ratios`)."""
    return pair_ratios(rows, "skewed")


def _status(ok: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[ok]


def _case(r: dict[str, Any]) -> str:
    return f"{r['dtype']} {r['heads']} p{r['page']} {r['shape']}"


def evaluate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 10's targets, each ``{"target", "status": met|MISSED|not measured, "detail"}``."""
    targets = []

    def add(target: str, ok: bool | None, detail: str) -> None:
        targets.append({"target": target, "status": _status(ok), "detail": detail})

    ratios = [r for r in rows if r.get("ratio")]
    if ratios:
        worst = max(ratios, key=lambda r: r["ratio"])
        losses = sum(r["ratio"] > 1.0 for r in ratios)
        add(
            "<= 1.00x FlashInfer's best on every shape where it runs",
            losses == 0,
            f"{losses} of {len(ratios)} shapes slower; worst {worst['ratio']:.3f}x "
            f"({_case(worst)})",
        )
        g = geomean([r["ratio"] for r in ratios])
        add("geometric mean <= 0.92x", g <= 0.92, f"{g:.3f}x over {len(ratios)} shapes")
    else:
        add("<= 1.00x FlashInfer's best on every shape where it runs", None, "no FlashInfer times")
        add("geometric mean <= 0.92x", None, "no FlashInfer times")

    for mqa, floor in ((False, 85.0), (True, 50.0)):
        sel = [
            r
            for r in rows
            if r["batch"] == 1 and r["max_len"] == 32768 and is_mqa(r) == mqa and r.get("pct_copy")
        ]
        name = f"B=1 L=32768 >= {floor:.0f}% of copy ({'MQA' if mqa else 'GQA/MHA'})"
        if sel:
            low = min(sel, key=lambda r: r["pct_copy"])
            add(
                name,
                low["pct_copy"] >= floor,
                f"lowest {low['pct_copy']:.1f}% ({_case(low)}); "
                + ", ".join(f"{r['heads']} p{r['page']} {r['pct_copy']:.0f}%" for r in sel),
            )
        else:
            add(name, None, "shape not measured")

    short = [r for r in rows if r["batch"] == 1024 and r["max_len"] <= 64 and r.get("fd_us")]
    if short:
        bad = [
            r
            for r in short
            if not ((r.get("pct_copy") or 0) >= 60 or (r.get("ratio") or math.inf) <= 0.90)
        ]
        add(
            "B=1024 L<=64: >= 60% of copy or <= 0.90x FlashInfer",
            not bad,
            f"{len(bad)} of {len(short)} shapes miss"
            + "".join(
                f"; {_case(r)} {fmt(r.get('pct_copy'))}% x{fmt(r.get('ratio'), 3)}" for r in bad[:6]
            ),
        )
    else:
        add("B=1024 L<=64: >= 60% of copy or <= 0.90x FlashInfer", None, "shape not measured")

    skews = [s for s in skew_ratios(rows) if s["fd"]]
    if skews:
        worst = max(skews, key=lambda s: s["fd"])
        bad = [s for s in skews if s["fd"] > 1.10]
        add(
            "skewed batch <= 1.10x the uniform batch of equal bytes, every head config",
            not bad,
            f"{len(bad)} of {len(skews)} pairs miss; worst x{worst['fd']:.2f} "
            f"({worst['heads']} p{worst['page']} {worst['shape']})",
        )
    else:
        add("skewed batch <= 1.10x the uniform batch", None, "no skewed pairs measured")

    fp8 = [r for r in rows if r.get("fp8")]
    big = [r for r in fp8 if r["kv_mib"] >= 512 and r["fp8"].get("speedup_vs_bf16")]
    if big:
        low = min(big, key=lambda r: r["fp8"]["speedup_vs_bf16"])
        add(
            "FP8 >= 1.7x FlashDec bf16 where bf16 KV >= 512 MiB",
            low["fp8"]["speedup_vs_bf16"] >= 1.7,
            f"lowest {low['fp8']['speedup_vs_bf16']:.2f}x ({_case(low)}) over {len(big)} shapes",
        )
    elif fp8:
        add("FP8 >= 1.7x FlashDec bf16 where bf16 KV >= 512 MiB", None, "no such shape ran")
    vs_fi = [r for r in fp8 if r["fp8"].get("ratio_vs_fi_fp8")]
    if vs_fi:
        worst = max(vs_fi, key=lambda r: r["fp8"]["ratio_vs_fi_fp8"])
        losses = sum(r["fp8"]["ratio_vs_fi_fp8"] > 1.0 for r in vs_fi)
        add(
            "FP8 <= 1.00x FlashInfer's FP8 decode where it runs",
            losses == 0,
            f"{losses} of {len(vs_fi)} slower; worst {worst['fp8']['ratio_vs_fi_fp8']:.3f}x "
            f"({_case(worst)})",
        )
    elif fp8:
        add(
            "FP8 <= 1.00x FlashInfer's FP8 decode where it runs", None, "FlashInfer FP8 did not run"
        )
    return targets


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    by_head: dict[str, list[float]] = {}
    for r in rows:
        if r.get("ratio"):
            by_head.setdefault(f"{r['dtype']} {r['heads']}", []).append(r["ratio"])
    if by_head:
        lines.append("FlashDec / FlashInfer best, per head config (geometric mean, worst, shapes):")
        lines.append("")
        for key, rs in by_head.items():
            head = key.split(" ", 1)[1]
            lines.append(
                f"- {key} ({HEAD_CONFIGS.get(head, 'custom')}): {geomean(rs):.3f}x, "
                f"worst {max(rs):.3f}x, {len(rs)} shapes"
            )
        lines.append("")
    skews = skew_ratios(rows)
    if skews:
        lines.append("Skewed batch / uniform batch of equal bytes:")
        lines.append("")
        for s in skews:
            lines.append(
                f"- {s['dtype']} {s['heads']} p{s['page']} {s['shape']} vs {s['uniform']}: "
                f"FlashDec x{fmt(s['fd'], 2)} ({fmt(s['fd_us'])} vs {fmt(s['uniform_fd_us'])} us), "
                f"FlashInfer best x{fmt(s['fi'], 2)}"
            )
        lines.append("")
    shared = pair_ratios(rows, "shared")
    if shared:
        lines.append(
            "Shared-prefix batch / the same lengths on pages of their own (each request still "
            "reads the prefix: below 1 only where the caches serve the repeats):"
        )
        lines.append("")
        for s in shared:
            lines.append(
                f"- {s['dtype']} {s['heads']} p{s['page']} {s['shape']} vs {s['uniform']}: "
                f"FlashDec x{fmt(s['fd'], 2)} ({fmt(s['fd_us'])} vs {fmt(s['uniform_fd_us'])} us), "
                f"FlashInfer best x{fmt(s['fi'], 2)}"
            )
        lines.append("")
    wins: dict[str, int] = {}
    for r in rows:
        if r.get("fi_best_path"):
            wins[r["fi_best_path"]] = wins.get(r["fi_best_path"], 0) + 1
    if wins:
        lines.append(
            "FlashInfer's winning path: "
            + ", ".join(f"{k} {v}" for k, v in sorted(wins.items(), key=lambda kv: -kv[1]))
        )
        lines.append("")
    diffs = [r for r in rows if r.get("max_abs_diff_vs_fi") is not None]
    if diffs:
        bad = [r for r in diffs if r["max_abs_diff_vs_fi"] > DIFF_LIMIT]
        worst = max(diffs, key=lambda r: r["max_abs_diff_vs_fi"])
        lines.append(
            f"Outputs, FlashDec vs FlashInfer's best path: largest |diff| "
            f"{worst['max_abs_diff_vs_fi']:.4f} ({_case(worst)}) over {len(diffs)} shapes; "
            f"{len(bad)} above {DIFF_LIMIT}"
            + "".join(f"; **{_case(r)}: {r['max_abs_diff_vs_fi']:.3f}**" for r in bad[:6])
        )
        lines.append("")
    failed = [r for r in rows if r.get("fd_error") or r.get("error")]
    fi_none = [r for r in rows if "fi_us" in r and not r.get("fi_best_us")]
    lines.append(
        f"FlashDec failed on {len(failed)} of {len(rows)} shapes; FlashInfer ran no path on "
        f"{len(fi_none)}."
    )
    for r in failed[:10]:
        lines.append(f"- {_case(r)}: {r.get('error') or r.get('fd_error')}")
    return lines


COLUMNS = [
    "dtype",
    "heads",
    "page",
    "shape",
    "KV MiB",
    "splits",
    "FlashDec us",
    "TB/s",
    "% copy",
    "FI best us",
    "FI path",
    "FI % copy",
    "FD / FI",
    "HND-tc",
    "HND-cc",
    "NHD-tc",
    "NHD-cc",
    "max |diff| vs FI",
    "SDPA us",
]
FP8_COLUMNS = [
    "heads",
    "page",
    "shape",
    "bf16 KV MiB",
    "FD bf16 us",
    "FD fp8 us",
    "fp8 % copy",
    "speedup",
    "FI fp8 best us",
    "FI path",
    "FD fp8 / FI fp8",
    "max abs err",
    "rel L2 err",
    "FI fp8 rel L2",
]


def _fi_cell(r: dict[str, Any], path: str) -> str:
    if "fi_us" not in r:
        return "—"
    us = (r.get("fi_us") or {}).get(path)
    return fmt(us) if us else "fail"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        out.append(
            [
                r["dtype"],
                r["heads"],
                str(r["page"]),
                r["shape"],
                fmt(r["kv_mib"], 0),
                str((r.get("plan") or {}).get("splits", "—")),
                fmt(r.get("fd_us")) if r.get("fd_us") else "fail",
                fmt(r.get("tbs"), 2),
                fmt(r.get("pct_copy")),
                fmt(r.get("fi_best_us")),
                r.get("fi_best_path") or "—",
                fmt(r.get("fi_pct_copy")),
                fmt(r.get("ratio"), 3),
                *(_fi_cell(r, fi_path_name(lay, tc)) for lay, tc in FI_PATHS),
                fmt(r.get("max_abs_diff_vs_fi"), 4),
                fmt(r.get("sdpa_us")) if "sdpa_us" in r and not r.get("sdpa_error") else "—",
            ]
        )
    return out


def fp8_table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        f = r.get("fp8")
        if not f:
            continue
        err = f.get("fd_error_vs_bf16") or {}
        fi_err = f.get("fi_error_vs_bf16") or {}
        out.append(
            [
                r["heads"],
                str(r["page"]),
                r["shape"],
                fmt(r["kv_mib"], 0),
                fmt(r.get("fd_us")),
                fmt(f.get("fd_us")) if f.get("fd_us") else "fail",
                fmt(f.get("pct_copy")),
                fmt(f.get("speedup_vs_bf16"), 2),
                fmt(f.get("fi_best_us")),
                f.get("fi_best_path") or "—",
                fmt(f.get("ratio_vs_fi_fp8"), 3),
                fmt(err.get("max_abs"), 4),
                fmt(err.get("rel_l2"), 4),
                fmt(fi_err.get("rel_l2"), 4),
            ]
        )
    return out


def render_markdown(payload: dict[str, Any], notes: str | None = None) -> str:
    rows, env, ceilings, a = (
        payload["rows"],
        payload["environment"],
        payload["ceilings"],
        payload["args"],
    )
    fi_error = payload.get("flashinfer_error")
    md = [
        "# Paged decode attention: FlashDec vs FlashInfer's best path, graph-timed",
        "",
        environment_markdown(env),
        f"- ceilings: device-to-device copy {ceilings['copy_tbs']:.2f} TB/s (read+write), "
        f"read-only (torch.sum) {ceilings['read_tbs']:.2f} TB/s",
        "- FlashInfer: "
        + ("present" if not fi_error else f"**MISSING** ({fi_error}): FlashDec alone, no ratios"),
        f"- method: each side captured in a CUDA graph, {a['calls']} calls per graph, median "
        f"replay / {a['calls']} (do_bench, warmup {a['warmup']} ms, rep {a['rep']} ms, L2 flushed "
        "per replay); FlashDec through plan_decode + decode(workspace=); FlashInfer "
        "BatchDecodeWithPagedKVCacheWrapper at its best of HND/NHD x tensor-core/CUDA-core (HND "
        "reads FlashDec's K/V tensors, NHD a copy of the same values); random data and page ids "
        f"(seed {a['seed']}); '% copy' = KV bytes / time / copy ceiling; 'max |diff| vs FI': "
        "FlashDec's output against FlashInfer's best path; 'SDPA': gather + SDPA in PyTorch "
        "(with --sdpa)",
        f"- matrix: dtypes {', '.join(a['dtypes'])}; heads {', '.join(a['heads'])}; pages "
        f"{', '.join(map(str, a['pages']))} (all pages for {', '.join(a['page_heads'])}); kinds "
        f"{', '.join(a['kinds'])}"
        + (f"; shapes {', '.join(a['shapes'])}" if a.get("shapes") else "")
        + (
            f"; also {', '.join(a['more_heads'])} on {', '.join(a['more_shapes'] or ['all'])}"
            if a.get("more_heads")
            else ""
        ),
    ]
    if payload.get("partial"):
        md.append("- **partial results (run in progress or cut short)**")
    if payload.get("skipped_budget"):
        md.append(
            f"- not run, time budget ({a['budget_s']:.0f} s) spent: "
            f"{len(payload['skipped_budget'])} cases ({'; '.join(payload['skipped_budget'][:8])}"
            + (" ..." if len(payload["skipped_budget"]) > 8 else "")
            + ")"
        )
    if payload.get("skipped_size"):
        md.append(
            f"- left out, KV over {a['max_kv_gib']} GiB: {len(payload['skipped_size'])} cases"
        )
    md += ["", "## Targets of issue 10", ""]
    md += [f"- [{t['status']}] {t['target']}: {t['detail']}" for t in evaluate_targets(rows)]
    md += ["", "## Summary", "", *summary_lines(rows), "", "## All shapes", ""]
    md.append(markdown_table(COLUMNS, table_rows(rows)))
    fp8_rows = fp8_table_rows(rows)
    if fp8_rows:
        md += [
            "",
            "## FP8 e4m3 KV cache",
            "",
            "The same cases with K and V quantised to e4m3 (one scale each: amax / 448); "
            "'speedup' = FlashDec bf16 / FlashDec fp8; errors against FlashDec's bf16 output "
            "(quantisation included); '% copy' counts the FP8 bytes.",
            "",
            markdown_table(FP8_COLUMNS, fp8_rows),
        ]
    if notes:
        md += ["", notes.strip()]
    return "\n".join(md)


def write_report(payload: dict[str, Any], out_dir: Path, name: str, plot: bool = True) -> Path:
    md_path = out_dir / f"{name}.md"
    notes = None
    if md_path.exists():  # a re-render keeps the notes written by hand under the tables
        old = md_path.read_text()
        if "\n## Notes" in old:
            notes = old[old.index("\n## Notes") :]
    public = {**payload, "targets": evaluate_targets(payload["rows"])}
    write_results(name, render_markdown(payload, notes), public, out_dir)
    if plot:
        plot_rows(payload["rows"], payload["ceilings"], out_dir / f"{name}.png")
    return md_path


def plot_rows(rows: list[dict[str, Any]], ceilings: dict[str, float], path: Path) -> None:
    sel = [r for r in rows if r.get("fd_us")][:80]
    if not sel:
        return
    bar_plot(
        path,
        [f"{r['heads']} p{r['page']} {r['shape']}" for r in sel],
        {
            "FlashDec": [r.get("pct_copy") for r in sel],
            "FlashInfer best path": [r.get("fi_pct_copy") for r in sel],
        },
        "% of copy bandwidth (CUDA graph)",
        f"paged decode, graph-timed: % of the {ceilings['copy_tbs']:.2f} TB/s copy ceiling",
        hline=100.0,
    )


# ---------------------------------------------------------------------------------------------


ARG_KEYS = (
    "quick",
    "issue25",
    "heads",
    "more_heads",
    "more_shapes",
    "pages",
    "page_heads",
    "extra_page_shapes",
    "kinds",
    "shapes",
    "dtypes",
    "max_kv_gib",
    "calls",
    "warmup",
    "rep",
    "seed",
    "fp8",
    "sdpa",
    "budget_s",
)


PRECOMPILE_MAX_BYTES = 2 * 2**30  # larger cases compile in the timing pass (worker memory)


def warm_up_worker(jobs: list[tuple[str, Any]], seed: int, fp8: bool) -> int:
    """Worker: compile FlashDec's kernel variants of ``("case", MatrixCase)`` jobs and build
    FlashInfer's JIT modules of ``("flashinfer", heads)`` jobs (on a small batch), so that the
    timing pass finds them in the on-disk caches."""
    torch.cuda.init()
    done = 0
    flashinfer = None
    if any(kind == "flashinfer" for kind, _ in jobs):
        flashinfer, _ = load_flashinfer()
    for kind, what in jobs:
        try:
            if kind == "case":
                hq, hkv, d = parse_heads(what.heads)
                case = Case(
                    list(what.shape.lens),
                    hq,
                    hkv,
                    d,
                    what.page,
                    DTYPES[what.dtype],
                    seed,
                    shared_prefix=what.shape.shared_prefix,
                )
                case.flashdec_fns_for(case.plan())[0]()
                if fp8 and what.dtype == "bf16":
                    case.flashdec_fp8_fn()()
            elif flashinfer is not None:
                heads, dname = what
                hq, hkv, d = parse_heads(heads)
                case = Case([40, 70], hq, hkv, d, 16, DTYPES[dname], seed)
                ws = flashinfer_workspace()
                for layout, tc in FI_PATHS:
                    for kv_fp8 in (False, True) if fp8 and dname == "bf16" else (False,):
                        # a path that fails here fails (and is recorded) in the timing pass
                        with contextlib.suppress(Exception):
                            case.flashinfer_fn(flashinfer, tc, ws, layout, fp8=kv_fp8)()
            torch.cuda.synchronize()
            done += 1
        except Exception as exc:  # the timing pass meets (and records) it again
            print(f"warm-up failed: {kind} {what}: {short_error(exc)}", flush=True)
        finally:
            case = None
            torch.cuda.empty_cache()
    return done


def warm_up(cases: list[MatrixCase], args, flashinfer) -> None:
    """Compile in parallel what the timing pass would otherwise compile one case at a time."""
    if args.workers <= 1 or not cases:
        return
    jobs: list[tuple[str, Any]] = []
    if flashinfer is not None:
        jobs += [("flashinfer", hd) for hd in dict.fromkeys((c.heads, c.dtype) for c in cases)]
    jobs += [
        ("case", c)
        for c in cases
        if kv_bytes(c.shape.lens, *parse_heads(c.heads)[1:], 2) <= PRECOMPILE_MAX_BYTES
    ]
    timeout = max(10.0, min(args.budget_s / 2, 300.0))
    run_in_workers(
        warm_up_worker, jobs, args.workers, timeout, args.seed, args.fp8, round_robin=True
    )


def run(args) -> int:
    env = environment()
    flashinfer, fi_error = (
        (None, "disabled (--no-flashinfer)") if args.no_flashinfer else load_flashinfer()
    )
    if fi_error:
        print(f"FlashInfer unavailable: {fi_error} — FlashDec alone, no ratios", flush=True)
    env["flashinfer"] = getattr(flashinfer, "__version__", None)
    ceilings = {"copy_tbs": copy_ceiling_tbs(), "read_tbs": read_ceiling_tbs()}
    print(f"ceilings: copy {ceilings['copy_tbs']:.3f} TB/s, read {ceilings['read_tbs']:.3f} TB/s")
    cases, too_big = build_matrix(args)
    print(f"{len(cases)} cases ({len(too_big)} left out for size)", flush=True)
    t0 = time.time()
    warm_up(cases, args, flashinfer)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "args": {k: getattr(args, k) for k in ARG_KEYS},
        "environment": env,
        "ceilings": ceilings,
        "flashinfer_error": fi_error,
        "rows": [],
        "skipped_size": too_big,
        "skipped_budget": [],
        "partial": True,
    }
    out_dir = Path(args.out_dir)
    fi_ws = flashinfer_workspace() if flashinfer else None
    for mc in cases:
        if time.time() - t0 > args.budget_s:
            payload["skipped_budget"].append(" ".join(map(str, mc.key)))
            continue
        try:
            row = measure(mc, args, flashinfer, fi_ws, ceilings)
        except Exception as exc:  # one failing shape is reported and skipped
            traceback.print_exc()
            torch.cuda.synchronize()
            row = {**base_row(mc), "error": short_error(exc)}
        payload["rows"].append(row)
        f8 = row.get("fp8") or {}
        print(
            f"{_case(row):<44} {fmt(row['kv_mib'], 0):>6} MiB  FD {fmt(row.get('fd_us')):>7} us "
            f"({fmt(row.get('pct_copy'))}%)  FI {fmt(row.get('fi_best_us')):>7} us "
            f"[{row.get('fi_best_path') or '-'}] x{fmt(row.get('ratio'), 3)}  "
            f"splits {(row.get('plan') or {}).get('splits')}"
            + (
                f"  fp8 {fmt(f8.get('fd_us'))} us x{fmt(f8.get('speedup_vs_bf16'), 2)}"
                if f8
                else ""
            )
            + (
                f"  ERROR {row.get('error') or row.get('fd_error')}"
                if row.get("error") or row.get("fd_error")
                else ""
            ),
            flush=True,
        )
        write_report(payload, out_dir, args.name, plot=False)
    if payload["skipped_budget"]:
        print(f"[budget] {len(payload['skipped_budget'])} cases not run", flush=True)
    payload["partial"] = False
    md_path = write_report(payload, out_dir, args.name)
    text = md_path.read_text()
    print(text[text.index("## Targets") : text.index("## All shapes")])
    return 0


def rerender(args) -> int:
    path = Path(args.from_json)
    payload = json.loads(path.read_text())
    if payload.get("format") != FORMAT:
        print(
            f"{path} was written by an earlier bench_decode (format {payload.get('format', 1)}); "
            "re-render it with that commit",
            file=sys.stderr,
        )
        return 2
    payload.pop("targets", None)
    out_dir = path.parent if args.out_dir == str(RESULTS_DIR) else Path(args.out_dir)
    write_report(payload, out_dir, args.name if args.name != "decode" else path.stem)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # no GPU needed
        return rerender(args)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (or --from-json)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
