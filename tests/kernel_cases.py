"""Layouts, tensors and launch helpers shared by the Triton kernel tests.

The tests (tests/test_kernels_decode.py: store_kv and decode; tests/test_kernels_prefill.py:
prefill and the kernel mutants; tests/test_kernels_backends.py: the Triton and flash-attn
backends; tests/test_kernels_gpu.py: realistic shapes on CUDA) check every launcher against
its plain-torch ``*_ref`` on small layouts that exercise what paging gets wrong: shuffled
block ids, blocks shared between sequences, padded (-1) block tables, lengths that are not
multiples of the block size, prefixes that end mid-block, GQA ratios of 1, 2 and 3 with
several KV heads, strided queries, and both the single-pass and the split-K decode paths.
Unused cache slots hold NaN, so a kernel that reads one token too many poisons its output
instead of passing by luck. tests/kernel_mutants.py supplies broken kernels that these
layouts must catch; tests/test_cpu_kernel.py runs the compiled CPU kernel on them too.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets it, and this
module again for importers outside pytest, before anything imports Triton's JIT); shapes are
tiny and example counts low so the kernel tests stay well under a minute on 2 cores. Tests
marked ``gpu`` use realistic shapes (16 query heads, 8 KV heads, head dim 128,
float16/bfloat16, block sizes 16 and 256) and are skipped without CUDA.

Tolerances (output vs the float32 reference, rounded to the output dtype):
float32 atol = rtol = 1e-5; float16 atol = rtol = 2e-3 (one fp16 ulp near 1 is 9.8e-4, and P
is rounded to fp16 before the P @ V product); bfloat16 atol = rtol = 2e-2 (same, 8x coarser).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings

from paged_engine.kernels.paged_attention_ref import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from paged_engine.kernels.paged_decode_attention import is_interpreted, paged_decode_attention
from paged_engine.kernels.paged_prefill_attention import paged_prefill_attention

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRETED = is_interpreted()

# Each kernel test module sets ``pytestmark = requires_kernels``.
requires_kernels = pytest.mark.skipif(
    not (CUDA or INTERPRETED),
    reason="no CUDA, and the kernels were compiled (not interpreted): some module imported "
    "paged_engine.kernels before TRITON_INTERPRET=1 was set",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not CUDA or INTERPRETED, reason="needs CUDA and compiled kernels (TRITON_INTERPRET unset)"
)

TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
CPU_DTYPES = (torch.float32, torch.float16)
FEW = settings(max_examples=40, deadline=None)


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A batch layout: per-sequence context and new-token counts plus the head geometry."""

    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_size: int = 16
    num_kv_heads: int = 2
    group: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    seed: int = 0
    strided_query: bool = False
    share_blocks: bool = True


@dataclass
class Tensors:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float


