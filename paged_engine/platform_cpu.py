"""What this CPU executes, asked of the operating system (/proc/cpuinfo) and of torch: the
instruction-set probes of the platform layer (``paged_engine.platform`` names them all).

Neither answer can change while the process runs, so each is probed once and cached
(``cpu_info``, ``torch_cpu``); both are frozen records, so a test describes another CPU
with ``dataclasses.replace`` and monkeypatches ``platform.cpu_info`` (what every
decision reads). torch is imported inside ``torch_cpu`` only: ``config.py``, and so
``engine/``, import the platform layer and stay torch-free.
"""

from __future__ import annotations

import platform as _stdlib_platform  # absolute: the standard library's, not paged_engine's
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "BF16_MATRIX_FLAGS",
    "CPUINFO",
    "DECODE_AMX_FLAGS",
    "DECODE_AVX512_BF16_FLAGS",
    "ISA_LEVELS",
    "CpuInfo",
    "TorchCpu",
    "cpu_info",
    "read_cpu_info",
    "torch_cpu",
]

CPUINFO = Path("/proc/cpuinfo")
"""Where ``cpu_info`` reads the CPU's flags."""

_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ISA_LEVELS: dict[str, frozenset[str]] = {"x86-64-v4": _X86_64_V4, "x86-64-v3": _X86_64_V3}
"""The x86-64 psABI levels the compiled kernels have copies for, best first, with the
/proc/cpuinfo flags each needs (its own and the levels' below; LZCNT is ``abm``)."""
DECODE_AVX512_BF16_FLAGS = frozenset({"avx512_bf16", "avx512bw", "avx512vl"})
"""What the decode kernel's "avx512bf16" variant executes (VDPBF16PS, masked loads)."""
DECODE_AMX_FLAGS = DECODE_AVX512_BF16_FLAGS | {"amx_bf16", "amx_tile"}
"""What its "amx" variant executes: the avx512bf16 copy, with its scores on AMX tiles."""
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
        return _isa_levels(self.architecture, self.flags)

    @property
    def bf16_features(self) -> tuple[str, ...]:
        """Which of ``BF16_MATRIX_FLAGS`` this CPU has."""
        return tuple(f for f in BF16_MATRIX_FLAGS if f in self.flags)


@cache
def _isa_levels(architecture: str, flags: frozenset[str]) -> tuple[str, ...]:
    """``CpuInfo.isa_levels``, kept per CPU description: every fused op's launch asks."""
    x86 = architecture in ("x86_64", "AMD64")
    runs = tuple(name for name, need in ISA_LEVELS.items() if x86 and need <= flags)
    return (*runs, "baseline")


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
