"""Deliberately broken attention kernels, each named after the bug it plants.

The product carries no switch for any of them. Each kernel mutant is a patch file,
``tests/kernel_mutants/<name>.patch`` (a unified diff against the repository's source), that
is applied to a temporary copy of the source only when the mutant is first used: in its own
test, never at import. So an edit of the product can make a mutant stale, but then only that
mutant's tests fail, with ``StaleMutant`` naming it, the file and the hunk that no longer
applies; the test files still collect. tests/patch_mutants.py applies the patches and says
how to write or refresh one.

* Triton kernels: the patched copy of the kernel's module is imported as a module of its
  own (compiled, or interpreted under ``TRITON_INTERPRET=1``, like the real one) and its
  kernel put in place of the real one in the launcher's module for the duration of a block
  (``KernelMutant.active``), so the real launchers and backends run it with their host code;
* the compiled CPU decode kernel: a copy of ``csrc/`` with the patch applied, compiled in a
  temporary directory with exactly the ``Extension`` that ``setup.py`` declares (its
  ``setup()`` call is intercepted to read it), loaded as a module of its own and bound in the
  launcher (``paged_decode_cpu._COMPILED``) for the block.

tests/test_kernels_prefill.py and tests/test_cpu_kernel.py require every mutant to disagree
with its ``*_ref`` on some layout (proof that the layouts the tests draw can catch that class
of bug); tests/test_attention_machine.py shows the oracle machine catching each of them
(and tests/cascade_mutants.py's broken cascade plans); tests/fused_mutants.py does the
same for the fused small ops.
"""

from __future__ import annotations

import functools
import runpy
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
import torch

from paged_engine.kernels import paged_decode_attention as decode_module
from paged_engine.kernels import paged_decode_cpu, store_kv_cpu
from paged_engine.kernels import paged_prefill_attention as prefill_module
from paged_engine.kernels.cpu_library import CompiledModule
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from tests.patch_mutants import ROOT, StaleMutant, import_copy, patched_copy, read_patch

PATCH_DIR = ROOT / "tests" / "kernel_mutants"
"""One ``<name>.patch`` per mutant below (tests/test_cpu_kernel.py checks both ways)."""


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

_LAUNCHERS: dict[str, tuple[ModuleType, str]] = {
    "decode": (decode_module, "decode_kernel"),
    "prefill": (prefill_module, "prefill_kernel"),
}
"""Per kind: the launcher's module and the name its launches read the kernel by."""


@functools.cache
def _build_kernel(kind: str, name: str) -> Any:
    """The ``kind`` kernel of the patched copy of its module, imported on its own."""
    patch = read_patch(name, PATCH_DIR / f"{name}.patch")
    path = patch.one_file()
    # triton.jit reads the kernel's source from the copy
    module = import_copy(f"_kernel_mutant_{name}", patched_copy(name, patch) / path)
    launcher, attr = _LAUNCHERS[kind]
    kernel = getattr(module, attr, None)
    if kernel is None or kernel is getattr(launcher, attr):
        raise StaleMutant(name, path, None, f"defines no {kind} kernel {attr}")
    return kernel


@dataclass(frozen=True)
class KernelMutant:
    """A patched copy of the ``kind`` (``"decode"`` or ``"prefill"``) Triton kernel."""

    name: str
    kind: str
    bug: str

    def kernel(self) -> Any:
        return _build_kernel(self.kind, self.name)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The mutant replaces the real kernel in its launcher's module inside the block."""
        launcher, attr = _LAUNCHERS[self.kind]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(launcher, attr, self.kernel())
            yield

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The real launcher of ``kind``, same arguments, running the mutant kernel."""
        real = {
            "decode": decode_module.paged_decode_attention,
            "prefill": prefill_module.paged_prefill_attention,
        }[self.kind]
        with self.active():
            return real(*args, **kwargs)


MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        "decode_block_walk_off_by_one",
        "decode",
        "walks seq_len // block_size blocks instead of cdiv: drops a partial last block",
    ),
    KernelMutant(
        "prefill_missing_causal_mask",
        "prefill",
        "new tokens attend to the whole context, including later new tokens",
    ),
    KernelMutant(
        "decode_gqa_wrong_kv_head",
        "decode",
        "query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)

PREFILL_MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        "prefill_block_walk_off_by_one",
        "prefill",
        "reads seq_len // block_size whole blocks: drops a partial last block",
    ),
    KernelMutant(
        "prefill_gqa_wrong_kv_head",
        "prefill",
        "query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)
"""The same bug classes planted in the prefill kernel (the attention machine must catch
them; the hand-picked layouts of tests/kernel_cases.py only the first tuple's)."""

COMPILE_MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        "decode_cache_offsets_int32",
        "decode",
        "the block id stays int32: the K/V cache offsets are 32-bit and wrap past 2**31",
    ),
    KernelMutant("decode_dot_tf32", "decode", "the float32 Q.K dot runs in TF32"),
)
"""Bugs that only scripts/compile_kernels.py's offline checks can see (tests/
test_compile_kernels.py): the interpreter computes them right."""

