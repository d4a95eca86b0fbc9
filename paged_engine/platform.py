"""What this machine can do, asked of the operating system and of torch, in one place.

Why one module: the machines that build and run paged_engine change from one day to the
next (Intel with AMX, AMD with AVX512-BF16, AMD with AVX2 only, aarch64), and a decision
taken from an assumption breaks on the next one (oneDNN's bfloat16 weight packing raises
without AVX-512). Every decision that depends on the machine reads this module: the dtypes
the linears pack (``layers/linear.py``), the compiled copy of the CPU kernels that runs and
the bfloat16 decode variant (``kernels/paged_decode_cpu.py``, ``fused_ops_cpu.py``), what
``dtype="auto"`` picks, the threads a process or tensor-parallel rank takes
(``default_num_threads``, ``threads_per_rank``) and how large the automatic KV pool may
grow (``available_memory_bytes``).

What cannot change while the process runs (the CPU's flags, torch's build) is probed once
and cached (``cpu_info``, ``torch_cpu``); what can (the CPUs this process may run on, cgroup
quotas, free memory) is read each time it is asked. The answers are frozen records: a test
describes another machine with ``dataclasses.replace`` and monkeypatches the probe. torch
is imported inside ``torch_cpu`` only: ``config.py``, and so ``engine/``, import this module
and stay torch-free. ``summary()`` is what this machine says, as plain data.
"""

from __future__ import annotations

import contextlib
import os
import platform as _stdlib_platform  # absolute: the standard library's, not this module
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "BF16_MATRIX_FLAGS",
    "DECODE_AVX512_BF16_FLAGS",
    "ISA_LEVELS",
    "CpuInfo",
    "TorchCpu",
    "available_memory_bytes",
    "cpu_info",
    "default_num_threads",
    "openmp_runtime_loaded",
    "openmp_waits_passively",
    "prepare_openmp",
    "read_cpu_info",
    "summary",
    "threads_per_rank",
    "torch_cpu",
    "usable_physical_cores",
]

CPUINFO = Path("/proc/cpuinfo")
SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
"""Where the probes read (module globals, so a test points them at files of its own)."""

_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ISA_LEVELS: dict[str, frozenset[str]] = {"x86-64-v4": _X86_64_V4, "x86-64-v3": _X86_64_V3}
"""The x86-64 psABI levels the compiled kernels have copies for, best first, with the
/proc/cpuinfo flags each needs (its own and the levels' below; LZCNT is ``abm``)."""
DECODE_AVX512_BF16_FLAGS = frozenset({"avx512_bf16", "avx512bw", "avx512vl"})
"""What the decode kernel's "avx512bf16" variant executes (VDPBF16PS, masked loads)."""
BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")
"""The bfloat16 matrix instructions that make bfloat16 faster than float32 on a CPU."""


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """The CPU as the kernel reports it (/proc/cpuinfo, first processor) and ``uname``."""

    architecture: str
    """The standard library's ``platform.machine()``: "x86_64", "aarch64", ..."""
    model_name: str | None
    """"model name" (x86); None where the file has none (aarch64) or cannot be read."""
    flags: frozenset[str]
    """"flags" (x86) or "Features" (aarch64); empty where unreadable."""

    def has(self, flags: Iterable[str]) -> bool:
        """Every one of ``flags`` is reported (whole names: ``avx512_bf16`` is not
        ``avx512_bf16x``)."""
        return frozenset(flags) <= self.flags

    @property
    def isa_levels(self) -> tuple[str, ...]:
        """The compiled kernels' instruction-set levels this CPU runs, best first: the
        x86-64 levels whose every flag it reports (on x86-64 only), then "baseline",
        which runs everywhere."""
        x86 = self.architecture in ("x86_64", "AMD64")
        runs = tuple(name for name, need in ISA_LEVELS.items() if x86 and self.has(need))
        return (*runs, "baseline")

    @property
    def bf16_features(self) -> tuple[str, ...]:
        """Which of ``BF16_MATRIX_FLAGS`` this CPU has."""
        return tuple(f for f in BF16_MATRIX_FLAGS if f in self.flags)


def read_cpu_info(path: Path = CPUINFO, architecture: str | None = None) -> CpuInfo:
    """Parse a /proc/cpuinfo (the first processor's lines: every core reports the same
    features); ``architecture`` defaults to this machine's. Unreadable: no flags."""
    arch = _stdlib_platform.machine() if architecture is None else architecture
    model: str | None = None
    flags: frozenset[str] = frozenset()
    try:
        text = path.read_text()
    except OSError:
        return CpuInfo(arch, None, flags)
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return CpuInfo(arch, model, flags)


@cache
def cpu_info() -> CpuInfo:
    """This machine's ``CpuInfo``, read once."""
    return read_cpu_info(CPUINFO)


