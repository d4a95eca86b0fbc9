"""What this machine can do, asked of the operating system and of torch, in one place.

Why one layer: the machines that build and run paged_engine change from one day to the
next (Intel with AMX, AMD with AVX512-BF16, AMD with AVX2 only, aarch64), and a decision
taken from an assumption breaks on the next one (oneDNN's bfloat16 weight packing raises
without AVX-512). Every decision that depends on the machine reads this module: the dtypes
the linears pack (``layers/linear.py``), the compiled copy of the CPU kernels that runs and
the bfloat16 decode variant (``kernels/paged_decode_cpu.py``, ``fused_ops_cpu.py``), what
``dtype="auto"`` picks, the threads a process or tensor-parallel rank takes
(``default_num_threads``, ``threads_per_rank``), the CPUs ``cpu_bind.py`` may bind them to
(``allowed_cpus``, ``physical_cores``) and how large the automatic KV pool may grow
(``available_memory_bytes``).

The instruction-set probes (``cpu_info``, ``torch_cpu``) are ``platform_cpu``'s and the
cgroup files ``platform_cgroup``'s; this module names them all and holds what is built on
them: cores, memory and threads. What cannot change while the process runs (the CPU's
flags, torch's build) is probed once and cached; what can (the CPUs this process may run
on, cgroup quotas, free memory) is read each time it is asked. The answers are frozen
records: a test describes another machine with ``dataclasses.replace`` and monkeypatches
the probe here. ``summary()`` is what this machine says, as plain data.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from paged_engine.platform_cgroup import cpu_quotas, memory_room, read_text
from paged_engine.platform_cpu import (
    BF16_MATRIX_FLAGS,
    DECODE_AMX_FLAGS,
    DECODE_AVX512_BF16_FLAGS,
    ISA_LEVELS,
    CpuInfo,
    TorchCpu,
    cpu_info,
    read_cpu_info,
    torch_cpu,
)

__all__ = [
    "BF16_MATRIX_FLAGS",
    "DECODE_AMX_FLAGS",
    "DECODE_AVX512_BF16_FLAGS",
    "ISA_LEVELS",
    "CpuInfo",
    "TorchCpu",
    "allowed_cpus",
    "available_memory_bytes",
    "cpu_info",
    "default_num_threads",
    "openmp_runtime_loaded",
    "openmp_waits_passively",
    "physical_cores",
    "prepare_openmp",
    "read_cpu_info",
    "record_binding",
    "summary",
    "threads_per_rank",
    "torch_cpu",
    "usable_physical_cores",
]

SYS_CPU = Path("/sys/devices/system/cpu")
MEMINFO = Path("/proc/meminfo")
"""Where the probes read (module globals, so a test points them at files of its own)."""


# ---- cores -----------------------------------------------------------------------------------


def _sys_cpu_file(cpu: int, name: str) -> str | None:
    return read_text(SYS_CPU / f"cpu{cpu}" / "topology" / name)


def _cgroup_cpu_limit() -> int | None:
    """CPUs granted by the tightest cgroup CPU quota on this process's path
    (``platform_cgroup.cpu_quotas``), rounded up; None when unlimited."""
    cpus = [max(1, -(-q // p)) for q, p in cpu_quotas() if q > 0 and p > 0]  # v1's -1: none
    return min(cpus) if cpus else None


_binding: tuple[frozenset[int], frozenset[int]] | None = None
"""(the CPUs this process had, the CPUs it was bound to) when ``cpu_bind`` bound it."""


def record_binding(before: frozenset[int], after: frozenset[int]) -> None:
    """``cpu_bind.bind_process`` narrowed this process from ``before`` to ``after``; the
    first binding's ``before`` is kept (a process bound twice had it at the start)."""
    global _binding
    _binding = (before if _binding is None else _binding[0], after)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its affinity (``sched_getaffinity``), except
    while that is still what paged_engine bound it to: then the CPUs it had before. Why:
    a second ``LLM`` in a process the first one bound must plan its threads and CPUs
    from the same machine, not from the first one's share. Without affinity (not
    Linux): every CPU ``os.cpu_count()`` counts."""
    try:
        current = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(max(1, os.cpu_count() or 1)))
    if _binding is not None and current == _binding[1]:
        return _binding[0]
    return current


def physical_cores(cpus: Iterable[int]) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (SMT siblings share one ``core_cpus_list`` in
    /sys; a CPU whose topology cannot be read is a core of its own), each core's CPUs
    ascending, the cores in the order of their first CPU."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(set(cpus)):
        siblings = _sys_cpu_file(cpu, "core_cpus_list") or _sys_cpu_file(
            cpu, "thread_siblings_list"
        )
        cores.setdefault(siblings or f"cpu{cpu}", []).append(cpu)
    return sorted((tuple(c) for c in cores.values()), key=lambda c: c[0])


def usable_physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (``allowed_cpus``): SMT
    siblings count once; a CPU whose topology cannot be read counts as a core of its
    own. Capped by a cgroup CPU quota. Without affinity information (not Linux):
    ``os.cpu_count()``, which counts logical CPUs."""
    n = max(1, len(physical_cores(allowed_cpus())))
    quota = _cgroup_cpu_limit()
    return n if quota is None else min(n, quota)


