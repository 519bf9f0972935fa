"""Host cost of the engine's caller-provided Q/K/V step, phase by phase, countable on any CPU.

The GPU machine's CPU is slow (one tiny torch op about 7.6 µs, an index op 30–70 µs, a bound
Triton launch 9–12 µs: ``results/launch.md``), so the host cost of ``begin_step``,
``step_layer`` and ``commit_step`` follows the *number* of torch ops, kernel launches and the
Python around them. This tool counts them per phase:

- **aten ops**: every op PyTorch dispatches (views included: each costs host time), counted by a
  ``TorchDispatchMode``; **copies** are the ``copy_`` / ``_to_copy`` among them (the host→device
  uploads on a GPU cache);
- **launches**: Triton kernel launches (on the CPU they are counted and skipped, so the host
  time is the engine's own, not the interpreter's);
- ``--ops`` lists each phase's ops with their count and time per call (on a GPU: the host cost
  of issuing each op, whose kernel runs asynchronously);
- **host µs**: median wall time of each phase over the timed steps (without the counting mode),
  and with ``--profile`` the top functions of each phase by their own time (cProfile);
  **in ops µs**: of that, the median time inside the aten ops (measured in the counting pass):
  on the CPU it includes the ops' own work, which a GPU runs asynchronously, so
  host − in-ops is the Python the step costs.

A step of ``--batch`` requests grows from ``--context`` tokens by one token per step, so with
``--steps`` >= the page size the timed steps include block-boundary steps (where ``begin_step``
also takes blocks and writes the device tables); ops are reported as median and max over steps.

Run: ``python3 benchmarks/count_step_ops.py`` (32 layers, B = 1 and 64, tiny heads). On a CUDA
machine the kernels run for real and the launch count is that of the bound launches.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # else the engine falls back to torch backends

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.utils._python_dispatch import TorchDispatchMode

from flashdec import PagedKVCache
from flashdec.engine import DecodeEngine
from flashdec.kernels import _runtime

PHASES = ("begin_step", "step_layer", "commit_step")
COPY_OPS = frozenset({"copy_", "_to_copy"})


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (by op name), and the time spent running
    them (on the CPU that includes the op's own work, e.g. a gather's copying)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.op_seconds: Counter[str] = Counter()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        start = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.op_seconds[name] += elapsed


class LaunchCounter:
    """Counts Triton launches through FlashDec's launchers; ``skip`` makes them no-ops (CPU)."""

    def __init__(self, skip: bool) -> None:
        self.count = 0
        self.skip = skip
        self._depth = 0  # a bound launch's slow path goes through Launcher: count it once

    @contextlib.contextmanager
    def installed(self) -> Iterator[LaunchCounter]:
        launcher_call = _runtime.Launcher.__call__
        bound_call = _runtime.BoundLaunch.__call__

        def wrap(original: Callable) -> Callable:
            def call(obj, *args, **kwargs):
                if self._depth == 0:
                    self.count += 1
                if self.skip:
                    return None
                self._depth += 1
                try:
                    return original(obj, *args, **kwargs)
                finally:
                    self._depth -= 1

            return call

        _runtime.Launcher.__call__ = wrap(launcher_call)
        _runtime.BoundLaunch.__call__ = wrap(bound_call)
        try:
            yield self
        finally:
            _runtime.Launcher.__call__ = launcher_call
            _runtime.BoundLaunch.__call__ = bound_call


@dataclass
class PhaseCount:
    """One phase's counts over the timed steps (``step_layer``: per layer)."""

    ops: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    launches: list[int] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)
    in_ops_us: list[float] = field(default_factory=list)
    op_names: Counter = field(default_factory=Counter)
    op_us: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        def med(xs):
            return statistics.median(xs) if xs else float("nan")

        return {
            "ops_median": med(self.ops),
            "ops_max": max(self.ops, default=0),
            "copies_median": med(self.copies),
            "copies_max": max(self.copies, default=0),
            "launches_median": med(self.launches),
            "host_us_median": med(self.host_us),
            "in_ops_us_median": med(self.in_ops_us),
            "op_names": dict(self.op_names.most_common()),
            "op_us": dict(self.op_us.most_common()),
        }


