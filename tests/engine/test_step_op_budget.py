"""The op budget of the caller-provided Q/K/V step (issue 8): on the GPU machine's slow CPU the
host cost follows the number of torch ops and launches, so a regression in that number fails
here, on any machine (``benchmarks/count_step_ops.py`` counts them; kernels are skipped on CPU).

Measured at the commit that set these budgets (32 layers, B=64, 16 steps over a block boundary):
``begin_step`` 1 aten op per step (between block boundaries one device add moves the last
step's metadata a token on; at a boundary the host->device upload, +2 for the device-table
write, also into the batch's gathered tables, whose gather a repeated batch skips; the fused
append kernel saves the abort backup of each layer's slots itself), ``step_layer`` one output
allocation and one unbind per step (1/16 op per layer) and two launches, ``commit_step`` none.
Before: 2 (upload + backup gather), and earlier 4 / 8 ops per ``begin_step`` and one op per
layer.
"""

from __future__ import annotations

import pytest

from benchmarks.count_step_ops import count_step


@pytest.mark.parametrize("batch", [1, 64])
def test_step_op_budget(batch):
    summary, _ = count_step(batch, context=40, layers=32, steps=16, warmup=2, repeat=1)
    begin, layer, commit = (summary[p] for p in ("begin_step", "step_layer", "commit_step"))
    # begin: one host->device upload; + the table writes at a boundary (+ the first use of a
    # count's fixed buffer views); the abort backup is the append kernel's
    assert begin["ops_median"] <= 1, begin["op_names"]
    assert begin["ops_max"] <= 7, begin["op_names"]
    assert begin["copies_max"] <= 1, begin["op_names"]
    assert begin["copies_median"] == 0, begin["op_names"]  # uploads only at a boundary
    assert "index_select" not in begin["op_names"]
    # per layer: no torch op but the step's one output allocation (+ unbind), two launches
    assert layer["ops_max"] <= 2 / 32, layer["op_names"]
    assert layer["launches_median"] <= 3
    assert commit["ops_max"] == 0, commit["op_names"]