# ---- memory ----------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """Memory this process could still take: /proc/meminfo's MemAvailable (else the free
    pages, ``SC_AVPHYS_PAGES``), and no more than any cgroup on this process's path leaves
    under its limit (``platform_cgroup.memory_room``); None when nothing can be read."""
    avail: int | None = None
    for line in (read_text(MEMINFO) or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
            avail = int(fields[1]) * 1024
            break
    if avail is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = memory_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


# ---- threads ---------------------------------------------------------------------------------

_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def openmp_runtime_loaded() -> bool:
    """Whether an OpenMP runtime (GNU's libgomp, which torch's CPU wheels bundle, Intel's
    or LLVM's) is already mapped into this process: it read ``OMP_WAIT_POLICY`` then, so
    setting the variable now changes nothing. torch being imported counts as loaded."""
    if "torch" in sys.modules:
        return True
    maps = read_text(Path("/proc/self/maps"))
    return maps is not None and any(lib in maps for lib in _OPENMP_LIBRARIES)


def prepare_openmp() -> None:
    """Ask OpenMP to wait passively (``OMP_WAIT_POLICY=PASSIVE``, unless the variable is
    already set) when no OpenMP runtime is loaded yet. ``import paged_engine`` calls this,
    so it is in effect whenever paged_engine is imported before torch (the CLI always is)."""
    if not openmp_runtime_loaded():
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def openmp_waits_passively() -> bool:
    """``OMP_WAIT_POLICY`` is PASSIVE (any case). Read from the environment, so a value set
    after torch was imported is believed though the runtime never saw it: set it before."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def default_num_threads() -> int:
    """``EngineConfig.num_threads``' default (see there): ``OMP_NUM_THREADS`` when set to
    a count; else, when OpenMP waits passively, the usable physical cores but one (at
    least 1); else 1."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) >= 1:
        return int(env)
    return max(1, usable_physical_cores() - 1) if openmp_waits_passively() else 1


def threads_per_rank(num_threads: int, ranks: int) -> int:
    """The intra-op threads each of ``ranks`` tensor-parallel ranks sharing this machine's
    CPUs takes when ``num_threads`` are asked for each: no more than its share of the
    usable physical cores (``usable_physical_cores() // ranks``, at least 1), so that the
    ranks together never take more cores than this process may use. One rank: as asked."""
    if ranks <= 1:
        return num_threads
    return max(1, min(num_threads, usable_physical_cores() // ranks))


def summary() -> dict[str, object]:
    """Everything above for this machine, as plain data (for a bug report or a log)."""
    cpu = cpu_info()
    return {
        "cpu": {
            "architecture": cpu.architecture,
            "model_name": cpu.model_name,
            "isa_levels": list(cpu.isa_levels),
            "bf16_features": list(cpu.bf16_features),
            "flags": sorted(cpu.flags),
        },
        "torch": asdict(torch_cpu()),
        "usable_physical_cores": usable_physical_cores(),
        "available_memory_bytes": available_memory_bytes(),
        "default_num_threads": default_num_threads(),
    }
