"""Sliding-window layer groups in a serving run: memory stays flat, and more requests fit.

Two measurements on one ``kv_spec`` (full-attention and sliding-window groups, each with its own
pool), both through the :class:`~flashdec.engine.ServingLoop` with random Q/K/V:

1. **A long generation.** One request decodes ``generation_tokens`` tokens; after every step the
   blocks it holds in each group are read from the cache. A full group's count grows with the
   length; a window group's stays at most ``ceil(window / block_size) + 1`` — flat.
2. **Admitted concurrency.** ``num_requests`` identical requests arrive at once, on the spec as
   given and on the same spec with every window removed (the same pools, all layers full
   attention). The lifetime scheduler commits each request in every group at that group's bound,
   so the windowed cache admits more at once; both runs finish every request without a stall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from flashdec.cache import PagedKVCache, format_kv_spec, parse_kv_spec
from flashdec.engine import DecodeEngine
from flashdec.engine.loop import LoopStep, ServingLoop, run_loop
from flashdec.scheduler import BlockAwareScheduler, RequestSpec, SchedulerConfig
from flashdec.workloads.config import WindowWorkloadConfig
from flashdec.workloads.engine_workload import RandomKVExecutor


@dataclass(frozen=True)
class ConcurrencyRun:
    """The concurrency trace on one spec."""

    kv_spec: str
    admitted_at_once: int  # requests the first scheduling round admitted (all arrived at once)
    peak_active: int
    finished: int
    rejected: int
    stalls: int  # batch requests that found no block (the lifetime policy never has one)
    steps: int


@dataclass(frozen=True)
class WindowWorkloadResult:
    """What the window workload measured (see the module docstring)."""

    config: WindowWorkloadConfig
    device: str
    kv_spec: str  # canonical
    groups: tuple[dict, ...]  # per group: layers, window, block size, pool, bound per request
    generation_tokens: int
    # after each step of the long request (prompt import first): its tokens, and its blocks
    # in each group
    tokens_trajectory: tuple[int, ...]
    blocks_trajectory: tuple[tuple[int, ...], ...]
    # per group, the fewest and most blocks held once the request is past every window (None:
    # it never got there)
    steady_blocks: tuple[tuple[int, int] | None, ...]
    max_blocks_held: tuple[int, ...]  # per group, over the generation
    final_blocks_held: tuple[int, ...]
    window_groups_flat: bool  # every window group stayed within its bound throughout
    windowed: ConcurrencyRun
    all_full: ConcurrencyRun  # the same pools, windows removed

    @property
    def concurrency_gain(self) -> float:
        """Requests admitted at once with windows over without."""
        return self.windowed.admitted_at_once / max(1, self.all_full.admitted_at_once)


def _engine(config: WindowWorkloadConfig, spec: str) -> tuple[DecodeEngine, RandomKVExecutor]:
    place = config.placement()
    cache = PagedKVCache(kv_spec=spec, device=place.device)
    engine = DecodeEngine(
        cache, append_backend=place.append_backend, decode_backend=place.decode_backend
    )
    executor = RandomKVExecutor(engine, config, cache.num_layers, place.device, place.dtype)
    return engine, executor


def _loop(config: WindowWorkloadConfig, engine, executor) -> ServingLoop:
    scheduler = BlockAwareScheduler(
        SchedulerConfig(
            max_active_requests=config.max_active_requests,
            max_batch_size=config.max_batch_size,
        )
    )
    return ServingLoop(engine, scheduler, executor, check_invariants=config.check_invariants)


def _long_generation(config: WindowWorkloadConfig, spec: str):
    engine, executor = _engine(config, spec)
    cache = engine.cache
    groups = range(cache.layout.num_groups)
    request = RequestSpec("long", config.context_tokens, config.generation_tokens, 0)
    trajectory: list[tuple[int, ...]] = []
    tokens: list[int] = []

    def on_step(record: LoopStep) -> None:
        if engine.request_state("long").value == "active":
            tokens.append(cache.seq_len("long"))
            trajectory.append(tuple(len(cache.request_block_ids("long", group=g)) for g in groups))

    run = run_loop(
        _loop(config, engine, executor),
        [(0, request)],
        max_steps=config.generation_tokens + 8,
        on_step=on_step,
    )
    if run.unfinished:
        raise RuntimeError("the long generation did not finish: the spec's pools are too small")
    return engine, tuple(tokens), tuple(trajectory)


def _concurrency(config: WindowWorkloadConfig, spec: str, progress, offset: int) -> ConcurrencyRun:
    engine, executor = _engine(config, spec)
    requests = [
        (0, RequestSpec(f"r{i}", config.context_tokens, config.max_new_tokens, i))
        for i in range(config.num_requests)
    ]
    records: list[LoopStep] = []
    done = 0

    def on_step(record: LoopStep) -> None:
        nonlocal done
        records.append(record)
        done += len(record.finished) + len(record.rejected)
        if progress is not None:
            progress(offset + done, 2 * config.num_requests)

    run = run_loop(
        _loop(config, engine, executor), requests, max_steps=config.max_steps, on_step=on_step
    )
    return ConcurrencyRun(
        kv_spec=spec,
        admitted_at_once=len(records[0].admitted) if records else 0,
        peak_active=max((r.active for r in records), default=0),
        finished=sum(len(r.finished) for r in records),
        rejected=sum(len(r.rejected) for r in records),
        stalls=sum(len(r.stuck) for r in records),
        steps=run.num_steps,
    )


def run_window_workload(
    config: WindowWorkloadConfig | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    **overrides,
) -> WindowWorkloadResult:
    """A long generation's blocks per group, and admitted concurrency with and without the
    spec's windows on the same pools; see :class:`WindowWorkloadConfig`."""
    config = dataclasses.replace(config or WindowWorkloadConfig(), **overrides)
    groups = parse_kv_spec(config.kv_spec)
    spec = format_kv_spec(groups)
    full = format_kv_spec([dataclasses.replace(g, window=None) for g in groups])
    engine, tokens, trajectory = _long_generation(config, spec)
    widest = max(g.window or 0 for g in groups)
    past = [counts for n, counts in zip(tokens, trajectory, strict=True) if n > widest]
    metrics = engine.cache.metrics()["groups"]
    bounds = [m["block_bound_per_request"] for m in metrics]
    per_group = list(zip(*trajectory, strict=True)) if trajectory else [() for _ in groups]
    flat = all(
        bound is None or max(counts, default=0) <= bound
        for bound, counts in zip(bounds, per_group, strict=True)
    )
    windowed = _concurrency(config, spec, progress, 0)
    all_full = _concurrency(config, full, progress, config.num_requests)
    return WindowWorkloadResult(
        config=config,
        device=str(engine.cache.device),
        kv_spec=spec,
        groups=tuple(
            {
                "group": m["group"],
                "layers": m["layers"],
                "window": m["window"],
                "block_size": m["block_size"],
                "num_blocks": m["num_blocks"],
                "block_bound_per_request": m["block_bound_per_request"],
            }
            for m in metrics
        ),
        generation_tokens=config.generation_tokens,
        tokens_trajectory=tokens,
        blocks_trajectory=trajectory,
        steady_blocks=tuple(
            (min(c[g] for c in past), max(c[g] for c in past)) if past else None
            for g in range(len(groups))
        ),
        max_blocks_held=tuple(max(c, default=0) for c in per_group),
        final_blocks_held=trajectory[-1] if trajectory else tuple(0 for _ in groups),
        window_groups_flat=flat,
        windowed=windowed,
        all_full=all_full,
    )