def build_engine(
    batch: int,
    context: int,
    *,
    layers: int = 32,
    heads: tuple[int, int, int] = (4, 2, 16),
    page: int = 16,
    steps: int = 64,
    append_backend: str = "fused",
    decode_backend: str = "triton",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[DecodeEngine, list[str]]:
    """An engine over a ``layers``-layer cache with ``batch`` active requests at ``context``
    tokens each (imported in one prompt transaction), room for ``steps`` more tokens."""
    _, hkv, dim = heads
    blocks_per_seq = -(-(context + steps + 1) // page) + 1
    cache = PagedKVCache(
        num_layers=layers,
        num_kv_heads=hkv,
        head_dim=dim,
        block_size=page,
        max_blocks=batch * blocks_per_seq,
        dtype=dtype,
        device=device,
        max_blocks_per_seq=blocks_per_seq,
    )
    engine = DecodeEngine(cache, append_backend=append_backend, decode_backend=decode_backend)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid)
        engine.admit(rid)
    if context:
        tx = engine.begin_prefill(rids, [context] * batch)
        kv = torch.zeros(batch * context, hkv, dim, dtype=dtype, device=cache.device)
        for layer in range(layers):
            engine.prefill_layer(tx, layer, kv, kv)
        engine.commit_step(tx)
    return engine, rids


def layer_inputs(engine: DecodeEngine, batch: int, num_q_heads: int, gen) -> list[tuple]:
    cache = engine.cache
    dim, hkv, device = cache.head_dim, cache.num_kv_heads, cache.device
    dtype = engine.activation_dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return [
        (randn(batch, num_q_heads, dim), randn(batch, hkv, dim), randn(batch, hkv, dim))
        for _ in range(cache.num_layers)
    ]


def measure(
    engine: DecodeEngine,
    rids: list,
    inputs: list[tuple],
    *,
    steps: int,
    warmup: int,
    launches: LaunchCounter,
    profile: bool = False,
    repeat: int = 3,
) -> tuple[dict[str, PhaseCount], dict[str, str]]:
    """Counts per phase over ``steps`` committed steps (after ``warmup``): one pass with the op
    counter, then ``repeat`` passes timed (and profiled) without it; the host time is the
    smallest of the passes' medians."""
    counts = {phase: PhaseCount() for phase in PHASES}
    num_layers = engine.cache.num_layers
    for _ in range(warmup):
        _step(engine, rids, inputs)

    def counted(phase: str, fn: Callable, per: int = 1):
        mode = OpCounter()
        before = launches.count
        with mode:
            result = fn()
        ops = mode.ops
        entry = counts[phase]
        entry.ops.append(sum(ops.values()) / per)
        entry.copies.append(sum(n for name, n in ops.items() if name in COPY_OPS) / per)
        entry.launches.append((launches.count - before) / per)
        entry.in_ops_us.append(mode.seconds * 1e6 / per)
        entry.op_names.update(ops)
        entry.op_us.update({name: t * 1e6 for name, t in mode.op_seconds.items()})
        return result

    for _ in range(steps):
        tx = counted("begin_step", lambda: engine.begin_step(rids))
        counted(
            "step_layer",
            lambda tx=tx: [engine.step_layer(tx, i, *inputs[i]) for i in range(num_layers)],
            per=num_layers,
        )
        counted("commit_step", lambda tx=tx: engine.commit_step(tx))
    for phase in PHASES:  # per step (step_layer: per layer, like its counts)
        entry, per = counts[phase], steps * (num_layers if phase == "step_layer" else 1)
        entry.op_names = Counter({k: round(v / per, 2) for k, v in entry.op_names.items()})
        entry.op_us = Counter({k: round(v / per, 2) for k, v in entry.op_us.items()})

    profilers = {phase: cProfile.Profile() for phase in PHASES} if profile else {}

    def timed(phase: str, fn: Callable, per: int = 1):
        prof = profilers.get(phase)
        if prof is not None:
            prof.enable()
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        if prof is not None:
            prof.disable()
        counts[phase].host_us.append(elapsed * 1e6 / per)
        return result

    medians: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(repeat):  # the least-disturbed pass: other processes share this CPU
        for phase in PHASES:
            counts[phase].host_us = []
        for _ in range(steps):
            _sync(engine)
            tx = timed("begin_step", lambda: engine.begin_step(rids))
            timed(
                "step_layer",
                lambda tx=tx: [engine.step_layer(tx, i, *inputs[i]) for i in range(num_layers)],
                per=num_layers,
            )
            timed("commit_step", lambda tx=tx: engine.commit_step(tx))
        _sync(engine)
        for phase in PHASES:
            medians[phase].append(statistics.median(counts[phase].host_us))
    for phase in PHASES:
        counts[phase].host_us = [min(medians[phase])]
    reports = {}
    for phase, prof in profilers.items():
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        reports[phase] = text.getvalue()
    return counts, reports


def _step(engine: DecodeEngine, rids: list, inputs: list[tuple]) -> None:
    tx = engine.begin_step(rids)
    for i, (q, k, v) in enumerate(inputs):
        engine.step_layer(tx, i, q, k, v)
    engine.commit_step(tx)


def _sync(engine: DecodeEngine) -> None:
    if engine.cache.device.type == "cuda":
        torch.cuda.synchronize(engine.cache.device)


def count_step(
    batch: int,
    *,
    context: int = 40,
    layers: int = 32,
    heads: tuple[int, int, int] = (4, 2, 16),
    page: int = 16,
    steps: int = 16,
    warmup: int = 2,
    append_backend: str = "fused",
    decode_backend: str = "triton",
    profile: bool = False,
    repeat: int = 3,
) -> tuple[dict[str, dict], dict[str, str]]:
    """Per-phase summaries of ``steps`` steps of a ``batch``-request engine (kernels skipped on
    the CPU). The op-budget test and the command line both use this."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    launches = LaunchCounter(skip=device.type != "cuda")
    with launches.installed():
        engine, rids = build_engine(
            batch,
            context,
            layers=layers,
            heads=heads,
            page=page,
            steps=warmup + (1 + repeat) * steps,
            append_backend=append_backend,
            decode_backend=decode_backend,
            device=device,
            dtype=dtype,
        )
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = layer_inputs(engine, batch, heads[0], gen)
        counts, reports = measure(
            engine,
            rids,
            inputs,
            steps=steps,
            warmup=warmup,
            launches=launches,
            profile=profile,
            repeat=repeat,
        )
    return {phase: c.summary() for phase, c in counts.items()}, reports


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--context", type=int, default=40, help="tokens per request at the start")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", default="4/2/16", help="q/kv/head_dim")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--steps", type=int, default=32, help="counted (and timed) steps")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3, help="timed passes (the fastest counts)")
    p.add_argument("--append-backend", default="fused")
    p.add_argument("--decode-backend", default="triton")
    p.add_argument("--profile", action="store_true", help="cProfile each phase (top 14)")
    p.add_argument("--ops", action="store_true", help="list the aten ops of each phase")
    p.add_argument("--json", default=None, help="write the summaries here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    heads = tuple(int(x) for x in args.heads.split("/"))
    results = {}
    for batch in args.batches:
        summary, reports = count_step(
            batch,
            context=args.context,
            layers=args.layers,
            heads=heads,
            page=args.page,
            steps=args.steps,
            warmup=args.warmup_steps,
            append_backend=args.append_backend,
            decode_backend=args.decode_backend,
            profile=args.profile,
            repeat=args.repeat,
        )
        results[batch] = summary
        print(
            f"B={batch} ({args.layers} layers, heads {args.heads}, page {args.page}, "
            f"{args.steps} steps from context {args.context}; step_layer per layer)"
        )
        print(
            f"  {'phase':12s} {'aten ops med/max':>17s} {'copies med/max':>15s} "
            f"{'launches':>9s} {'host us':>9s} {'in ops us':>10s}"
        )
        for phase in PHASES:
            s = summary[phase]
            print(
                f"  {phase:12s} {s['ops_median']:8.1f}/{s['ops_max']:<8.1f}"
                f"{s['copies_median']:7.1f}/{s['copies_max']:<7.1f}"
                f"{s['launches_median']:9.1f} {s['host_us_median']:9.1f}"
                f"{s['in_ops_us_median']:11.1f}"
            )
            if args.ops:
                print(f"    ops per call: {s['op_names']}")
                print(f"    µs in each op per call: {s['op_us']}")
        for phase, text in reports.items():
            print(f"--- cProfile {phase} (B={batch})\n{text}")
    if args.json:
        env = {"torch": torch.__version__, "device": "cuda" if torch.cuda.is_available() else "cpu"}
        payload = {"args": vars(args), "env": env, "results": results}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
