"""Where FlashDec runs: device discovery and whether Triton runs natively or interpreted.

``TRITON_INTERPRET`` must be decided before Triton is first imported; entry points (the CLI,
tests/conftest.py) call :func:`prepare_triton` early. Library code never sets it on its own.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


def triton_mode() -> str:
    """``native`` on a CUDA device, ``interpreted`` under TRITON_INTERPRET, else ``unavailable``."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "interpreted"
    if torch.cuda.is_available():
        return "native"
    return "unavailable"


def prepare_triton() -> str:
    """Turn on Triton's interpreter when there is no GPU (before Triton is imported)."""
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return triton_mode()


def available_host_bytes() -> int | None:
    """Memory the host can still give (MemAvailable; free pages where there is no /proc)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_memory_bytes(device: torch.device) -> int | None:
    """What ``device`` can still give: free GPU memory, or the host's available memory for
    the CPU (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class EnvironmentReport:
    python: str
    platform: str
    flashdec: str
    torch: str
    triton: str | None
    numpy: str | None
    transformers: str | None
    cuda_available: bool
    gpu_name: str | None
    gpu_sm_count: int | None
    gpu_memory_gib: float | None
    triton_mode: str

    def rows(self) -> list[tuple[str, str]]:
        def show(value) -> str:
            return "—" if value is None else str(value)

        return [
            ("python", self.python),
            ("platform", self.platform),
            ("flashdec", self.flashdec),
            ("torch", self.torch),
            ("triton", show(self.triton)),
            ("numpy", show(self.numpy)),
            ("transformers", show(self.transformers)),
            ("CUDA available", "yes" if self.cuda_available else "no"),
            ("GPU", show(self.gpu_name)),
            ("SMs", show(self.gpu_sm_count)),
            ("GPU memory (GiB)", show(self.gpu_memory_gib)),
            ("Triton kernels", self.triton_mode),
        ]


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def environment_report() -> EnvironmentReport:
    from flashdec import __version__

    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return EnvironmentReport(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        flashdec=__version__,
        torch=torch.__version__,
        triton=_version("triton"),
        numpy=_version("numpy"),
        transformers=_version("transformers"),
        cuda_available=cuda,
        gpu_name=props.name if props else None,
        gpu_sm_count=props.multi_processor_count if props else None,
        gpu_memory_gib=round(props.total_memory / 2**30, 1) if props else None,
        triton_mode=triton_mode(),
    )


@contextlib.contextmanager
def capture_cuda_graph(graph: torch.cuda.CUDAGraph, pool: object = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` with two guards every FlashDec capture needs.

    - **The cuBLAS workspace lives in the graph's pool.** PyTorch keeps one cuBLAS workspace per
      (handle, stream) and a captured GEMM bakes in its address. Captured with a workspace
      allocated elsewhere (an earlier graph's pool, or eager memory), the graph is left pointing
      at freed memory as soon as anything clears the workspaces — torch.compile's CUDA graph
      trees do, around every warm-up and recording — and its replays then scribble on reused
      memory or fault on unmapped memory (seen on the H200: an illegal memory access replaying
      a decode graph after transformers' compiled generate). Clearing before the capture makes
      the capture allocate a fresh workspace inside the graph's private pool (kept while the
      graph lives); clearing after keeps later work out of that pool. The same as
      torch._inductor's ``clear_cublas_manager``.
    - **Python's garbage collector waits.** torch no longer collects before a capture, so a
      collection that the capture's own allocations trigger can free an unrelated dead CUDA
      graph (an earlier ``LLM``'s, held in a reference cycle); destroying a graph while a stream
      captures is not permitted and invalidates the capture (seen on the H200: a warm start
      failed with cudaErrorStreamCaptureInvalidated at its first kernel, after "operation not
      permitted when stream is capturing (function reset)" warnings). Collections resume after.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if collecting:
            gc.enable()
        if clear is not None:
            clear()


def upload(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` on ``device`` without a wait: a pageable host-to-GPU copy synchronises the
    stream, so a GPU gets them through pinned memory, asynchronously (torch's pinned allocator
    keeps the staging buffer until the copy has run)."""
    on_gpu = device.type == "cuda"
    host = torch.tensor(values, dtype=dtype, pin_memory=on_gpu)
    return host.to(device, non_blocking=on_gpu)


class KernelBuilds:
    """Counts the Triton kernels built in this process while active (compiled, or loaded from
    Triton's disk cache): each one stalls the step that needs it for 50 ms to seconds, so a
    serving run after the warm start should count none. ``names``: builds per kernel;
    ``signatures``: Triton's description of the first few builds (warps, stages, each argument's
    specialisation), which says what the warm start missed; each build is logged too."""

    KEPT_SIGNATURES = 8

    def __init__(self) -> None:
        self.count = 0
        self.names: dict[str, int] = {}
        self.signatures: list[str] = []
        self._previous = None

    def _hook(self, **kwargs) -> None:
        self.count += 1
        fn = kwargs.get("fn")  # Triton 3.6: a JitFunctionInfo (module, name, jit_function)
        name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", fn), "__name__", "?")
        self.names[name] = self.names.get(name, 0) + 1
        signature = str(kwargs.get("repr", name))
        if len(self.signatures) < self.KEPT_SIGNATURES:
            self.signatures.append(signature)
        log.warning("Triton built a kernel: %s", signature)
        if self._previous is not None:
            self._previous(**kwargs)

    def __enter__(self) -> KernelBuilds:
        import triton  # here, not at import: the interpreter must be chosen before Triton loads

        runtime = triton.knobs.runtime
        self._previous = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = self._previous
