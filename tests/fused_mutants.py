"""Deliberately broken fused small ops (``csrc/fused_ops_rows.h``, ``csrc/fused_ops_rope.h``),
each named after its bug.

The product carries no switch for any of them: each is a patch file,
``tests/fused_mutants/<name>.patch``, applied to a temporary copy of csrc/ when the mutant
is first used (tests/patch_mutants.py: a stale patch fails that mutant's test alone, naming
its hunk). The copy is compiled as a module of its own with setup.py's flags, at -O1 and
for the baseline level alone (``BASELINE_ONLY``), so that each builds quickly, and bound
in the launcher (``fused_ops_cpu._COMPILED``) for the duration of a block.
tests/test_fused_ops.py requires each to fail the same comparison the real kernel passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from paged_engine.kernels import fused_ops_cpu
from paged_engine.kernels.cpu_library import CompiledModule
from paged_engine.kernels.fused_ops_cpu import MAX_COLS
from tests.kernel_mutants import compile_extension, setup_extension
from tests.patch_mutants import ROOT, patched_copy, read_patch

PATCH_DIR = ROOT / "tests" / "fused_mutants"
"""One ``<name>.patch`` per mutant below (tests/test_cpu_kernel.py checks both ways)."""
BASELINE_ONLY = ("-O1", "-D__clang__")
"""After setup.py's flags: -O1 does the same arithmetic (the exact sections are pinned by
their pragma) in less compile time, and a build told it is clang takes the path
every compiler but GCC 12+ on x86-64 takes (csrc/isa.h): the baseline copy alone, which is
enough to catch a mutant."""


@functools.cache
def build_library_module(name: str, patch: Path, source: str, module: str) -> ModuleType:
    """csrc/``source`` (one of the library's modules beside the decode kernel) with
    ``patch`` applied, built alone as ``module``."""
    from setuptools import Extension

    work = patched_copy(name, read_patch(name, patch), ("csrc",))
    real = setup_extension()
    ext = Extension(
        module,
        sources=[str(work / "csrc" / source)],
        extra_compile_args=[*real.extra_compile_args, *BASELINE_ONLY],
        extra_link_args=list(real.extra_link_args),
        libraries=list(real.libraries),
        include_dirs=[str(work / "csrc")],  # isa.h
    )
    return compile_extension(name, ext, work)


def three_levels_row() -> int:
    """A row whose sum of squares ends with three of the cascade's levels holding partial
    sums (343 groups of 4 of torch's lane-vectors: 256 carried up twice, 80 once, 7 not), so
    the order in which they are added can show (a float32 model of the sum, seed 4's 32
    rows: 7 rows' sums change at 4 lanes, 6 at 8); with 16 lanes that is past MAX_COLS,
    where no row holds three levels."""
    return min(4 * (fused_ops_cpu.torch_sum_lanes() or 8) * 343, MAX_COLS)


def _three_levels_unreachable() -> str | None:
    if three_levels_row() < MAX_COLS:
        return None
    return (
        "torch sums 16 lanes here: no row within MAX_COLS holds three levels, so the order "
        "they are added in changes nothing (an equivalent mutant)"
    )


@dataclass(frozen=True)
class FusedMutant:
    name: str
    op: str
    """Which check must catch it: "norm", "qk" or "silu"."""
    bug: str
    equivalent_here: Callable[[], str | None] | None = None
    """Says why the mutant computes what the kernel computes on this machine (its test then
    skips with that reason instead of demanding a failure no input can show), or None."""

    @contextmanager
    def active(self) -> Iterator[None]:
        patch = PATCH_DIR / f"{self.name}.patch"
        module = build_library_module(self.name, patch, "fused_ops.c", "_fused_ops")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused_ops_cpu, "_COMPILED", CompiledModule.of(module))
            yield


MUTANTS = [
    FusedMutant(
        "skips_residual",
        "norm",
        "the residual is not added (the norm and the returned sum are of x alone)",
    ),
    FusedMutant(
        "eps_outside_sqrt", "norm", "1 / (sqrt(mean) + eps) instead of 1 / sqrt(mean + eps)"
    ),
    FusedMutant(
        "sequential_sum",
        "norm",
        "the squares summed left to right, not in torch's lane order (float32 rounding)",
    ),
    FusedMutant(
        "levels_added_in_reverse",
        "norm",
        "a long row's carried partial sums added to the running one top level first, not in "
        "torch's order (float32 rounding)",
        _three_levels_unreachable,
    ),
    FusedMutant(
        "weight_before_cast",
        "norm",
        "the weight multiplies the float32 row before its cast (one bfloat16 rounding, not "
        "transformers' two)",
    ),
    FusedMutant("rope_sign", "qk", "the first half rotates the wrong way (sin's sign dropped)"),
    FusedMutant("q_weight_for_k", "qk", "the k heads are normed with q_norm's weight"),
    FusedMutant(
        "grouped_lanes_reversed",
        "qk",
        "a group of heads adds its lane partials last lane first, not in torch's order "
        "(float32 rounding)",
    ),
    FusedMutant(
        "rope_alone_normed",
        "rope",
        "without weights the heads are still RMS-normed (with a weight of 1) before the rotation",
    ),
    FusedMutant(
        "silu_single_rounding",
        "silu",
        "silu(g) * u rounded once in bfloat16, not after silu and again after the multiply",
    ),
    FusedMutant("sigmoid_sign", "silu", "x * sigmoid(-x) instead of x * sigmoid(x)"),
]
