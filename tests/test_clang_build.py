"""The compiled library built by clang, and built for aarch64: issue 25's "every CPU", for
the compilers and targets CI's GCC on x86-64 never sees.

``pip install`` compiles csrc/ with whatever ``CC`` names: clang on macOS, often on Linux.
The exact sections of the small ops (csrc/levels.h, ``EXACT_FP_BEGIN``) keep -ffast-math
out with one pragma per compiler; GCC's alone was there once, clang skipped it, and its
add_rms_norm differed from torch in the last bit. Here zig's clang (the ``ziglang`` wheel
of the test extra: a C compiler pip installs) builds the whole library through setup.py's
own build command, fallbacks included (zig ships neither OpenMP nor libmvec, so the build
drops both, as on a Mac), and the bitwise checks of tests/test_fused_ops.py and
tests/test_sample_ops.py and the decode kernel's reference run on that build. A mutant with
GCC's pragma alone must fail them.

The same compiler cross-builds the library for aarch64 (the portable copies alone,
csrc/isa.h): it must compile, link, and export its three modules. Running that build needs
an aarch64 machine or an emulator, which CI has neither of (docs/verification.md has a run
under qemu).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import stat
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch

from paged_engine.kernels import fused_ops_cpu, sample_ops_cpu
from paged_engine.kernels.cpu_library import CompiledModule
from paged_engine.kernels.paged_decode_cpu import paged_decode_attention_cpu
from tests.kernel_cases import (
    DECODE_CASES,
    Case,
    assert_close,
    cpu_id,
    make_tensors,
    ref_decode,
    run_decode,
)
from tests.kernel_mutants import build_extension, decode_module_bound, extension_in
from tests.patch_mutants import ROOT, import_copy, patched_copy, read_patch
from tests.test_cpu_kernel_bf16 import assert_one_rounding, bf16, launch
from tests.test_fused_ops import CHECKS
from tests.test_sample_ops import check_cases, check_pass

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ziglang") is None or not sys.platform.startswith("linux"),
    reason="zig's clang (the ziglang wheel, in the test extra) on Linux builds these",
)

MODULES = ("_cpu_kernels", "_fused_ops", "_sample_ops")
"""The library's modules (PEP 489: one shared library, three init functions)."""
PATCH_DIR = ROOT / "tests" / "clang_mutants"
EM_AARCH64 = 183


def zig_cc(into: Path, target: str | None) -> str:
    """A one-line compiler driver for setuptools' ``CC``: zig's clang for ``target`` (None:
    this machine)."""
    script = into / f"zig-cc-{target or 'native'}"
    args = f"-target {target} " if target else ""
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang cc {args}"$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@functools.cache
def clang_library(name: str, target: str | None = None, patch: str | None = None) -> Path:
    """csrc/ (``patch`` from tests/clang_mutants applied) built by zig's clang for
    ``target`` through setup.py's build command and flags; the library's path."""
    patch_file = read_patch(name, PATCH_DIR / f"{patch}.patch") if patch else None
    work = patched_copy(name, patch_file, ("csrc",))
    ext = extension_in(work)
    cc = zig_cc(work, target)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", cc)
        mp.setenv("LDSHARED", f"{cc} -shared")
        return build_extension(name, ext, work)


@functools.cache
def loaded(name: str, library: Path) -> dict[str, CompiledModule]:
    return {m: CompiledModule.of(import_copy(f"_clang_{name}.{m}", library)) for m in MODULES}


@contextmanager
def bound(modules: dict[str, CompiledModule]) -> Iterator[None]:
    """The clang build's modules in the launchers of the kernels inside the block."""
    with decode_module_bound(modules["_cpu_kernels"].module), pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_ops_cpu, "_COMPILED", modules["_fused_ops"])
        mp.setattr(sample_ops_cpu, "_COMPILED", modules["_sample_ops"])
        yield


@pytest.fixture
def clang() -> Iterator[dict[str, CompiledModule]]:
    """The clang build (built once), bound in the launchers for the test."""
    modules = loaded("clang", clang_library("clang"))
    with bound(modules):
        yield modules


def test_the_clang_build_has_the_portable_copies_alone(clang: dict[str, CompiledModule]) -> None:
    # csrc/isa.h: the x86-64-v3/v4 copies and the AVX512-BF16 variant are GCC's alone.
    decode: ModuleType = clang["_cpu_kernels"].module
    assert tuple(decode.isa_levels()) == ("baseline",)
    assert tuple(decode.bf16_variants()) == ("portable",)
    for m in ("_fused_ops", "_sample_ops"):
        assert tuple(clang[m].module.isa_levels()) == ("baseline",), m


@pytest.mark.parametrize("op", sorted(CHECKS))
def test_the_fused_ops_are_torchs_bits(op: str, clang: dict[str, CompiledModule]) -> None:
    CHECKS[op]()


def test_the_sampler_pass_agrees_with_its_reference(clang: dict[str, CompiledModule]) -> None:
    check_cases("baseline")  # ties, NaNs and infinities: no finite-math-only here
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        check_pass((torch.randn(5, 3000, generator=gen) * 4).to(dtype), "baseline")


@pytest.mark.parametrize("case", DECODE_CASES, ids=cpu_id)
def test_the_decode_kernel_agrees_with_its_reference(
    case: Case, clang: dict[str, CompiledModule]
) -> None:
    t = make_tensors(case, torch.device("cpu"))
    assert_close(run_decode(t, paged_decode_attention_cpu), ref_decode(t))
    b = bf16(case)
    assert_one_rounding(launch(b, "portable"), b)


def test_gccs_pragma_alone_leaves_clangs_norm_off_torchs_bits() -> None:
    """The mutant: csrc/levels.h's clang branch emptied. The norm's check must fail."""
    modules = loaded("gcc_pragma_only", clang_library("gcc_pragma_only", patch="gcc_pragma_only"))
    CHECKS["norm"]()  # GCC's build passes
    with bound(modules), pytest.raises(AssertionError, match="norm differs"):
        CHECKS["norm"]()


def dynamic_symbols(path: Path) -> tuple[int, set[str]]:
    """An ELF64 little-endian library's machine and the names its dynamic symbol table
    defines (the symbols a loader resolves: the modules' init functions)."""
    data = path.read_bytes()
    assert data[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    machine = struct.unpack_from("<H", data, 18)[0]
    shoff, shentsize, shnum = (
        struct.unpack_from("<Q", data, 40)[0],
        *struct.unpack_from("<HH", data, 58),
    )
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    names: set[str] = set()
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strtab = sections[link][4]
        for at in range(off, off + size, entsize):
            name, _, _, shndx = struct.unpack_from("<IBBH", data, at)
            if shndx != 0:  # defined here
                end = data.index(b"\0", strtab + name)
                names.add(data[strtab + name : end].decode())
    return machine, names


def test_the_library_cross_builds_for_aarch64() -> None:
    library = clang_library("aarch64", target="aarch64-linux-gnu")
    machine, names = dynamic_symbols(library)
    assert machine == EM_AARCH64
    assert {f"PyInit_{m}" for m in MODULES} <= names, sorted(names)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads an x86-64 build")
def test_the_symbol_reader_reads_this_machines_build() -> None:
    # The reader's control: on the library this interpreter loaded, x86-64 (62), not 183.
    assert fused_ops_cpu._COMPILED is not None, fused_ops_cpu.fused_ops_problem()
    machine, names = dynamic_symbols(Path(fused_ops_cpu._COMPILED.module.__file__))
    assert machine == 62
    assert {f"PyInit_{m}" for m in MODULES} <= names
