"""Deliberately broken fused small ops (``csrc/fused_ops.c``), each named after its bug.

The product carries no switch for any of them: each is the real source with one or two
textual patches, compiled here as a module of its own with setup.py's flags (at -O1 and
without the target clones, so that each builds in about a second) and swapped in for the
real one in the launcher (``fused_ops_cpu._MODULE``) for the duration of a block.
tests/test_fused_ops.py requires each to fail the same comparison the real kernel passes.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

from paged_engine.kernels import fused_ops_cpu
from tests.kernel_mutants import C_SOURCES, Patch, apply_patches, setup_extension

NO_CLONES: Patch = ("#ifdef HAVE_X86_LEVELS\n#define LEVELS", "#if 0\n#define LEVELS")
"""Mutants build the baseline copy only: one level is enough to catch them, at a third of
the compile time."""


@functools.cache
def build_fused_mutant(name: str, patches: tuple[Patch, ...]) -> ModuleType:
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    work = Path(tempfile.mkdtemp(prefix=f"paged-engine-fused-{name}-"))
    source = work / "fused_ops.c"
    text = (C_SOURCES / "fused_ops.c").read_text()
    source.write_text(apply_patches(text, (NO_CLONES, *patches), name))
    real = setup_extension()
    ext = Extension(
        "_fused_ops",
        sources=[str(source)],
        # -O1 after setup.py's -O3: the same arithmetic (the exact sections are pinned by
        # their pragma), a third of the compile time.
        extra_compile_args=[*real.extra_compile_args, "-O1"],
        extra_link_args=list(real.extra_link_args),
        libraries=list(real.libraries),
        include_dirs=[str(C_SOURCES)],  # isa.h
    )
    cmd = build_ext(Distribution({"name": f"fused-mutant-{name}", "ext_modules": [ext]}))
    cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    spec = importlib.util.spec_from_file_location(
        f"_fused_mutant_{name}._fused_ops", cmd.get_ext_fullpath(ext.name)
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.rmtree(work / "tmp", ignore_errors=True)
    return module


@dataclass(frozen=True)
class FusedMutant:
    name: str
    patches: tuple[Patch, ...]
    op: str
    """Which check must catch it: "norm", "qk" or "silu"."""
    bug: str

    @contextmanager
    def active(self) -> Iterator[None]:
        module = build_fused_mutant(self.name, self.patches)
        with mock.patch.object(fused_ops_cpu, "_MODULE", module):
            yield


MUTANTS = [
    FusedMutant(
        "skips_residual",
        (
            (
                "row[j] = rnd(load(r, j, bf16) + load(x, j, bf16), bf16);",
                "row[j] = load(x, j, bf16);",
            ),
        ),
        "norm",
        "the residual is not added (the norm and the returned sum are of x alone)",
    ),
    FusedMutant(
        "eps_outside_sqrt",
        (("return 1.f / sqrtf(mean + eps);", "return 1.f / (sqrtf(mean) + eps);"),),
        "norm",
        "1 / (sqrt(mean) + eps) instead of 1 / sqrt(mean + eps)",
    ),
    FusedMutant(
        "sequential_sum",
        (
            (
                "INLINE float inv_rms(",
                "INLINE float seq_squares(const float *x, int64_t n) {\n"
                "    float s = 0.f;\n"
                "    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];\n"
                "    return s;\n"
                "}\n\n"
                "INLINE float inv_rms(",
            ),
            (
                "(L == 8 ? sum_squares(x, n, 8) : sum_squares(x, n, 16))",
                "(L ? seq_squares(x, n) : 0.f)",
            ),
        ),
        "norm",
        "the squares summed left to right, not in torch's lane order (float32 rounding)",
    ),
    FusedMutant(
        "weight_before_cast",
        (
            (
                "store(o, j, load(a->w, j, bf16) * rnd(row[j] * scale, bf16), bf16);",
                "store(o, j, load(a->w, j, bf16) * (row[j] * scale), bf16);",
            ),
        ),
        "norm",
        "the weight multiplies the float32 row before its cast (one bfloat16 rounding, not "
        "transformers' two)",
    ),
    FusedMutant(
        "rope_sign",
        (
            (
                "store(x, j, p + rnd(normed[j + half] * load(s, j, bf16), bf16), bf16);",
                "store(x, j, p - rnd(normed[j + half] * load(s, j, bf16), bf16), bf16);",
            ),
        ),
        "qk",
        "the first half rotates the wrong way (sin's sign dropped)",
    ),
    FusedMutant(
        "q_weight_for_k",
        (("const void *w = h < a->q_heads ? a->wq : a->wk;", "const void *w = a->wq;"),),
        "qk",
        "the k heads are normed with q_norm's weight",
    ),
    FusedMutant(
        "silu_single_rounding",
        (
            (
                "store(o, j, rnd(silu, bf16) * load(u, j, bf16), bf16);",
                "store(o, j, silu * load(u, j, bf16), bf16);",
            ),
        ),
        "silu",
        "silu(g) * u rounded once in bfloat16, not after silu and again after the multiply",
    ),
    FusedMutant(
        "sigmoid_sign",
        (("v / (1.f + expf(fminf(-v, 88.f)))", "v / (1.f + expf(fminf(v, 88.f)))"),),
        "silu",
        "x * sigmoid(-x) instead of x * sigmoid(x)",
    ),
]
