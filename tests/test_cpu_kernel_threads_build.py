"""The CPU decode kernel's threads, as built: the mutants of the C driver (``run_items``;
tests/kernel_mutants.py's ``THREAD_MUTANTS``) that tests/test_cpu_kernel_threads.py's
checks must catch, the sources
built without OpenMP (one thread, the same bits), and setup.py dropping ``-fopenmp`` and
libmvec only where the toolchain refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from setuptools import Distribution

from paged_engine.kernels import paged_decode_cpu
from paged_engine.kernels.paged_decode_cpu import bf16_variants, cpu_kernels_threaded
from tests import test_cpu_kernel_threads as checks_module
from tests.kernel_mutants import (
    THREAD_MUTANTS,
    CpuKernelMutant,
    build_c_module,
    decode_module_bound,
    setup_arguments,
)

HONOUR = "-ffp-contract=fast-honor-pragmas"
"""clang's flag that setup.py adds where the compiler takes it (GCC refuses it)."""


# ---- the scheduling mutants: patched copies of the C driver, caught by the checks above ----


@pytest.mark.parametrize("mutant", THREAD_MUTANTS, ids=[m.name for m in THREAD_MUTANTS])
def test_each_scheduling_mutant_is_caught(mutant: CpuKernelMutant) -> None:
    module = mutant.module()
    failures = []
    checks: list[tuple[Callable[..., None], dict[str, Any]]] = [
        (checks_module.test_the_same_bits_at_every_thread_count, {"name": n, "variant": v})
        for n in checks_module.CASES
        for v in (None, *bf16_variants())
    ]
    checks.append((checks_module.test_fewer_items_than_threads_use_fewer_threads, {}))
    checks += [
        (checks_module.test_a_batch_in_any_order_gives_each_sequence_the_same_bits, {"variant": v})
        for v in (None, *bf16_variants())
    ]
    real = paged_decode_cpu._COMPILED
    with decode_module_bound(module):
        for check, kwargs in checks:
            try:
                check(**kwargs)
            except AssertionError as exc:
                failures.append(f"{check.__name__}{kwargs}: {str(exc)[:80]}")
    assert paged_decode_cpu._COMPILED is real
    assert failures, f"no check catches {mutant.name} ({mutant.bug})"


# ---- builds without OpenMP ------------------------------------------------------------------


def test_a_build_without_openmp_runs_one_thread_with_the_same_bits() -> None:
    """The sources compiled with OpenMP off (what setup.py's BuildExt does where the
    toolchain lacks it): the module builds, says it is not threaded, runs any num_threads on
    one thread, and gives the threaded build's bits."""
    module = build_c_module("no_openmp", None, ("-fno-openmp",))
    assert not module.threaded()
    t = checks_module.materialise(checks_module.CASES["ragged-gqa"], None)
    want, ran = checks_module.run(t, None, 4)
    assert ran == 4
    with decode_module_bound(module):
        assert not cpu_kernels_threaded()
        got, ran = checks_module.run(t, None, 4)
    assert ran == 1
    assert torch.equal(got, want)


class _Compiler:
    """A stand-in for distutils' compiler: records what it is asked, refuses ``-fopenmp``
    when ``openmp`` is False, linking libmvec when ``mvec`` is False, and clang's
    ``-ffp-contract=fast-honor-pragmas`` when ``clang`` is False (as GCC does)."""

    def __init__(self, openmp: bool, mvec: bool, clang: bool = False) -> None:
        self.openmp, self.mvec, self.clang = openmp, mvec, clang
        self.asked: list[str] = []

    def compile(self, sources: list[str], **kw: Any) -> list[str]:
        self.asked.append("compile")
        if not self.openmp and "-fopenmp" in kw.get("extra_postargs", []):
            raise OSError("unrecognized command-line option '-fopenmp'")
        if not self.clang and HONOUR in kw.get("extra_postargs", []):
            raise OSError("unknown floating point contraction style 'fast-honor-pragmas'")
        return ["probe.o"]

    def link_executable(self, objects: list[str], name: str, **kw: Any) -> None:
        self.asked.append("link")
        if not self.mvec and "mvec" in kw.get("libraries", []):
            raise OSError("cannot find -lmvec")


@pytest.mark.parametrize("clang", [False, True], ids=["gcc", "clang"])
@pytest.mark.parametrize("mvec", [True, False], ids=["with-mvec", "without-mvec"])
@pytest.mark.parametrize("openmp", [True, False], ids=["with-openmp", "without-openmp"])
def test_setup_drops_only_what_the_toolchain_refuses(openmp: bool, mvec: bool, clang: bool) -> None:
    """OpenMP where ``-fopenmp`` does not compile or link; libmvec where it does not link
    (aarch64 before glibc 2.38 has none): the extension still builds, nothing else is
    dropped. clang's pragma-honouring contraction flag is added where the compiler takes it
    (csrc/levels.h), and only there."""
    seen = setup_arguments()
    (ext,) = seen["ext_modules"]
    assert "-fopenmp" in ext.extra_compile_args and "-fopenmp" in ext.extra_link_args
    assert "mvec" in ext.libraries
    before = (list(ext.extra_compile_args), list(ext.extra_link_args), list(ext.libraries))
    cmd = seen["cmdclass"]["build_ext"](Distribution({"ext_modules": [ext]}))
    cmd.extensions, cmd.compiler = [ext], _Compiler(openmp, mvec, clang)
    parent = type(cmd).__mro__[1]
    with mock.patch.object(parent, "build_extensions", lambda self: None):
        cmd.build_extensions()
    added = [HONOUR] if clang else []
    if openmp:
        assert (ext.extra_compile_args, ext.extra_link_args) == (before[0] + added, before[1])
    else:
        assert ext.extra_compile_args == [a for a in before[0] if a != "-fopenmp"] + added
        assert ext.extra_link_args == [a for a in before[1] if a != "-fopenmp"]
        assert "-O3" in ext.extra_compile_args  # nothing else dropped
    assert ext.libraries == (before[2] if mvec else [lib for lib in before[2] if lib != "mvec"])
    assert "m" in ext.libraries
    # each probe links only where it compiled; the libmvec probe always compiles
    assert cmd.compiler.asked == (
        (["compile", "link"] if openmp else ["compile"])
        + ["compile", "link"]
        + (["compile", "link"] if clang else ["compile"])
    )