# --------------------------------------------------------------------------------------------
# The compiled CPU decode kernel (csrc/): the same bug classes, and the threads' driver
# --------------------------------------------------------------------------------------------


def setup_arguments() -> dict[str, Any]:
    """What setup.py passes to ``setup()`` (its ``Extension``, its build command), read by
    running setup.py with that call intercepted (nothing is built or installed). Fresh on
    every call: a build command changes the ``Extension`` it is given."""
    seen: dict[str, Any] = {}
    with mock.patch("setuptools.setup", lambda **kw: seen.update(kw)):
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return seen


def setup_extension() -> Any:
    """The ``Extension`` that setup.py declares."""
    (ext,) = setup_arguments()["ext_modules"]
    return ext


def build_extension(name: str, ext: Any, work: Path) -> Path:
    """``ext`` (a setuptools ``Extension`` of sources under ``work``) compiled in ``work`` by
    setup.py's own build command (which drops what the toolchain lacks: OpenMP, libmvec),
    with the compiler ``CC`` names; the library's path."""
    from setuptools import Distribution

    build_ext = setup_arguments()["cmdclass"]["build_ext"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_ENGINE_CACHE_DIR", str(work / "cache"))  # not the user's cache
        cmd = build_ext(Distribution({"name": f"mutant-{name}", "ext_modules": [ext]}))
        cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "tmp")
        cmd.ensure_finalized()
        cmd.run()
    shutil.rmtree(work / "tmp", ignore_errors=True)
    return Path(cmd.get_ext_fullpath(ext.name))


def compile_extension(name: str, ext: Any, work: Path) -> ModuleType:
    """``ext`` built (``build_extension``) and loaded as a module of its own, named after
    mutant ``name``."""
    library = build_extension(name, ext, work)
    # The init symbol is PyInit_<the extension's last name>: keep it in the module name.
    return import_copy(f"_mutant_{name}.{ext.name.rpartition('.')[2]}", library)


def extension_in(
    work: Path, keep: Callable[[str], bool] = lambda source: True, extra_args: tuple[str, ...] = ()
) -> Any:
    """setup.py's ``Extension`` with its csrc/ paths moved under ``work`` (a copy made by
    ``patched_copy``), the sources ``keep`` takes, and ``extra_args`` after its flags."""
    from setuptools import Extension

    real = setup_extension()

    def moved(path: str) -> str:
        return str(work / path) if path.startswith("csrc") else path

    return Extension(
        real.name,
        sources=[moved(s) for s in real.sources if keep(s)],
        depends=[moved(d) for d in real.depends],
        include_dirs=[moved(d) for d in real.include_dirs],
        extra_compile_args=[*real.extra_compile_args, *extra_args],
        extra_link_args=list(real.extra_link_args),
        libraries=list(real.libraries),
        define_macros=list(real.define_macros),
        # optional no more: a build that fails must fail its test
    )


OTHER_MODULES = ("fused_ops.c", "sample_ops.c")
"""csrc/'s sources of the library's modules other than the decode kernel's."""


@functools.cache
def build_c_module(
    name: str, patch: Path | None = None, extra_args: tuple[str, ...] = ()
) -> ModuleType:
    """Copy ``csrc/`` into a temporary directory, apply ``patch`` there (none: the sources
    as they are), compile the decode kernel's sources with setup.py's flags (then
    ``extra_args``), and load the result as a module of its own."""
    work = patched_copy(name, read_patch(name, patch) if patch is not None else None, ("csrc",))
    # The library's other modules (the fused small ops, most of a build's time, and the
    # sampler's pass: tests/fused_mutants.py builds their mutants) are never loaded from
    # this one.
    ext = extension_in(work, lambda source: Path(source).name not in OTHER_MODULES, extra_args)
    return compile_extension(name, ext, work)


