"""Two or more ways of doing one thing, timed call by call in turn in one process (the
machine is shared and noisy: alternating spreads its noise over every side), and the
figures the micro-benchmarks report from those times; ``fresh_interpreter`` for the
suites that alternate whole processes instead."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def alternate(
    benchmark: Any, calls: Mapping[str, Callable[[], object]], n: int
) -> dict[str, list[float]]:
    """Each side's ``n`` timed calls (seconds), alternated call by call after one warm-up
    call each; pytest-benchmark's own time is the whole measurement, not a figure."""
    times: dict[str, list[float]] = {side: [] for side in calls}

    def measure() -> None:
        for call in calls.values():
            call()
        for _ in range(n):
            for side, call in calls.items():
                start = time.perf_counter()
                call()
                times[side].append(time.perf_counter() - start)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    return times


def figures(times: dict[str, list[float]], new: str, old: str) -> dict[str, float]:
    """Each side's min and median in ms, and ``new / old`` from the fastest and from the
    median calls (below 1: ``new`` is faster)."""
    out: dict[str, float] = {}
    for side, ts in times.items():
        out[f"{side}_ms_min"] = min(ts) * 1e3
        out[f"{side}_ms_median"] = statistics.median(ts) * 1e3
    out[f"{new}_over_{old}_min"] = min(times[new]) / min(times[old])
    out[f"{new}_over_{old}_median"] = statistics.median(times[new]) / statistics.median(times[old])
    return out


def sampled_in_turn(
    calls: Mapping[str, Callable[[], object]], samples: int, per_sample: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Each side's fastest and median sample in seconds per call. A sample is the mean of
    ``per_sample`` back-to-back calls (for calls too short to time one by one); the sides
    take turns, in reverse order every other sample, so neither always runs first."""
    times: dict[str, list[float]] = {side: [] for side in calls}
    sides = list(calls)
    for sample in range(samples):
        for side in sides if sample % 2 else sides[::-1]:
            start = time.perf_counter()
            for _ in range(per_sample):
                calls[side]()
            times[side].append((time.perf_counter() - start) / per_sample)
    return (
        {k: min(v) for k, v in times.items()},
        {k: statistics.median(v) for k, v in times.items()},
    )


def fresh_interpreter(
    code: str, args: Sequence[str], env: Mapping[str, str], timeout: float = 1200
) -> dict[str, Any]:
    """``code`` run as ``python -c code *args`` in the checkout with exactly ``env``; the
    JSON object it printed on its line that starts ``RESULT ``."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=dict(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))
