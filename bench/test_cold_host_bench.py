"""What a layer call's host side (Python, torch's dispatch, the allocator) costs right after
a projection, against the same call repeated hot.

Inside a run, a decode step's fused-op call takes several times what the same call takes in
a loop (docs/performance.md, "A layer call's host side after a projection"). This suite
separates the parts of one add+RMSNorm layer call at decode size (40 rows of 512, the 29M
model's hidden size; bfloat16 where oneDNN computes it, else float32), one thread:

* ``call``: ``fused_ops_layers.add_rms_norm_layer`` as the module runs it;
* ``kernel``: the C entry point alone, over tensors and arguments prepared once;
* ``alloc``: the call's two output allocations (``torch.empty_like``);
* ``attrs``: seven tensor attribute reads, the kind the call's checks make;
* ``python``: a loop of 20 integer additions, no torch at all.

Each is timed two ways, alternating within one process: ``hot`` (right after the same call) and
``after_matmul`` (each call right after the 29M model's gate_up projection on 64 decode
rows, which streams 3.7 MB of weights through the core's caches, as the call's
predecessor in a step does). ``extra_info``: ``us_min`` / ``us_median`` per part and way,
and ``cold_over_hot`` (medians). Read ratios within one run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from paged_engine.kernels import fused_ops_cpu
from paged_engine.kernels.fused_ops_entry import run_add_rms_norm
from paged_engine.kernels.fused_ops_layers import _level, add_rms_norm_layer
from paged_engine.worker.cpu_malloc import keep_freed_memory

ROWS, HIDDEN, INTERMEDIATE, DECODE_ROWS = 40, 512, 1792, 64
SAMPLES = 400
EPS = 1e-6


def _dtype() -> torch.dtype:
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def _parts(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    compiled = fused_ops_cpu.compiled()
    lanes = fused_ops_cpu.torch_sum_lanes()
    if compiled is None or lanes is None:
        pytest.skip(f"the fused ops are not usable here: {fused_ops_cpu.fused_ops_problem()}")
    x = torch.randn(ROWS, HIDDEN, dtype=dtype)
    res = torch.randn(ROWS, HIDDEN, dtype=dtype)
    weight = torch.rand(HIDDEN, dtype=dtype) + 0.5
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    level = _level(compiled)

    def attrs() -> object:
        return (
            x.is_cpu,
            x.dtype,
            x.is_contiguous(),
            x.is_neg(),
            x.requires_grad,
            x.shape[-1],
            x.numel(),
        )

    def python() -> object:
        total = 0
        for i in range(20):
            total += i
        return total

    return {
        "call": lambda: add_rms_norm_layer(x, res, weight, EPS),
        "kernel": lambda: run_add_rms_norm(
            compiled.module, x, res, weight, out, res_out, EPS, lanes, level
        ),
        "alloc": lambda: (torch.empty_like(x), torch.empty_like(x)),
        "attrs": attrs,
        "python": python,
    }


def _time(part: Callable[[], object], before: Callable[[], object] | None) -> float:
    """One timed call of ``part``, right after ``before`` (None: after ``part`` itself)."""
    (part if before is None else before)()
    start = time.perf_counter()
    part()
    return time.perf_counter() - start


@pytest.mark.benchmark(group="cold-host")
def test_host_side_after_a_projection(benchmark: Any, one_thread: None) -> None:
    keep_freed_memory("keep")  # as the model runner sets it: no page faults in the timings
    dtype = _dtype()
    parts = _parts(dtype)
    rows = torch.randn(DECODE_ROWS, HIDDEN, dtype=dtype)
    gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=dtype)

    def projection() -> object:
        return torch.nn.functional.linear(rows, gate_up)

    ways: dict[str, Callable[[], object] | None] = {"hot": None, "after_matmul": projection}
    times: dict[tuple[str, str], list[float]] = {(p, w): [] for p in parts for w in ways}

    def measure() -> None:
        for _ in range(SAMPLES):
            for p, part in parts.items():
                for w, before in ways.items():
                    times[p, w].append(_time(part, before))

    for part in parts.values():  # warm-up: every path loaded once
        for before in ways.values():
            _time(part, before)
    benchmark.pedantic(measure, rounds=1, iterations=1, warmup_rounds=0)
    info: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": ROWS}
    for p in parts:
        for w in ways:
            ts = times[p, w]
            info[f"{p}_{w}_us_min"] = round(min(ts) * 1e6, 2)
            info[f"{p}_{w}_us_median"] = round(statistics.median(ts) * 1e6, 2)
        info[f"{p}_cold_over_hot"] = round(
            statistics.median(times[p, "after_matmul"]) / statistics.median(times[p, "hot"]), 2
        )
    benchmark.extra_info.update(info)
    print(json.dumps(info))
    assert all(len(ts) == SAMPLES for ts in times.values())
