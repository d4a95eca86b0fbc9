"""What the CPU decode kernel can take and which of its compiled copies runs: decisions from
the head layout, the dtype and the platform layer's answers, apart from the launcher
(``paged_decode_cpu``) that checks tensors and calls the C.

bfloat16 has three compiled variants: ``"amx"`` (the AVX512 one with its Q.K scores on AMX
tiles, csrc/paged_decode_amx.h; for head dims that are multiples of 64 and blocks of a
multiple of 16 tokens, and the AVX512 copy for other calls), ``"avx512bf16"`` (AVX512-BF16
dot products) and ``"portable"`` (plain C, widened to float32). ``"auto"`` takes the best of
the first two that runs here where the head dim is at least ``AVX512_MIN_HEAD_DIM``: below,
a 512-bit dot is mostly masked off and the portable copy at AVX2 width does better
(bench/test_cpu_bf16_bench.py). All keep every product, the softmax and the accumulator
in float32, and round once, to the output.

Instruction-set levels (csrc/isa.h): the float32 kernel and the portable bfloat16 one are
compiled once per level, the baseline everywhere and x86-64-v3/v4 on x86-64 (portable
bfloat16 stops at v3); "auto" takes the best that both the module and the platform layer
allow. The C entry points only refuse a level or variant they cannot run.
"""

from __future__ import annotations

import torch

from paged_engine import platform
from paged_engine.kernels.cpu_library import level_code

__all__ = [
    "AVX512_MIN_HEAD_DIM",
    "BF16_VARIANTS",
    "DTYPES",
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "auto_cpu_dtype",
    "bf16_variant_code",
    "cpu_bf16_features",
    "geometry_problem",
    "isa_code",
    "variants_allowed",
]

MAX_GROUP = 16
"""Most query heads per KV head the kernel takes (its per-head state lives on the stack)."""
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
"""The head dims the launchers' shared checks accept (``checks.check_query_and_tables``)."""
DTYPES = (torch.float32, torch.bfloat16)
BF16_VARIANTS = {"auto": 0, "portable": 1, "avx512bf16": 2, "amx": 3}
"""The names of the bfloat16 variants, with the code the C entry point takes."""
AVX512_MIN_HEAD_DIM = 32
""""auto" takes the amx or avx512bf16 variant from this head dim up (the module docstring)."""


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


def variants_allowed(built: tuple[str, ...]) -> tuple[str, ...]:
    """Those of a module's bfloat16 variants (``built``, best first) whose instructions the
    platform layer also finds the CPU's flags for (``platform.DECODE_AVX512_BF16_FLAGS``,
    ``platform.DECODE_AMX_FLAGS``)."""
    cpu = platform.cpu_info()
    needs = {"avx512bf16": platform.DECODE_AVX512_BF16_FLAGS, "amx": platform.DECODE_AMX_FLAGS}
    return tuple(v for v in built if v not in needs or cpu.has(needs[v]))


def bf16_variant_code(
    what: str, requested: str, variants: tuple[str, ...], dtype: torch.dtype, head_dim: int
) -> int | None:
    """The C code of the bfloat16 variant to run (None in float32): ``requested``, or for
    "auto" the first of amx and avx512bf16 that ``variants`` (those that run here) has where
    ``head_dim`` is at least ``AVX512_MIN_HEAD_DIM``, else portable. ValueError for a named
    variant in float32 or one that does not run here."""
    if requested != "auto" and dtype != torch.bfloat16:
        raise ValueError(f"{what}: bf16_variant {requested!r} applies to bfloat16 only")
    if requested != "auto" and requested not in variants:
        raise ValueError(
            f"{what}: bf16_variant {requested!r} is not available here; choose 'auto' or "
            f"one of {variants}"
        )
    if dtype != torch.bfloat16:
        return None
    if requested == "auto":
        wide = [v for v in ("amx", "avx512bf16") if v in variants]
        requested = wide[0] if wide and head_dim >= AVX512_MIN_HEAD_DIM else "portable"
    return BF16_VARIANTS[requested]


def isa_code(what: str, requested: str, levels: tuple[str, ...]) -> int:
    """The C code of the level to run: ``requested``, or for "auto" the first (best) of
    ``levels`` (those that run here); ValueError for one that does not run here."""
    if requested != "auto" and requested not in levels:
        raise ValueError(
            f"{what}: isa {requested!r} is not available here; choose 'auto' or one of {levels}"
        )
    return level_code(what, None if requested == "auto" else requested, levels)


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
