"""Host cost of one ``BoundLaunch`` call (kernels/_runtime.py), without a GPU.

The compiled kernel is replaced by a stand-in whose C entry does nothing, so what is timed is
only FlashDec's Python per launch: the dynamic pointers read and patched, the hook check, the
stream query (stubbed here) and the call itself. Run: ``python benchmarks/bench_bound_launch.py``;
prints microseconds per call for 4 and 6 dynamic tensors (the decode's and the fused append's).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdec.kernels import _runtime


class _NoopRun:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    @staticmethod
    def launch(*args: object) -> None:
        return None


class _NoopCompiled:
    run = _NoopRun()
    function = None
    packed_metadata = ()


class _NoopKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoopCompiled()


def time_bound(num_dynamic: int, calls: int) -> float:
    """Microseconds per call of a bound launch with ``num_dynamic`` of 12 tensors dynamic."""
    tensors = tuple(torch.zeros(64)[16 * (i % 2) :] for i in range(12))
    bound = _runtime.Launcher(_NoopKernel()).bind(
        64, tensors, (3, 0.5, 128), (16, True), 4, dynamic=tuple(range(num_dynamic))
    )
    dynamic = tensors[:num_dynamic]
    bound(*dynamic)  # first call: "compiles" and binds
    start = time.perf_counter()
    for _ in range(calls):
        bound(*dynamic)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    _runtime.FAST_LAUNCH = True
    _runtime._current_device = lambda: 0
    _runtime.current_stream = lambda device: 0
    for n in (4, 6):
        print(f"BoundLaunch.__call__ with {n} dynamic tensors: {time_bound(n, args.calls):.3f} us")


if __name__ == "__main__":
    main()