def make_tensors(case: Case, device: torch.device = DEVICE) -> Tensors:
    """Materialise ``case``: shuffled physical blocks, shared prefix blocks, NaN elsewhere.

    Sequence ``i > 0`` reuses sequence 0's first full blocks that lie inside both contexts'
    cached prefixes (as a prefix-cache hit would); every other block comes from a shuffled
    pool larger than needed. Cache slots outside every context are NaN.
    """
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [math.ceil(s / bs) for s in case.seq_lens]
    num_blocks = sum(needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables: list[list[int]] = []
    for i, (s, q) in enumerate(zip(case.seq_lens, case.query_lens, strict=True)):
        shared: list[int] = []
        if case.share_blocks and i > 0:
            n_shared = min(case.seq_lens[0] - case.query_lens[0], s - q) // bs
            shared = tables[0][: min(n_shared, 2)]
        tables.append(shared + [pool.pop() for _ in range(needed[i] - len(shared))])
    width = max(needed, default=0) + 1  # at least one -1 of padding per row
    padded = [row + [-1] * (width - len(row)) for row in tables]

    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"))
    v_cache = torch.full((num_blocks, bs, kvh, d), float("nan"))
    for row, s in zip(tables, case.seq_lens, strict=True):
        for pos in range(s):
            blk, off = row[pos // bs], pos % bs
            k_cache[blk, off] = torch.randn(kvh, d, generator=gen)
            v_cache[blk, off] = torch.randn(kvh, d, generator=gen)

    num_tokens, num_heads = sum(case.query_lens), kvh * case.group
    if case.strided_query:  # a slice of a fused QKV projection output
        fused = torch.randn(num_tokens, num_heads + 2 * kvh, d, generator=gen)
        query = fused.to(device=device, dtype=case.dtype)[:, :num_heads]
    else:
        query = torch.randn(num_tokens, num_heads, d, generator=gen).to(device, case.dtype)
    i32 = {"dtype": torch.int32, "device": device}
    return Tensors(
        query=query,
        k_cache=k_cache.to(device, case.dtype),
        v_cache=v_cache.to(device, case.dtype),
        block_tables=torch.tensor(padded, **i32).view(len(tables), width),
        seq_lens=torch.tensor(case.seq_lens, **i32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(case.query_lens)], **i32),
        scale=d**-0.5,
    )


def decode_case(seq_lens: tuple[int, ...], **kw: Any) -> Case:
    return Case(seq_lens=seq_lens, query_lens=(1,) * len(seq_lens), **kw)


def run_decode(
    t: Tensors, launch: Callable[..., torch.Tensor] = paged_decode_attention, **kw: Any
) -> torch.Tensor:
    return launch(t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale, **kw)


def ref_decode(t: Tensors) -> torch.Tensor:
    return paged_decode_attention_ref(
        t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale
    )


def run_prefill(
    t: Tensors, launch: Callable[..., torch.Tensor] = paged_prefill_attention, **kw: Any
) -> torch.Tensor:
    max_q = int((t.query_start_loc[1:] - t.query_start_loc[:-1]).max())
    return launch(
        t.query,
        t.k_cache,
        t.v_cache,
        t.block_tables,
        t.query_start_loc,
        t.seq_lens,
        max_q,
        t.scale,
        **kw,
    )


def ref_prefill(t: Tensors) -> torch.Tensor:
    return paged_prefill_attention_ref(
        t.query, t.k_cache, t.v_cache, t.block_tables, t.query_start_loc, t.seq_lens, t.scale
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any(), "NaN in output: a kernel read an unused (NaN) slot"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


# Hand-picked layouts, each run by the decode or prefill test, and by the mutant test.
DECODE_CASES = [
    decode_case((37, 1, 70, 16), block_size=16, group=1),  # lens around block edges
    decode_case((37, 1, 70, 16), block_size=16, group=2),
    decode_case((33, 64, 5), block_size=32, group=2, strided_query=True),
    decode_case((33, 64, 5), block_size=32, group=3, num_kv_heads=1),
    decode_case((100, 9), block_size=8, group=2, head_dim=16),
    # head_dim 64, 4 kv heads: the CPU kernel's items take a run of kv heads (csrc's run_span)
    decode_case((37, 1, 70), block_size=16, group=2, num_kv_heads=4, head_dim=64),
    # SmolLM2-135M's geometry: runs of 3 kv heads of 64, groups of 3
    decode_case((37, 1, 70), block_size=16, group=3, num_kv_heads=3, head_dim=64),
]
PREFILL_CASES = [
    Case(seq_lens=(37, 20, 70), query_lens=(37, 20, 23), block_size=16, group=1),  # fresh + hit
    Case(seq_lens=(37, 20, 70), query_lens=(37, 3, 23), block_size=16, group=2),  # mid-block
    Case(seq_lens=(45, 64, 40, 10), query_lens=(45, 1, 27, 0), block_size=32, group=2),
    Case(seq_lens=(19, 50), query_lens=(19, 33), block_size=32, group=3, strided_query=True),
]


def cpu_id(case: Case) -> str:
    return f"bs{case.block_size}-kvh{case.num_kv_heads}-g{case.group}-d{case.head_dim}"


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


FLASH = CUDA and _flash_attn_importable()
