"""Launcher for the compiled CPU paged-decode kernel (``csrc/paged_decode_cpu.c``).

The kernel reads raw addresses, so everything it could misread is checked here first:
shapes, dtypes (float32, or bfloat16 for q, caches and out alike), devices (CPU only),
strides; and in C, before any read, every block id a context touches (an exception, never a
stray read). The readable reference is ``paged_decode_attention.paged_decode_attention_ref``
(same maths, plain float32 torch); ``paged_decode_cpu_ref`` restates the kernel's own
algorithm (block walk, online softmax) in torch; the tests hold the three together.

The checks are split from the launch (``check_paged_decode_cpu`` returns a
``DecodeLaunch``, ``run_paged_decode_cpu`` runs one): a model calls the kernel once per
layer with the same shapes, and the "cpu" backend checks once per step.

bfloat16 has two compiled variants: ``"avx512bf16"`` (AVX512-BF16 dot products) and
``"portable"`` (plain C, widened to float32); ``"auto"`` takes the AVX512 one when
``bf16_variants()`` has it and ``head_dim >= 32`` (below, a 512-bit dot is mostly masked
off and the portable AVX2 copy measured faster). Both keep every product, the softmax and
the accumulator in float32, and round once, to the output.

Instruction-set levels (csrc/isa.h): the float32 kernel and the portable bfloat16 one are
compiled once per level, the baseline everywhere and x86-64-v3/v4 on x86-64 (portable
bfloat16 stops at v3). ``isa_levels()`` is what the module has, this CPU runs (the
module's own CPUID check) and the platform layer finds the CPU's flags for
(``platform.CpuInfo.isa_levels``); "auto" takes the best. Every choice of level and
variant is made here, from the platform layer, per launch check; the C entry points only
refuse one they cannot run.

Threads: a call's (sequence, KV head) items run on up to ``DecodeLaunch.num_threads``
threads (OpenMP, torch's own runtime; ``torch.get_num_threads()`` when the launch is
checked, so once per step in the "cpu" backend), claimed one at a time, longest context
first, so a thread that loses its core holds back one item only. Each item is computed by
one thread in a fixed order: the output is the same bits at any count. 1 (the default on
2-core machines, see ``EngineConfig.num_threads``) runs no parallel region;
``cpu_kernels_threaded()`` says whether the build has OpenMP at all.

The extension is optional (``setup.py``): ``cpu_kernels_problem()`` says why it is missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from paged_engine import platform
from paged_engine.kernels.checks import check_int_vector, check_query_and_tables

__all__ = [
    "BF16_VARIANTS",
    "DTYPES",
    "ISA_CODES",
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "DecodeLaunch",
    "auto_cpu_dtype",
    "bf16_variants",
    "check_paged_decode_cpu",
    "cpu_bf16_features",
    "cpu_kernels_problem",
    "cpu_kernels_threaded",
    "geometry_problem",
    "isa_levels",
    "kernel_threads",
    "paged_decode_attention_cpu",
    "run_paged_decode_cpu",
]

MAX_GROUP = 16
"""Most query heads per KV head the kernel takes (its per-head state lives on the stack)."""
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
"""The head dims the launchers' shared checks accept (``checks.check_query_and_tables``)."""
DTYPES = (torch.float32, torch.bfloat16)
BF16_VARIANTS = {"auto": 0, "portable": 1, "avx512bf16": 2}
"""The names of the bfloat16 variants, with the code the C entry point takes."""


ISA_CODES = {"baseline": 0, "x86-64-v3": 1, "x86-64-v4": 2}
"""The instruction-set levels the kernels are compiled at (csrc/isa.h), with their codes."""
AVX512_MIN_HEAD_DIM = 32
""""auto" takes the avx512bf16 variant from this head dim up (see the module docstring)."""


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module("paged_engine._cpu_kernels")
    except ImportError as exc:
        return None, (
            f"the compiled CPU kernels are not built ({exc}); reinstall paged_engine on a "
            "machine with a C compiler"
        )
    if not hasattr(module, "isa_levels"):
        return None, "the compiled CPU kernels predate the instruction-set levels; rebuild them"
    return module, None


_MODULE, _PROBLEM = _load()


def cpu_kernels_problem() -> str | None:
    """Why the compiled CPU kernels cannot be used, or None when they can."""
    return _PROBLEM


def cpu_kernels_threaded() -> bool:
    """Whether the built module runs a call's work items on several threads (it was built
    with OpenMP: setup.py drops ``-fopenmp`` where the toolchain lacks it); False without
    the module."""
    return _MODULE is not None and bool(_MODULE.threaded())