@contextmanager
def decode_module_bound(module: ModuleType) -> Iterator[None]:
    """``module`` (a build of csrc/) bound in the launchers of its kernels inside the block:
    the decode kernel's and the store's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged_decode_cpu, "_COMPILED", CompiledModule.of(module))
        mp.setattr(store_kv_cpu, "_COMPILED", CompiledModule.of(module))
        yield


@dataclass(frozen=True)
class CpuKernelMutant:
    """A patched copy of the CPU decode kernel, run by the real launcher. Patches to the
    template, paged_decode_head.h, reach every variant and level."""

    name: str
    bug: str
    kind: str = "decode"

    def module(self) -> ModuleType:
        return build_c_module(self.name, PATCH_DIR / f"{self.name}.patch")

    @contextmanager
    def active(self) -> Iterator[None]:
        with decode_module_bound(self.module()):
            yield

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.active():
            return paged_decode_cpu.paged_decode_attention_cpu(*args, **kwargs)


CPU_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "cpu_decode_block_walk_floor",
        "reads seq_len // block_size whole blocks: drops a partial last block",
    ),
    CpuKernelMutant(
        "cpu_decode_gqa_wrong_kv_head",
        "query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
    CpuKernelMutant(
        "cpu_decode_run_first_kv_head",
        "an item's run of kv heads scores every head against the run's first kv head's K",
    ),
    CpuKernelMutant(
        "cpu_decode_run_pv_wrong_kv_head",
        "an item's run of kv heads sums each head's P @ V over kv head h % G, not h // G",
    ),
)

BF16_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "cpu_decode_bf16_accumulator",
        "the P @ V accumulator is kept in bfloat16 (rounded after every token)",
    ),
    CpuKernelMutant(
        "cpu_decode_bf16_softmax", "the softmax's exponentials and running sum are bfloat16"
    ),
)
"""Precision bugs: identical to the real kernel in float32, wrong only in bfloat16 (each
rounds through the kernel's own element conversions, the identity in float32)."""

AVX512_BF16_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "cpu_decode_bf16_sum16_order",
        "the AVX512-BF16 copy's batched horizontal sums put each token's score in another "
        "token's place (sum16's transpose not undone)",
    ),
    CpuKernelMutant(
        "cpu_decode_bf16_pv_group_first_head",
        "the AVX512-BF16 copy's grouped P @ V weights every head of a GQA group with the "
        "first head's probabilities",
    ),
)
"""Bugs in the AVX512-BF16 copy's own code: the portable copies are untouched."""

AMX_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "cpu_decode_amx_pair_swap",
        "the AMX copy arranges each query head's elements into B's pairs the wrong way round",
    ),
    CpuKernelMutant(
        "cpu_decode_amx_heads_swapped",
        "for a group of 2 the AMX copy gives each head of a kv head the other's scores",
    ),
)
"""Bugs in the AMX copy's own code (csrc/paged_decode_amx.h): the other variants are
untouched."""

SHARE_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "cpu_decode_share_resume_max",
        "an item resumes after the shared tokens with the running max reset, not the one the "
        "share pass left",
    ),
    CpuKernelMutant(
        "cpu_decode_share_first_member",
        "every virtual head of a share pass scores the query of its group's first member",
    ),
)
"""Bugs in the shared-prefix groups' code (csrc/paged_decode_share.h), in every copy:
tests/test_cpu_kernel_share.py compares each call with groups to the call without."""

STORE_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "cpu_store_kv_drops_last_row",
        "the store's copy loop stops one row early: the step's last token never reaches the pool",
        kind="store",
    ),
)
"""Bugs in the compiled store (csrc/store_kv_cpu.c): tests/test_store_kv_cpu.py compares
it with ``store_kv_ref``, and the attention machine runs it through ``CpuMutantBackend``."""

THREAD_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        "threads_skip_last_item",
        "the threads stop one item early: the last claimed item is never computed",
    ),
    CpuKernelMutant(
        "threads_more_than_items", "a call with fewer items than threads still starts every thread"
    ),
    CpuKernelMutant("threads_ignored", "num_threads is ignored: every call runs on one thread"),
    CpuKernelMutant(
        "order_forgets_index",
        "item_order leaves out each sequence's index (C zero-fills it): every item runs sequence 0",
    ),
)
"""Bugs in the C driver's threads and order (csrc/run_items.c's ``run_items``), caught by
tests/test_cpu_kernel_threads.py's checks (tests/test_cpu_kernel_threads_build.py)."""


class CpuMutantBackend(CpuAttentionBackend):
    """The CPU backend, its decode steps (its ``bf16_variant`` in bfloat16) and its store on
    ``mutant``'s build, through the backend's own per-step checks and launches."""

    def __init__(
        self,
        mutant: CpuKernelMutant,
        block_size: int,
        dtype: torch.dtype,
        *,
        bf16_variant: str = "auto",
    ) -> None:
        super().__init__(block_size, dtype, bf16_variant=bf16_variant)
        self.mutant = mutant

    def attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.mutant.active():
            return super().attend(*args, **kwargs)

    def store_kv(self, *args: Any, **kwargs: Any) -> None:
        with self.mutant.active():
            super().store_kv(*args, **kwargs)
