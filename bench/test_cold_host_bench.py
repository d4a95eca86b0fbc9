"""What a layer call's host side (Python, torch's dispatch, the allocator) costs right after
a projection, against the same call repeated hot.

Inside a run, a decode step's fused-op call takes several times what the same call takes in
a loop (docs/performance.md, "A layer call's host side after a projection"). This suite
separates the parts of one add+RMSNorm layer call at decode size (40 rows of 512, the 29M
model's hidden size; bfloat16 where oneDNN computes it, else float32), one thread:

* ``call``: ``fused_ops_layers.add_rms_norm_layer`` as the module runs it;
* ``kernel``: the C entry point alone, its arguments (addresses, strides, sizes) computed
  once;
* ``alloc``: the call's two output allocations (``torch.empty_like``);
* ``attrs``: seven tensor attribute reads, the kind the call's checks make;
* ``python``: a loop of 20 integer additions, no torch at all.

Each is timed three ways, alternating within one process: ``hot`` (right after the same
part), ``after_down`` (right after the 29M model's down projection on the same 40 rows,
1.8 MB of weights in bfloat16: the norm's predecessor in a layer) and ``after_gate_up``
(after the gate_up projection on them, 3.7 MB). A part's result is released after its
timing. ``extra_info``: ``us_min`` / ``us_median`` per part and way, and
``<way>_over_hot`` (medians). Read ratios within one run. The suite keeps freed memory in
the heap as the model runner does (``cpu_malloc``), for the rest of the process.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from paged_engine import platform
from paged_engine.kernels import fused_ops_cpu
from paged_engine.kernels.cpu_library import ISA_CODES
from paged_engine.kernels.fused_ops_entry import run_add_rms_norm
from paged_engine.kernels.fused_ops_layers import add_rms_norm_layer
from paged_engine.worker.cpu_malloc import keep_freed_memory

ROWS, HIDDEN, INTERMEDIATE = 40, 512, 1792
SAMPLES = 400
EPS = 1e-6


def _dtype() -> torch.dtype:
    return torch.bfloat16 if platform.torch_cpu().mkldnn_bf16 else torch.float32


class _Capture:
    """Stands in for the compiled module: keeps the entry point's arguments."""

    args: tuple[object, ...] = ()

    def add_rms_norm(self, *args: object) -> None:
        self.args = args


def _parts(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    compiled = fused_ops_cpu.compiled()
    lanes = fused_ops_cpu.torch_sum_lanes()
    if compiled is None or lanes is None:
        pytest.skip(f"the fused ops are not usable here: {fused_ops_cpu.fused_ops_problem()}")
    x = torch.randn(ROWS, HIDDEN, dtype=dtype)
    res = torch.randn(ROWS, HIDDEN, dtype=dtype)
    weight = torch.rand(HIDDEN, dtype=dtype) + 0.5
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    level = ISA_CODES[fused_ops_cpu.isa_levels()[0]]
    capture = _Capture()
    run_add_rms_norm(capture, x, res, weight, out, res_out, EPS, lanes, level)  # type: ignore[arg-type]
    entry, args = compiled.module.add_rms_norm, capture.args
    called = add_rms_norm_layer(x, res, weight, EPS)
    assert called is not None, "the layer call declined these tensors: it would time nothing"
    entry(*args)
    assert torch.equal(called[0], out) and torch.equal(called[1], res_out)

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

    def kernel() -> object:
        entry(*args)
        return out, res_out  # args holds raw addresses: this closure keeps their tensors alive

    def python() -> object:
        total = 0
        for i in range(20):
            total += i
        return total

    return {
        "call": lambda: add_rms_norm_layer(x, res, weight, EPS),
        "kernel": kernel,
        "alloc": lambda: (torch.empty_like(x), torch.empty_like(x)),
        "attrs": attrs,
        "python": python,
    }


def _time(part: Callable[[], object], before: Callable[[], object] | None) -> float:
    """One timed call of ``part``, right after ``before`` (None: after ``part`` itself);
    its result is released after the clock stops."""
    (part if before is None else before)()
    start = time.perf_counter()
    result = part()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


@pytest.mark.benchmark(group="cold-host")
def test_host_side_after_a_projection(benchmark: Any, one_thread: None) -> None:
    kept = keep_freed_memory("keep")  # as the model runner sets it: no page faults timed
    dtype = _dtype()
    parts = _parts(dtype)
    rows = torch.randn(ROWS, INTERMEDIATE, dtype=dtype)
    down = torch.randn(HIDDEN, INTERMEDIATE, dtype=dtype)
    normed = torch.randn(ROWS, HIDDEN, dtype=dtype)
    gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=dtype)
    ways: dict[str, Callable[[], object] | None] = {
        "hot": None,
        "after_down": lambda: torch.nn.functional.linear(rows, down),
        "after_gate_up": lambda: torch.nn.functional.linear(normed, gate_up),
    }
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
    info: dict[str, Any] = {
        "dtype": str(dtype).removeprefix("torch."),
        "rows": ROWS,
        "heap_kept": kept,
    }
    for p in parts:
        for w in ways:
            ts = times[p, w]
            info[f"{p}_{w}_us_min"] = round(min(ts) * 1e6, 2)
            info[f"{p}_{w}_us_median"] = round(statistics.median(ts) * 1e6, 2)
        hot = statistics.median(times[p, "hot"])
        for w in ways:
            if w != "hot":
                info[f"{p}_{w}_over_hot"] = round(statistics.median(times[p, w]) / hot, 2)
    benchmark.extra_info.update(info)
    print(json.dumps(info))