def bf16_variants() -> tuple[str, ...]:
    """The bfloat16 variants that run here, best first: those the built module has and
    this CPU executes (its own check) that the platform layer also finds the CPU's flags
    for (``platform.DECODE_AVX512_BF16_FLAGS``); empty without the module."""
    module = _MODULE  # read per call: the tests swap in mutants
    if module is None:
        return ()
    cpu = platform.cpu_info()
    return tuple(
        v
        for v in module.bf16_variants()
        if v != "avx512bf16" or cpu.has(platform.DECODE_AVX512_BF16_FLAGS)
    )


def isa_levels() -> tuple[str, ...]:
    """The instruction-set levels (``ISA_CODES``' names) the kernel runs at here, best
    first: those the built module has and this CPU executes (its own check) that the
    platform layer also finds the CPU's flags for (``platform.CpuInfo.isa_levels``); "auto"
    takes the first. Always ends in "baseline"; empty without the module."""
    module = _MODULE  # read per call: the tests swap in mutants
    return () if module is None else _levels(module, platform.cpu_info().isa_levels)


@cache
def _levels(module: ModuleType, runs: tuple[str, ...]) -> tuple[str, ...]:
    """What ``isa_levels`` says for ``module`` and the platform's ``runs``: both fixed
    for a process, so asked of the module once (launch checks ask once per step)."""
    return tuple(level for level in module.isa_levels() if level in runs)


def cpu_bf16_features() -> tuple[str, ...]:
    """The bfloat16 matrix instructions this CPU has (``platform.BF16_MATRIX_FLAGS``):
    what makes torch's bfloat16 matmuls (oneDNN) fast, and this kernel's AVX512 variant."""
    return platform.cpu_info().bf16_features


def auto_cpu_dtype(
    checkpoint_dtype: torch.dtype | None, features: tuple[str, ...]
) -> tuple[torch.dtype, str]:
    """``dtype="auto"`` on the CPU, and why: bfloat16 for a 16-bit checkpoint on a CPU with
    AMX-BF16 or AVX512-BF16 (float16 has no fast CPU path: it is served as bfloat16, as
    vLLM's CPU build does); else float32. A float32 checkpoint stays float32 (exact, and
    what the token-identity tests' models are), and without those instructions bfloat16
    runs slower than float32 (software conversion around float32 arithmetic)."""
    if checkpoint_dtype not in (torch.float16, torch.bfloat16):
        stated = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else None
        return torch.float32, f"the checkpoint is {stated or 'float32 (unstated)'}"
    if not features:
        return torch.float32, "this CPU has neither AMX-BF16 nor AVX512-BF16"
    stated = str(checkpoint_dtype).removeprefix("torch.")
    return torch.bfloat16, f"the checkpoint is {stated} and this CPU has {', '.join(features)}"


