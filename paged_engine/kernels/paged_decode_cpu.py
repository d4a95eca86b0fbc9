"""Launcher for the compiled CPU paged-decode kernel (``csrc/paged_decode_cpu.c``).

The kernel reads raw addresses, so everything it could misread is checked here first:
shapes, dtypes (float32, or bfloat16 for q, caches and out alike), devices (CPU only),
strides; and in C, before any read, every block id a context touches (an exception, never a
stray read). The readable reference is ``paged_attention_ref.paged_decode_attention_ref``
(same maths, plain float32 torch); ``paged_decode_cpu_ref`` restates the kernel's own
algorithm (block walk, online softmax) in torch; the tests hold the three together.

The checks are split from the launch (``check_paged_decode_cpu`` returns a
``DecodeLaunch``, ``run_paged_decode_cpu`` runs one): a model calls the kernel once per
layer with the same shapes, and the "cpu" backend checks once per step. The check also
makes every choice of compiled copy (``paged_decode_cpu_choice``: the bfloat16 variant and
the instruction-set level), from what the module runs (``bf16_variants``, ``isa_levels``)
and what the platform layer allows.

Threads: a call's items (a sequence and its KV heads where head_dim is 64 or 128 and there
are 2 or 4 of them, else a sequence and one KV head) run on up to ``DecodeLaunch.num_threads``
threads (OpenMP, torch's own runtime; ``torch.get_num_threads()`` when the launch is
checked, so once per step in the "cpu" backend), claimed one at a time, so a thread that
loses its core holds back one item only; in ``csrc/run_items.c``'s order (sequences that
share a first block together, so a cached prefix's blocks stay in the core's cache; the
groups longest first). Each item is computed by
one thread in a fixed order: the output is the same bits at any count. 1 (the default on
2-core machines, see ``EngineConfig.num_threads``) runs no parallel region;
``cpu_kernels_threaded()`` says whether the build has OpenMP at all.

The extension is optional (``setup.py``): ``cpu_kernels_problem()`` says why it is missing.
The layout limits and dtype policy (``MAX_GROUP``, ``auto_cpu_dtype``, ...) are
``paged_decode_cpu_choice``'s, named here too as the kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_engine import platform
from paged_engine.kernels.checks import check_int_vector, check_query_and_tables
from paged_engine.kernels.cpu_library import ISA_CODES, load_decode_module
from paged_engine.kernels.decode_share import DecodeShare
from paged_engine.kernels.paged_decode_cpu_choice import (
    BF16_VARIANTS,
    DTYPES,
    MAX_GROUP,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    auto_cpu_dtype,
    bf16_variant_code,
    cpu_bf16_features,
    geometry_problem,
    isa_code,
    variants_allowed,
)

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

_COMPILED, _PROBLEM = load_decode_module()
"""The compiled module (``_cpu_kernels``), bound once; or None, and why."""


def cpu_kernels_problem() -> str | None:
    """Why the compiled CPU kernels cannot be used, or None when they can."""
    return _PROBLEM


def cpu_kernels_threaded() -> bool:
    """Whether the built module runs a call's work items on several threads (it was built
    with OpenMP: setup.py drops ``-fopenmp`` where the toolchain lacks it); False without
    the module."""
    return _COMPILED is not None and bool(_COMPILED.module.threaded())


def bf16_variants() -> tuple[str, ...]:
    """The bfloat16 variants that run here, best first: those the built module has and
    this CPU executes (its own check) that the platform layer also finds the CPU's flags
    for (``platform.DECODE_AVX512_BF16_FLAGS``, ``DECODE_AMX_FLAGS``); empty without the
    module."""
    if _COMPILED is None:
        return ()
    return variants_allowed(tuple(_COMPILED.module.bf16_variants()))


def isa_levels() -> tuple[str, ...]:
    """The instruction-set levels (``cpu_library.ISA_CODES``' names) the kernel runs at
    here, best first: those the built module has and this CPU executes (its own check) that
    the platform layer also finds the CPU's flags for (``platform.CpuInfo.isa_levels``);
    "auto" takes the first. Always ends in "baseline"; empty without the module."""
    if _COMPILED is None:
        return ()
    return _COMPILED.levels_allowed(platform.cpu_info().isa_levels)


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
    """The C variant code for bfloat16 (``paged_decode_cpu_choice.BF16_VARIANTS``), None
    for float32."""
    num_threads: int = 1
    """The most threads a call may use over its items (a sequence and a run of its KV
    heads): 1 runs no parallel region at all; fewer are used when there are fewer items."""
    isa: int = 0
    """The instruction-set level's code (``cpu_library.ISA_CODES``) of the copy that runs."""


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
    ``bf16_variant`` (``paged_decode_cpu_choice.bf16_variant_code``), all decided here."""
    what = "paged_decode_attention_cpu"
    if _COMPILED is None:
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
    variant = bf16_variant_code(what, bf16_variant, bf16_variants(), query.dtype, head_dim)
    level = isa_code(what, isa, isa_levels())
    return DecodeLaunch(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        table_width=block_tables.shape[1],
        num_blocks=k_cache.shape[0],
        bf16_variant=variant,
        num_threads=threads,
        isa=level,
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
    share: DecodeShare | None = None,
) -> torch.Tensor:
    """Run the kernel on tensors shaped as the ones ``launch`` was checked with (the caller
    guarantees it: ``CpuAttentionBackend`` keys its per-step memo by shapes and strides);
    ``share``: shared-prefix groups (``decode_share``), checked in C, the same bits."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    kernel_threads(launch, query, k_cache, v_cache, block_tables, seq_lens, scale, out, share)
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
    share: DecodeShare | None = None,
) -> int:
    """``run_paged_decode_cpu`` into ``out``, returning how many threads the kernel ran on
    (1 for an empty batch, or a build without OpenMP: ``cpu_kernels_threaded``)."""
    if launch.batch == 0:
        return 1
    if _COMPILED is None:
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
    groups = () if share is None else share.kernel_args(launch.batch)
    if launch.bf16_variant is None:
        threads: int = _COMPILED.module.paged_decode_f32(*args, *groups)
    else:
        threads = _COMPILED.module.paged_decode_bf16(*args, launch.bf16_variant, *groups)
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
