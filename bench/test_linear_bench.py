"""``Linear`` on a oneDNN-packed weight against ``F.linear`` on the dense one, at one thread.

Shapes: the four projections of the 29M Qwen3-shaped model (``bench/test_vllm_bench.py``:
hidden 512, 8 / 4 heads of 64, intermediate 1792) at 32 rows (a decode step), 512 and
2,048 rows (prefill chunks), float32 and bfloat16. Per case the two alternate call by call
in one process (the machine is shared), ``CALLS`` timed calls each after a warm-up; the
figures (``extra_info``, printed) are each side's min and median in ms and
``packed / dense`` from the fastest and the median calls (below 1: packing pays).
pytest-benchmark's own time is the whole measurement, not a figure.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from paged_engine.layers import linear
from paged_engine.layers.linear import Linear

if not linear.packs(torch.float32):
    pytest.skip("torch has no oneDNN linear ops here", allow_module_level=True)

CALLS = 15
SHAPES = {"qkv": (512, 1024), "o": (512, 512), "gate_up": (512, 3584), "down": (1792, 512)}
CASES = [
    pytest.param(name, rows, dtype, id=f"{name}-{rows}-{str(dtype)[6:]}")
    for dtype in (torch.float32, torch.bfloat16)
    for rows in (32, 512, 2048)
    for name in SHAPES
]


@pytest.mark.benchmark(group="linear")
@pytest.mark.parametrize(("name", "rows", "dtype"), CASES)
def test_packed_linear(benchmark: Any, name: str, rows: int, dtype: torch.dtype) -> None:
    if not linear.packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (torch's mkldnn bf16 probe)")
    torch.set_num_threads(1)
    k, n = SHAPES[name]
    dense = torch.randn(n, k).to(dtype)
    layer = Linear(k, n).to(dtype)
    layer.weight.data.copy_(dense)
    layer.process_weights_after_loading()
    assert layer._packed is not None
    x = torch.randn(rows, k).to(dtype)
    times: dict[str, list[float]] = {"dense": [], "packed": []}
    calls = {"dense": lambda: F.linear(x, dense), "packed": lambda: layer(x)}

    def measure() -> None:
        for side in calls.values():
            side()
        for _ in range(CALLS):
            for side, call in calls.items():
                start = time.perf_counter()
                call()
                times[side].append(time.perf_counter() - start)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    torch.testing.assert_close(layer(x).float(), F.linear(x, dense).float(), rtol=2e-2, atol=1e-1)
    info: dict[str, Any] = {"suite": "linear", "shape": [rows, k, n], "dtype": str(dtype)}
    for side, ts in times.items():
        info[f"{side}_ms_min"] = min(ts) * 1e3
        info[f"{side}_ms_median"] = statistics.median(ts) * 1e3
    info["packed_over_dense_min"] = min(times["packed"]) / min(times["dense"])
    info["packed_over_dense_median"] = statistics.median(times["packed"]) / statistics.median(
        times["dense"]
    )
    benchmark.extra_info.update(info)
    print(
        "\nLINEAR",
        name,
        rows,
        dtype,
        {key: round(v, 3) for key, v in info.items() if "ms" in key or "over" in key},
    )
