"""pytest hooks for the benchmarks: side-by-side ratios into every saved run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.ratios import add_tracked_ratios, machine


@pytest.hookimpl(optionalhook=True)  # pytest-benchmark is in the bench extra only
def pytest_benchmark_update_json(config: Any, benchmarks: Any, output_json: dict) -> None:
    """Before a run is saved (``--benchmark-autosave``/``--benchmark-json``): add the
    allocator suite's ``engine/spec`` ratios, and the CPU model and usable CPUs, which
    pytest-benchmark's ``machine_info`` lacks without py-cpuinfo."""
    add_tracked_ratios(output_json)
    info = output_json.setdefault("machine_info", {})
    info["paged_engine_bench_machine"] = machine()
    # bench.slowed_allocator's deliberate regression, when loaded: the run says so.
    info["slowed_allocator"] = getattr(config, "paged_engine_slow_hash", None)
    # The allocator ratios are in this clock's units (bench-compare: time.process_time).
    info["benchmark_timer"] = str(config.getoption("benchmark_timer", None))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test (the kernels' single-thread benches), then back."""
    import torch  # here: the other suites' runs need not load it for this hook file

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
