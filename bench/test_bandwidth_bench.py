"""Issue 25, item 2's measurement: the machine's read bandwidth (a STREAM-like read, 1 thread
and every usable CPU) and the CPU decode kernel's effective read bandwidth on the 29M
model's and SmolLM2-135M's attention shapes, batch 8 and 32, context 128 and 512, float32
and bfloat16 (where the CPU has bfloat16), with the kernel's fraction of the read
bandwidth. The measurement is
``bench/bandwidth.py`` (its docstring says what is read and how bytes are counted), run in
a fresh interpreter that imports paged_engine first, ``OMP_*``/``GOMP_*`` removed from its
environment (as bench/test_decode_threads_bench.py does).

Figures in ``extra_info`` (flat keys: ``stream_read_1t_gbs_best``,
``decode_float32_b32_c512_cold_1t_gbs_best``, ``..._fraction_best``, ...) and printed, one
line per cell; nothing is asserted about them. pytest-benchmark's own time is the whole
measurement (interpreter start included), not a figure. ``PAGED_ENGINE_BANDWIDTH_ROUNDS``
sets the rounds (default 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("PAGED_ENGINE_BANDWIDTH_ROUNDS", "5"))


def run_bandwidth(rounds: int) -> tuple[dict[str, Any], list[str]]:
    """``bench/bandwidth.py``'s figures and its printed lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    run = subprocess.run(
        [sys.executable, "-m", "bench.bandwidth", "--rounds", str(rounds)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def flatten(result: dict[str, Any]) -> dict[str, Any]:
    """``extra_info``'s flat keys (see the module)."""
    info: dict[str, Any] = {k: v for k, v in result.items() if k not in ("stream", "decode")}
    for key, value in result["stream"].items():
        if isinstance(value, dict):
            info.update({f"stream_{key}_{k}": v for k, v in value.items()})
        else:
            info[f"stream_{key}"] = value
    for cell, figures in result["decode"].items():
        for key, value in figures.items():
            if isinstance(value, dict):
                info.update({f"decode_{cell}_{key}_{k}": v for k, v in value.items()})
            else:
                info[f"decode_{cell}_{key}"] = value
    return info


@pytest.mark.benchmark(group="bandwidth")
def test_read_bandwidth_and_decode_kernel(benchmark: Any) -> None:
    got: list[tuple[dict[str, Any], list[str]]] = []
    benchmark.pedantic(lambda: got.append(run_bandwidth(ROUNDS)), rounds=1, iterations=1)
    result, lines = got[0]
    benchmark.extra_info.update({"suite": "bandwidth", "rounds": ROUNDS, **flatten(result)})
    print()
    for line in lines:
        print(line)