def geometry_problem(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> str | None:
    """Why the kernel cannot take this head layout and dtype, or None when it can: the
    launcher raises it, the "cpu" backend routes such steps to torch instead."""
    if dtype not in DTYPES:
        return f"only float32 and bfloat16 are supported, got {dtype}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per KV head, got {num_heads // num_kv_heads}"
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
    return None


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """What ``check_paged_decode_cpu`` derived: valid for any call whose tensors have the
    same shapes, strides, dtypes and device as the checked ones."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    table_width: int
    num_blocks: int
    bf16_variant: int | None
    """The C variant code for bfloat16 (``BF16_VARIANTS``), None for float32."""
    num_threads: int = 1
    """The most threads a call may use over its (sequence, KV head) items: 1 runs no
    parallel region at all; fewer are used when there are fewer items."""
    isa: int = 0
    """The instruction-set level's code (``ISA_CODES``) of the copy that runs."""


def check_paged_decode_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    bf16_variant: str = "auto",
    num_threads: int | None = None,
    isa: str = "auto",
) -> DecodeLaunch:
    """Every check of ``paged_decode_attention_cpu`` that depends on shapes, strides, dtypes
    and devices only (the block ids and lengths are checked in C on every call), the
    thread count (``num_threads``, or ``torch.get_num_threads()`` now when None: taken once
    here, so a backend checking once per step reads it once per step, not per layer) and
    the compiled copy: ``isa`` ("auto": the first of ``isa_levels()``) and, in bfloat16,
    ``bf16_variant`` ("auto": avx512bf16 where ``bf16_variants()`` has it and the head dim
    is at least ``AVX512_MIN_HEAD_DIM``, else portable), all decided here."""
    what = "paged_decode_attention_cpu"
    if _MODULE is None:
        raise RuntimeError(f"{what}: {_PROBLEM}")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"{what}: num_threads must be an int >= 1, got {num_threads!r}")
    batch, num_heads, num_kv_heads, head_dim, block_size = check_query_and_tables(
        what, query, k_cache, v_cache, block_tables, one_query_per_sequence=True
    )
    check_int_vector(what, "seq_lens", seq_lens, batch, torch.int32)
    if not block_tables.is_contiguous():
        raise ValueError(f"{what}: block_tables must be contiguous, got {block_tables.stride()}")
    if out is not None and (
        out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1
    ):
        raise ValueError(
            f"{what}: out must be {tuple(query.shape)} {query.dtype} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    tensors = (query, k_cache, v_cache, block_tables, seq_lens, *(() if out is None else (out,)))
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{what}: every tensor must be on the CPU")
    if any(t.is_neg() or t.is_conj() for t in tensors):
        # Lazy negation/conjugation views: the kernel would read the raw, unnegated data.
        raise ValueError(f"{what}: resolve negated or conjugated views first (.resolve_neg())")
    problem = geometry_problem(num_heads, num_kv_heads, head_dim, query.dtype)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    if bf16_variant != "auto" and query.dtype != torch.bfloat16:
        raise ValueError(f"{what}: bf16_variant {bf16_variant!r} applies to bfloat16 only")
    variants = bf16_variants()
    if bf16_variant != "auto" and bf16_variant not in variants:
        raise ValueError(
            f"{what}: bf16_variant {bf16_variant!r} is not available here; choose 'auto' or "
            f"one of {variants}"
        )
    if bf16_variant == "auto":
        avx512 = "avx512bf16" in variants and head_dim >= AVX512_MIN_HEAD_DIM
        bf16_variant = "avx512bf16" if avx512 else "portable"
    levels = isa_levels()
    if isa != "auto" and isa not in levels:
        raise ValueError(
            f"{what}: isa {isa!r} is not available here; choose 'auto' or one of {levels}"
        )
    return DecodeLaunch(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        table_width=block_tables.shape[1],
        num_blocks=k_cache.shape[0],
        bf16_variant=BF16_VARIANTS[bf16_variant] if query.dtype == torch.bfloat16 else None,
        num_threads=threads,
        isa=ISA_CODES[levels[0] if isa == "auto" else isa],
    )


def run_paged_decode_cpu(
    launch: DecodeLaunch,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the kernel on tensors shaped as the ones ``launch`` was checked with (the caller
    guarantees it: ``CpuAttentionBackend`` keys its per-step memo by shapes and strides)."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    kernel_threads(launch, query, k_cache, v_cache, block_tables, seq_lens, scale, out)
    return out


def kernel_threads(
    launch: DecodeLaunch,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> int:
    """``run_paged_decode_cpu`` into ``out``, returning how many threads the kernel ran on
    (1 for an empty batch, or a build without OpenMP: ``cpu_kernels_threaded``)."""
    if launch.batch == 0:
        return 1
    module = _MODULE  # read per call: the tests swap in mutants
    if module is None:
        raise RuntimeError(f"paged_decode_attention_cpu: {_PROBLEM}")
    args = (
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        launch.batch,
        launch.num_heads,
        launch.num_kv_heads,
        launch.head_dim,
        launch.block_size,
        launch.table_width,
        launch.num_blocks,
        scale,
        launch.num_threads,
        launch.isa,
    )
    if launch.bf16_variant is None:
        threads: int = module.paged_decode_f32(*args)
    else:
        threads = module.paged_decode_bf16(*args, launch.bf16_variant)
    return threads


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    bf16_variant: str = "auto",
    num_threads: int | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[B, H, D]``.

    Arguments as ``paged_decode_attention`` (the Triton launcher): ``query`` ``[B, H, D]``
    with a unit last stride, caches as ``store_kv`` writes them, ``block_tables``
    ``[B, max_blocks]`` int32 (-1 padding past each context), ``seq_lens`` ``[B]`` int32, the
    context length including the new token. q, caches and out all float32 or all bfloat16,
    on the CPU; ``bf16_variant`` picks the bfloat16 code and ``isa`` the instruction-set
    level ("auto": the best here, ``check_paged_decode_cpu``); ``num_threads`` bounds the
    threads (None: ``torch.get_num_threads()``); the result is the same bits at any count.
    A zero-length context gives zeros.
    """
    launch = check_paged_decode_cpu(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        bf16_variant=bf16_variant,
        num_threads=num_threads,
        isa=isa,
    )
    return run_paged_decode_cpu(launch, query, k_cache, v_cache, block_tables, seq_lens, scale, out)
