"""Deliberately broken attention kernels, each named after the bug it plants.

The product carries no switch for any of them. Each mutant is the real kernel's source with
one textual patch, built here:

* Triton kernels: the kernel function's source (``inspect.getsource``) with the patch
  applied, executed in a copy of its module's namespace under ``@triton.jit`` (compiled,
  or interpreted under ``TRITON_INTERPRET=1``, like the real one). ``KernelMutant.active``
  puts it in place of the real kernel in its module for the duration of a block, so the
  real launchers (and the backends built on them) run it with their real host code;
* the compiled CPU decode kernel: a copy of ``csrc/`` with one file patched (by default the
  kernel template ``paged_decode_head.h``, so every variant carries the bug), compiled in
  a temporary directory with exactly the ``Extension`` that ``setup.py`` declares (its
  ``setup()`` call is intercepted to read it), loaded as a separate module and swapped for
  the real one the same way;
* cascade decode attention: a rewrite of the step's ``CascadePlan``.

tests/test_kernels_prefill.py and tests/test_cpu_kernel.py require every mutant to disagree with its
``*_ref`` on some layout (proof that the layouts the tests draw can catch that class of
bug); tests/test_attention_machine.py shows the oracle machine catching each of them.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import linecache
import runpy
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch

from paged_engine.kernels import paged_decode_attention as decode_module
from paged_engine.kernels import paged_decode_cpu
from paged_engine.kernels import paged_prefill_attention as prefill_module
from paged_engine.kernels.paged_decode_attention import paged_decode_attention
from paged_engine.kernels.paged_decode_cpu import paged_decode_attention_cpu
from paged_engine.kernels.paged_prefill_attention import paged_prefill_attention
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.layers.attention.torch_backend import TorchAttentionBackend
from paged_engine.layers.cascade import CascadePlan

ROOT = Path(__file__).resolve().parent.parent
Patch = tuple[str, str]
"""``(old, new)``: ``old`` must occur exactly once in the source."""


def apply_patches(source: str, patches: tuple[Patch, ...], what: str) -> str:
    for old, new in patches:
        count = source.count(old)
        if count != 1:
            raise AssertionError(f"{what}: patch target found {count} times: {old!r}")
        source = source.replace(old, new)
    return source


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

_MODULES: dict[str, ModuleType] = {"decode": decode_module, "prefill": prefill_module}
_KERNELS = {"decode": "_decode_kernel", "prefill": "_prefill_kernel"}
_LAUNCHERS = {"decode": paged_decode_attention, "prefill": paged_prefill_attention}


@functools.cache
def _build_kernel(kind: str, name: str, patches: tuple[Patch, ...]) -> Any:
    module = _MODULES[kind]
    real = getattr(module, _KERNELS[kind])
    source = apply_patches(inspect.getsource(real.fn), patches, name)
    # Triton reads the kernel's source back through inspect (linecache): register it.
    filename = f"<kernel mutant {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(vars(module))
    exec(compile(source, filename, "exec"), namespace)
    return namespace[_KERNELS[kind]]


@dataclass(frozen=True)
class KernelMutant:
    """A patched copy of the ``kind`` (``"decode"`` or ``"prefill"``) Triton kernel."""

    name: str
    kind: str
    patches: tuple[Patch, ...]
    bug: str

    def kernel(self) -> Any:
        return _build_kernel(self.kind, self.name, self.patches)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The mutant replaces the real kernel in its module inside the block."""
        module, attr = _MODULES[self.kind], _KERNELS[self.kind]
        real, mutant = getattr(module, attr), self.kernel()
        setattr(module, attr, mutant)
        try:
            yield
        finally:
            setattr(module, attr, real)

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The real launcher of ``kind``, same arguments, running the mutant kernel."""
        with self.active():
            return _LAUNCHERS[self.kind](*args, **kwargs)


_DECODE_FLOOR = (
    "    start = split * partition_size\n",
    "    context_len = (context_len // BLOCK_SIZE) * BLOCK_SIZE\n"
    "    start = split * partition_size\n",
)
_PREFILL_FLOOR = (
    "    prefix_len = context_len - q_len\n",
    "    prefix_len = context_len - q_len\n"
    "    context_len = (context_len // BLOCK_SIZE) * BLOCK_SIZE\n",
)

MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        name="decode_block_walk_off_by_one",
        kind="decode",
        patches=(_DECODE_FLOOR,),
        bug="walks seq_len // block_size blocks instead of cdiv: drops a partial last block",
    ),
    KernelMutant(
        name="prefill_missing_causal_mask",
        kind="prefill",
        patches=(
            (
                "kv_end = tl.minimum(prefix_len + tl.minimum(tile_start + BLOCK_M, q_len), "
                "context_len)",
                "kv_end = context_len",
            ),
            (
                "visible = n_mask[None, :] & (offs_n[None, :] <= position[:, None])",
                "visible = n_mask[None, :]",
            ),
        ),
        bug="new tokens attend to the whole context, including later new tokens",
    ),
    KernelMutant(
        name="decode_gqa_wrong_kv_head",
        kind="decode",
        patches=(("heads = kv_head * GROUP + offs_g", "heads = offs_g * NUM_KV_HEADS + kv_head"),),
        bug="query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)

PREFILL_MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        name="prefill_block_walk_off_by_one",
        kind="prefill",
        patches=(_PREFILL_FLOOR,),
        bug="reads seq_len // block_size whole blocks: drops a partial last block",
    ),
    KernelMutant(
        name="prefill_gqa_wrong_kv_head",
        kind="prefill",
        patches=(("heads = kv_head * GROUP + g", "heads = g * NUM_KV_HEADS + kv_head"),),
        bug="query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)
"""The same bug classes planted in the prefill kernel (the attention machine must catch
them; the hand-picked layouts of tests/kernel_cases.py only the first tuple's)."""


# --------------------------------------------------------------------------------------------
# Cascade (shared-prefix) decode attention in the torch backend: bugs planted in the step's
# plan, so the real ``cascade_decode`` runs on them (again no second copy of the maths).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CascadeMutant:
    """A broken ``CascadePlan``: ``mutate`` turns the real plan into the buggy one."""

    name: str
    mutate: Callable[[CascadePlan], CascadePlan]
    bug: str


def _swap_members(plan: CascadePlan) -> CascadePlan:
    return replace(plan, member_slots=plan.member_slots.flip(0))


def _unmask_rest(plan: CascadePlan) -> CascadePlan:
    return replace(plan, rest_mask=torch.zeros_like(plan.rest_mask))


def _drop_first_rest(plan: CascadePlan) -> CascadePlan:
    # Each sequence's first non-shared position is masked out, as if the split were made
    # one token too late.
    mask = plan.rest_mask.clone()
    mask[..., 0] = float("-inf")
    last_real = (plan.rest_mask == 0).sum(-1).squeeze(-1) == 1
    mask[last_real, :, 0] = 0  # a one-token rest keeps its token (no all-masked row)
    return replace(plan, rest_mask=mask)


CASCADE_MUTANTS: tuple[CascadeMutant, ...] = (
    CascadeMutant(
        "cascade_members_swapped",
        _swap_members,
        "members' rows are paired with another member's prefix attention in the merge",
    ),
    CascadeMutant(
        "cascade_rest_padding_unmasked",
        _unmask_rest,
        "the padding of shorter rests (copies of their first position) is attended",
    ),
    CascadeMutant(
        "cascade_rest_first_position_dropped",
        _drop_first_rest,
        "the first position after the shared prefix is in neither part",
    ),
)


class CascadeMutantBackend(TorchAttentionBackend):
    """The torch backend, cascading every shared prefix, with ``mutant``'s plan bug."""

    def __init__(self, mutant: CascadeMutant, block_size: int, dtype: torch.dtype) -> None:
        super().__init__(block_size, dtype, shared_prefix_min_tokens=0)
        self.mutant = mutant

    def _decode_plan(  # type: ignore[no-untyped-def]
        self, meta, block_size, dtype, num_kv_heads
    ):
        plan = super()._decode_plan(meta, block_size, dtype, num_kv_heads)
        return self.mutant.mutate(plan) if isinstance(plan, CascadePlan) else plan


# --------------------------------------------------------------------------------------------
# The compiled CPU decode kernel (csrc/paged_decode_cpu.c): the same bug classes, each in a
# patched copy of the C file compiled for the tests alone.
# --------------------------------------------------------------------------------------------

C_SOURCES = ROOT / "csrc"


def setup_extension() -> Any:
    """The ``Extension`` that setup.py declares, read by running setup.py with its
    ``setup()`` call intercepted (nothing is built or installed)."""
    seen: dict[str, Any] = {}
    with mock.patch("setuptools.setup", lambda **kw: seen.update(kw)):
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    (ext,) = seen["ext_modules"]
    return ext


@functools.cache
def build_c_mutant(
    name: str, file: str, patches: tuple[Patch, ...], extra_args: tuple[str, ...] = ()
) -> ModuleType:
    """Copy ``csrc/`` into a temporary directory, apply ``patches`` to ``file`` there,
    compile it with setup.py's sources and flags (then ``extra_args``), and load it as a
    module of its own."""
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    work = Path(tempfile.mkdtemp(prefix=f"paged-engine-{name}-"))
    csrc = work / "csrc"
    shutil.copytree(C_SOURCES, csrc)
    target = csrc / file
    target.write_text(apply_patches(target.read_text(), patches, name))
    ext = replace_extension(setup_extension(), csrc)
    # The library's other module (fused small ops, tests/fused_mutants.py builds its own
    # mutants) is most of a build's time and is never loaded from a decode mutant.
    ext.sources = [s for s in ext.sources if Path(s).name != "fused_ops.c"]
    ext.extra_compile_args += list(extra_args)
    cmd = build_ext(Distribution({"name": f"mutant-{name}", "ext_modules": [ext]}))
    cmd.build_lib, cmd.build_temp = str(work / "lib"), str(work / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    path = cmd.get_ext_fullpath(ext.name)
    # The init symbol is PyInit__cpu_kernels: keep that last component in the module name.
    spec = importlib.util.spec_from_file_location(f"_mutant_{name}._cpu_kernels", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replace_extension(ext: Any, csrc: Path) -> Any:
    """A copy of setup.py's ``Extension`` compiling the sources in ``csrc`` instead (each
    ``csrc/...`` path moved there), optional no more (a mutant that fails to build must
    fail the test)."""
    from setuptools import Extension

    def moved(path: str) -> str:
        return str(csrc / Path(path).relative_to("csrc"))

    return Extension(
        ext.name,
        sources=[moved(s) for s in ext.sources],
        depends=[moved(d) for d in ext.depends],
        include_dirs=[moved(d) if d.startswith("csrc") else d for d in ext.include_dirs],
        extra_compile_args=list(ext.extra_compile_args),
        extra_link_args=list(ext.extra_link_args),
        libraries=list(ext.libraries),
        define_macros=list(ext.define_macros),
    )


@dataclass(frozen=True)
class CpuKernelMutant:
    """A patched copy of the CPU decode kernel (``file`` in csrc/), run by the real
    launcher. Patches to the template, paged_decode_head.h, reach every variant."""

    name: str
    patches: tuple[Patch, ...]
    bug: str
    kind: str = "decode"
    file: str = "paged_decode_head.h"

    @contextmanager
    def active(self) -> Iterator[None]:
        module = build_c_mutant(self.name, self.file, self.patches)
        with mock.patch.object(paged_decode_cpu, "_MODULE", module):
            yield

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.active():
            return paged_decode_attention_cpu(*args, **kwargs)


def _in_bf16(expr: str) -> str:
    """``expr`` rounded to the element type and back: bfloat16 rounding in the bfloat16
    variants, nothing in the float32 one (the same macros the kernel converts with)."""
    return f"DH_TO_F32(DH_FROM_F32({expr}))"


CPU_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        name="cpu_decode_block_walk_floor",
        patches=(
            (
                "a->table_width;\n    const int len = a->lens[b];\n",
                "a->table_width;\n    const int len = a->lens[b] / BS * BS;\n",
            ),
        ),
        bug="reads seq_len // block_size whole blocks: drops a partial last block",
    ),
    CpuKernelMutant(
        name="cpu_decode_gqa_wrong_kv_head",
        patches=(("head[i] = kh * G + i;", "head[i] = kh + i * a->kv_heads;"),),
        bug="query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)

BF16_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        name="cpu_decode_bf16_accumulator",
        patches=(
            (
                "acc[i][x] += p * DH_TO_F32(vr[x]);",
                "acc[i][x] = " + _in_bf16("acc[i][x] + p * DH_TO_F32(vr[x])") + ";",
            ),
        ),
        bug="the P @ V accumulator is kept in bfloat16 (rounded after every token)",
    ),
    CpuKernelMutant(
        name="cpu_decode_bf16_softmax",
        patches=(
            (
                "s[i][t] = expf(s[i][t] - top);",
                "s[i][t] = " + _in_bf16("expf(s[i][t] - top)") + ";",
            ),
            ("l[i] = l[i] * rescale + sum;", "l[i] = " + _in_bf16("l[i] * rescale + sum") + ";"),
        ),
        bug="the softmax's exponentials and running sum are bfloat16",
    ),
)
"""Precision bugs: identical to the real kernel in float32, wrong only in bfloat16."""


class CpuMutantBackend(CpuAttentionBackend):
    """The CPU backend with ``mutant``'s decode kernel (its ``bf16_variant`` in bfloat16)."""

    def __init__(
        self,
        mutant: CpuKernelMutant,
        block_size: int,
        dtype: torch.dtype,
        *,
        bf16_variant: str = "auto",
    ) -> None:
        super().__init__(block_size, dtype, bf16_variant=bf16_variant)
        self._decode = functools.partial(mutant.launch, bf16_variant=bf16_variant)