@dataclass(frozen=True, slots=True)
class TorchCpu:
    """What the installed torch says it does on this CPU."""

    capability: str
    """``torch.backends.cpu.get_cpu_capability()``: the widest vector code torch's own
    kernels run here ("AVX512", "AVX2", "DEFAULT", "SVE256", ...)."""
    mkldnn: bool
    """``torch.backends.mkldnn.is_available()``: torch is built with oneDNN."""
    onednn_linear: bool
    """oneDNN is there and so are the linear ops ``layers/linear.py`` packs weights with
    (``torch.ops.mkldnn._reorder_linear_weight``, ``_linear_pointwise``)."""
    mkldnn_bf16: bool
    """``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: oneDNN computes bfloat16 here
    (x86: AVX512BW, VL and DQ, or AVX-NE-CONVERT; aarch64: the BF16 extension). Without
    it, packing a bfloat16 weight raises."""


@cache
def torch_cpu() -> TorchCpu:
    """This machine's ``TorchCpu``, asked of torch once (importing it)."""
    import torch

    mkldnn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    ops = torch.ops.mkldnn
    linear = mkldnn and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")
    bf16 = (
        mkldnn
        and hasattr(ops, "_is_mkldnn_bf16_supported")
        and bool(ops._is_mkldnn_bf16_supported())
    )
    return TorchCpu(
        capability=str(torch.backends.cpu.get_cpu_capability()),
        mkldnn=mkldnn,
        onednn_linear=linear,
        mkldnn_bf16=bf16,
    )


# ---- cores -----------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text)
    except ValueError:  # "max": no limit
        return None


def _sys_cpu_file(cpu: int, name: str) -> str | None:
    return _read(SYS_CPU / f"cpu{cpu}" / "topology" / name)


def _cgroup_dirs(controller: str) -> list[Path]:
    """The cgroup directories whose ``controller`` limits apply to this process, from
    /proc/self/cgroup: its own and each one above it, up to the hierarchy's root. v2 (the
    "0::" line, under ``CGROUP_ROOT``) and v1 (the line naming ``controller``, under
    ``CGROUP_ROOT / <its controllers>``) alike; the roots alone where the file is missing,
    and no deeper where a path leaves the mount (one outside this cgroup namespace)."""
    v1_root = CGROUP_ROOT / controller
    found: dict[Path, list[str]] = {CGROUP_ROOT: [], v1_root: []}
    for line in (_read(PROC_SELF_CGROUP) or "").splitlines():
        _, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if names == "":
            root = CGROUP_ROOT
        elif controller in names.split(","):
            root = CGROUP_ROOT / names if (CGROUP_ROOT / names).is_dir() else v1_root
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        found[root] = [] if ".." in parts else parts
    return [
        root.joinpath(*parts[:depth])
        for root, parts in found.items()
        for depth in range(len(parts) + 1)
    ]


def _cgroup_cpu_limit() -> int | None:
    """CPUs granted by the tightest cgroup CPU quota on this process's path (v2
    ``cpu.max`` "quota period", v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``),
    rounded up; None when unlimited."""
    quotas: list[tuple[int, int]] = []
    for d in _cgroup_dirs("cpu"):
        fields = (_read(d / "cpu.max") or "").split()
        if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
            quotas.append((int(fields[0]), int(fields[1])))
        quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            quotas.append((quota, period))
    cpus = [max(1, -(-q // p)) for q, p in quotas if q > 0 and p > 0]  # v1's -1: no quota
    return min(cpus) if cpus else None


def usable_physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (``sched_getaffinity``):
    SMT siblings (one ``core_cpus_list`` in /sys) count once; a CPU whose topology cannot
    be read counts as a core of its own. Capped by a cgroup CPU quota. Without affinity
    information (not Linux): ``os.cpu_count()``, which counts logical CPUs."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        siblings = _sys_cpu_file(cpu, "core_cpus_list") or _sys_cpu_file(
            cpu, "thread_siblings_list"
        )
        cores.add(siblings if siblings else f"cpu{cpu}")
    n = max(1, len(cores))
    quota = _cgroup_cpu_limit()
    return n if quota is None else min(n, quota)


# ---- memory ----------------------------------------------------------------------------------


_MEMORY_FILES = (
    ("memory.max", "memory.current"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes"),
)
"""A cgroup's memory limit and use: v2's, then v1's."""


def available_memory_bytes() -> int | None:
    """Memory this process could still take: /proc/meminfo's MemAvailable (else the free
    pages, ``SC_AVPHYS_PAGES``), and no more than any cgroup on this process's path leaves
    under its limit (``_MEMORY_FILES``); None when nothing can be read."""
    avail: int | None = None
    for line in (_read(MEMINFO) or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
            avail = int(fields[1]) * 1024
            break
    if avail is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for d in _cgroup_dirs("memory"):
        for limit_name, used_name in _MEMORY_FILES:
            limit, used = _read_int(d / limit_name), _read_int(d / used_name)
            if limit is not None and used is not None:
                room = max(0, limit - used)
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
    maps = _read(Path("/proc/self/maps"))
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
