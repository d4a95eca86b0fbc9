"""The CPU decode kernel on a batch that shares cached prefixes, in the order a scheduler
hands it over, one thread: what csrc/run_items.c's ``item_order`` is for.

The batch is bench-vllm's decode shape (block size 32, 32 sequences): 4 prefixes of 10
blocks (320 tokens) and 4 blocks of each sequence's own, shuffled over the pool; the 29M
model's heads (8 query / 4 KV heads of 64) and SmolLM2-135M's (9 / 3 of 64), float32 and
bfloat16. Three layouts of the same work, timed in one process, alternating call by call:

* ``interleaved``: sequence b reads prefix b % 4, as requests arrive;
* ``sorted``: the same sequences sorted by prefix (grouped by prefix, as the kernel runs
  them);
* ``one_prefix``: every sequence reads the same 14 blocks, which stay in the core's
  cache: a ceiling on what any order can gain;
* ``shared``: ``interleaved`` with its 4 prefixes given to the kernel as shared-prefix
  groups (``kernels.decode_share``, what the "cpu" backend does in bfloat16): each group's
  query heads scored together against the shared rows. The same bits (checked).

Reported: per layout ``us_min``/``us_median`` over ``SAMPLES`` samples (each the mean of
``CALLS`` calls), and the ratios ``interleaved / sorted``, ``interleaved / one_prefix`` and
``interleaved / shared``.
The kernel runs both the first layouts in the same order, so on one build their ratio is
1.0 by construction: it shows that the batch's order no longer matters. What the order
gains shows only against a build without it (index order at one thread), where
interleaved float32 batches paid for it: docs/performance.md has both builds' figures.
The outputs of ``interleaved`` and ``sorted`` are checked equal, row for row.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from bench.alternation import sampled_in_turn
from paged_engine.kernels import paged_decode_cpu
from paged_engine.kernels.decode_share import DecodeShare, decode_share

BLOCK, BATCH, PREFIXES, PREFIX_BLOCKS, OWN_BLOCKS = 32, 32, 4, 10, 4
SAMPLES, CALLS = 20, 5
SHAPES = {"29m": (8, 4, 64), "smollm2": (9, 3, 64)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


pytestmark = pytest.mark.usefixtures("one_thread")  # bench/conftest.py


@dataclass(frozen=True, slots=True)
class Batch:
    """The decode batch: queries, the pool, each prefix's and each sequence's own blocks."""

    q: torch.Tensor  # [BATCH, heads, dim]
    k: torch.Tensor  # [pool, BLOCK, kv_heads, dim]
    v: torch.Tensor
    prefix: torch.Tensor  # [PREFIXES, PREFIX_BLOCKS] block ids
    own: torch.Tensor  # [BATCH, OWN_BLOCKS] block ids


def make_batch(shape: str, dtype: torch.dtype) -> Batch:
    """The batch, its blocks shuffled over the pool; sequence b reads prefix b % PREFIXES."""
    heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    pool = PREFIXES * PREFIX_BLOCKS + BATCH * OWN_BLOCKS
    k, v = torch.randn(2, pool, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    ids = torch.randperm(pool, generator=gen)
    prefix = ids[: PREFIXES * PREFIX_BLOCKS].view(PREFIXES, PREFIX_BLOCKS)
    own = ids[PREFIXES * PREFIX_BLOCKS :].view(BATCH, OWN_BLOCKS)
    q = torch.randn(BATCH, heads, dim, generator=gen).to(dtype)
    return Batch(q, k, v, prefix, own)


def kernel_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    share: DecodeShare | None = None,
) -> Callable[[], torch.Tensor]:
    """One checked launch of the CPU decode kernel, run again at each call."""
    query, table = q.contiguous(), table.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    launch = paged_decode_cpu.check_paged_decode_cpu(query, k, v, table, lens)
    scale = query.shape[-1] ** -0.5
    return lambda: paged_decode_cpu.run_paged_decode_cpu(
        launch, query, k, v, table, lens, scale, out, share
    )


def layouts(shape: str, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    b = make_batch(shape, dtype)
    q, k, v, prefix, own = b.q, b.k, b.v, b.prefix, b.own
    lens = torch.full((BATCH,), BLOCK * (PREFIX_BLOCKS + OWN_BLOCKS), dtype=torch.int32)
    interleaved = torch.cat([prefix[torch.arange(BATCH) % PREFIXES], own], 1)
    by_prefix = torch.argsort(torch.arange(BATCH) % PREFIXES, stable=True)
    tables = {
        "interleaved": (q, interleaved),
        "sorted": (q[by_prefix], interleaved[by_prefix]),
        "one_prefix": (q, interleaved[:1].expand(BATCH, -1)),
    }

    runs = {name: kernel_call(query, k, v, table, lens) for name, (query, table) in tables.items()}
    groups = [
        ([b for b in range(BATCH) if b % PREFIXES == p], BLOCK * PREFIX_BLOCKS)
        for p in range(PREFIXES)
    ]
    runs["shared"] = kernel_call(q, k, v, interleaved, lens, decode_share(groups, BATCH, BLOCK))
    first = runs["interleaved"]().clone()
    assert torch.equal(runs["sorted"]()[torch.argsort(by_prefix)], first)
    assert torch.equal(runs["shared"](), first)
    return runs


def measure(runs: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Any]:
    mins, meds = sampled_in_turn(runs, SAMPLES, CALLS)
    ratio = {
        f"interleaved_over_{other}_{stat}": round(figs["interleaved"] / figs[other], 3)
        for other in ("sorted", "one_prefix", "shared")
        for stat, figs in (("min", mins), ("median", meds))
    }
    return {
        "us_min": {k: round(v * 1e6, 1) for k, v in mins.items()},
        "us_median": {k: round(v * 1e6, 1) for k, v in meds.items()},
        **ratio,
    }


@pytest.mark.benchmark(group="prefix-order")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefix_order(benchmark: Any, shape: str, dtype: str) -> None:
    if paged_decode_cpu.cpu_kernels_problem() is not None:
        pytest.skip(f"no compiled kernel: {paged_decode_cpu.cpu_kernels_problem()}")
    runs = layouts(shape, DTYPES[dtype])
    result = benchmark.pedantic(lambda: measure(runs), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\n{shape} {dtype}: {json.dumps(result)}")