def describe(result: WindowWorkloadResult) -> list[tuple[str, str]]:
    """The result as ``(metric, value)`` rows."""
    rows = [("kv_spec", result.kv_spec), ("device", result.device)]
    for g, info in enumerate(result.groups):
        kind = "full" if info["window"] is None else f"window {info['window']}"
        bound = info["block_bound_per_request"]
        steady = result.steady_blocks[g]
        past = "" if steady is None else f"; {steady[0]}-{steady[1]} once past the window"
        rows.append(
            (
                f"group {g} ({kind}, layers {info['layers']})",
                f"long request held at most {result.max_blocks_held[g]} blocks, "
                f"{result.final_blocks_held[g]} at the end{past}"
                + ("" if bound is None else f" (bound {bound})"),
            )
        )
    rows += [
        ("generation", f"{result.config.context_tokens} + {result.generation_tokens} tokens"),
        ("window groups flat", "yes" if result.window_groups_flat else "NO"),
    ]
    for name, run in (("with windows", result.windowed), ("windows removed", result.all_full)):
        rows.append(
            (
                f"admitted at once, {name}",
                f"{run.admitted_at_once} of {result.config.num_requests} (peak active "
                f"{run.peak_active}, finished {run.finished}, stalls {run.stalls}, "
                f"{run.steps} steps)",
            )
        )
    rows.append(("concurrency gain", f"{result.concurrency_gain:.2f}x"))
    return rows


def window_result_tables(result: WindowWorkloadResult) -> list:
    from rich.table import Table

    table = Table(title="FlashDec window workload", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for key, value in describe(result):
        table.add_row(key, value)
    return [table]
