"""Test set-up: Triton runs interpreted on CPU-only machines; hypothesis profiles.

TRITON_INTERPRET must be set before Triton is first imported, so this happens at the top of the
first conftest, before any test module imports flashdec's kernels. The interpreter then gets one
speed fix (tests/interpreter.py). tests/profiles.py registers the hypothesis profiles ("ci" by
default, "large" on request).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Tests use tiny tensors and run two pytest workers on two cores: intra-op threads only add
    # contention (measured here: a small einsum took 1.7 ms with 2 threads, 0.06 ms with 1).
    torch.set_num_threads(1)
    # the same for the processes tests start (README examples, `python -m flashdec`)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests import profiles  # noqa: E402, F401  (registers and loads the hypothesis profiles)
from tests.interpreter import patch_language_once_per_launch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when present, else the CPU through the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
