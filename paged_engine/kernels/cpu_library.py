"""The compiled CPU library (``paged_engine._cpu_kernels``, built from csrc/ by setup.py),
loaded once for the launchers that call into it.

One shared library holds three extension modules (PEP 489 allows several):
``_cpu_kernels``, the paged-decode kernel (``paged_decode_cpu``); ``_fused_ops``, the fused
small ops (``fused_ops_cpu``); and ``_sample_ops``, the sampler's argmax and finiteness
pass (``sample_ops_cpu``). Each launcher binds its module once, at import, as a
``CompiledModule``: the module and what it says of itself that cannot change while the
process runs, the instruction-set levels (csrc/isa.h) it has copies for and this CPU
executes (the module's own CPUID check). Every launch check intersects those with the
levels the platform layer finds the CPU's flags for (``platform.CpuInfo.isa_levels``).

The library is optional (setup.py): where it is missing, or predates what a launcher
needs, the loaders return the reason instead of a module, and the launchers'
``*_problem`` functions report it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
from dataclasses import dataclass
from types import ModuleType

__all__ = [
    "FUSED_REQUIRES",
    "ISA_CODES",
    "CompiledModule",
    "described",
    "level_code",
    "load_decode_module",
    "load_fused_module",
    "load_sample_module",
]

ISA_CODES = {"baseline": 0, "x86-64-v3": 1, "x86-64-v4": 2}
"""The instruction-set levels the kernels are compiled at (csrc/isa.h), with the code the C
entry points take."""

LIBRARY = "paged_engine._cpu_kernels"


@dataclass(frozen=True, slots=True)
class CompiledModule:
    """One module of the compiled library, and the levels it runs here."""

    module: ModuleType
    """Its functions are the kernels' C entry points (raw addresses and sizes)."""
    levels: tuple[str, ...]
    """``ISA_CODES``' names of the copies it has that this CPU executes, best first (its
    ``isa_levels()``, asked once: neither the build nor the CPU changes)."""

    @classmethod
    def of(cls, module: ModuleType) -> CompiledModule:
        return cls(module, tuple(module.isa_levels()))

    def levels_allowed(self, allowed: tuple[str, ...]) -> tuple[str, ...]:
        """``levels`` that are also in ``allowed`` (the platform layer's), best first."""
        return tuple(level for level in self.levels if level in allowed)


Loaded = tuple[CompiledModule | None, str | None]
"""A loader's answer: the module, or None and why."""


def level_code(what: str, isa: str | None, levels: tuple[str, ...]) -> int:
    """The code of level ``isa`` (None: the first, best, of ``levels``); ValueError naming
    the choices when ``levels`` lacks it."""
    if isa is None:
        return ISA_CODES[levels[0]]
    if isa not in levels:
        raise ValueError(f"{what}: isa {isa!r} is not available here; choose one of {levels}")
    return ISA_CODES[isa]


def described(module: ModuleType, requires: tuple[tuple[str, str], ...] = ()) -> Loaded:
    """``module`` bound, or None and why where it lacks the instruction-set levels or one of
    ``requires``' attributes (each named with what a build without it predates)."""
    if not hasattr(module, "isa_levels"):
        return None, "the compiled CPU kernels predate the instruction-set levels; rebuild them"
    for attribute, feature in requires:
        if not hasattr(module, attribute):
            return None, f"the compiled CPU kernels predate {feature}; rebuild them"
    return CompiledModule.of(module), None


def load_decode_module() -> Loaded:
    """The decode kernel's module (``_cpu_kernels``), or why it cannot be used."""
    try:
        module = importlib.import_module(LIBRARY)
    except ImportError as exc:
        return None, (
            f"the compiled CPU kernels are not built ({exc}); reinstall paged_engine on a "
            "machine with a C compiler"
        )
    return described(module)


def _load_other_module(name: str, what: str, requires: tuple[tuple[str, str], ...] = ()) -> Loaded:
    """Module ``paged_engine.<name>`` of the library (another init function in the same
    file), or why it cannot be used (``what`` names it in the reason; ``requires`` as
    ``described``'s)."""
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or spec.origin is None:
        return None, f"the compiled CPU kernels are not built (no {LIBRARY})"
    name = f"paged_engine.{name}"
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, spec.origin)
        other = importlib.util.spec_from_file_location(name, spec.origin, loader=loader)
        assert other is not None
        module = importlib.util.module_from_spec(other)
        loader.exec_module(module)
    except ImportError as exc:
        return None, f"the compiled CPU kernels predate {what} ({exc}); rebuild them"
    return described(module, requires)


FUSED_REQUIRES = (("ROTATION_ONLY", "the rotation without the q/k norm"),)
"""What a fused-ops build must say of itself: ``qk_norm_rope`` taking no weights (an older
build would read through the NULL pointers)."""


def load_fused_module() -> Loaded:
    """The fused ops' module (``_fused_ops``, the library's second init function), or why
    it cannot be used."""
    return _load_other_module("_fused_ops", "the fused ops", FUSED_REQUIRES)


def load_sample_module() -> Loaded:
    """The sampler's module (``_sample_ops``: the argmax and finiteness pass), or why it
    cannot be used."""
    return _load_other_module("_sample_ops", "the sampler's argmax pass")
