"""The ratios regression tracking follows: side by side in one run, fastest rounds.

A benchmark's absolute time moves with the machine and with whatever else runs on it (the
spec's mean moved 23% between two runs with no code change); a ratio of two systems timed
in the same process, minutes apart, on the same requests, mostly does not: both sides see
the same machine. So each saved run carries, in its benchmarks' ``extra_info``, a
``tracked_ratios`` mapping ``{name: ratio}``, every ratio "ours over theirs", above 1 when
ours is faster, each from the fastest round of each side:

* ``engine/spec <scenario>``: the allocator suite, spec's microseconds per sequence-step
  over the engine's, in process CPU time, from engine rounds interleaved with the spec
  test's own (``bench/test_allocator_bench.py`` records it in the spec's benchmark). Runs
  saved before that carry only the two separate tests' figures: for them the ratio is
  derived here (the ``pytest_benchmark_update_json`` hook in ``bench/conftest.py`` adds
  it to the engine's benchmark);
* ``paged_engine/transformers (cpu)`` and ``paged_engine[torch]/transformers (cpu)``: the
  end-to-end suite's output tokens per CPU-second ratio (``bench/test_e2e_bench.py``
  records it);
* ``paged_engine/vllm <model> <dtype> <threads>t``: ``bench/test_vllm_bench.py``.

``bench/compare.py`` checks them against ``bench/baselines/ratios.json``. ``tox -e
bench-compare`` times in process CPU time (``--benchmark-timer=time.process_time``): on a
shared 2-core machine (load average 4-6) the wall-clock ``engine/spec`` ratios moved by
-39% to +70% between runs with no code change, since the engine's 0.1 s rounds and the
spec's 10 s ones see the machine's load differently; CPU time leaves out the time the
process waits for a core.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["add_tracked_ratios", "machine", "tracked_ratios"]


def add_tracked_ratios(run: dict[str, Any]) -> None:
    """Write the allocator suite's ``engine/spec`` ratios into the engine benchmarks'
    ``extra_info["tracked_ratios"]`` (a pair where both sides ran with timings), except
    where the spec's benchmark already carries the interleaved one."""
    pairs: dict[str, dict[str, dict[str, Any]]] = {}
    for bench in run.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if info.get("suite") == "allocator" and "us_per_seq_step_min" in info:
            pairs.setdefault(info["scenario"], {})[info["allocator"]] = info
    for scenario, pair in pairs.items():
        engine, spec = pair.get("engine"), pair.get("spec")
        if engine is None or spec is None:
            continue
        if f"engine/spec {scenario}" in spec.get("tracked_ratios", {}):
            continue
        ratio = spec["us_per_seq_step_min"] / engine["us_per_seq_step_min"]
        engine.setdefault("tracked_ratios", {})[f"engine/spec {scenario}"] = round(ratio, 3)


def tracked_ratios(run: dict[str, Any]) -> dict[str, float]:
    """Every ``tracked_ratios`` entry of a saved run, derived ones included (so a run saved
    before the hook existed is read the same way)."""
    add_tracked_ratios(run)
    out: dict[str, float] = {}
    for bench in run.get("benchmarks", []):
        for name, value in bench.get("extra_info", {}).get("tracked_ratios", {}).items():
            out[name] = float(value)
    return out


def machine() -> dict[str, Any]:
    """The CPU model (``/proc/cpuinfo``'s first "model name") and the CPUs this process may
    use: what a baseline's ratios were measured on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 0
    return {"cpu_model": model, "cpus": cores}
