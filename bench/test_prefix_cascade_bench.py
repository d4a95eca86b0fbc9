"""A shared-prefix cascade in front of the CPU decode kernel, measured (not built), one thread.

The idea: attend each shared prefix once for all the sequences that share it (their query
heads stacked per KV head, so 16 rows where one sequence's group has 2), with torch's flash
kernel, which also returns the log-sum-exps a merge needs; then run the decode kernel over
each sequence's own blocks only. The batch is ``bench/test_prefix_order_bench.py``'s (block
32, 32 sequences, 4 prefixes of 10 blocks, 4 blocks of each sequence's own; the 29M
model's and SmolLM2's heads, float32 and bfloat16). Its parts, timed in one process,
alternating call by call:

* ``kernel_whole``: the kernel over whole contexts, as the engine runs it;
* ``kernel_own``: the kernel over the sequences' own blocks alone;
* ``prefix_kept``: the flash kernel over the 4 prefixes, K/V contiguous per KV head (as a
  copy kept from step to step would have them);
* ``prefix_gather``: gathering the 4 prefixes' K/V blocks out of the pool (one
  ``index_select`` each: the blocks are scattered, so no view of the pool reaches them);
* ``prefix_on_gathered``: the flash kernel reading the gathered K/V as they lie (tokens
  outer, KV heads inner: a strided view per KV head).

Reported: each part's ``us_min``/``us_median`` and two ratios over ``kernel_whole``: the
best case, ``(kernel_own + prefix_kept) / kernel_whole`` (copies kept, the merge free),
and ``(kernel_own + prefix_gather + prefix_on_gathered) / kernel_whole`` (gathered every
step, the merge free). docs/performance.md has a run. The merged result is not computed:
this measures whether the parts could pay, not a cascade.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.alternation import sampled_in_turn
from bench.test_prefix_order_bench import (
    BLOCK,
    DTYPES,
    OWN_BLOCKS,
    PREFIX_BLOCKS,
    PREFIXES,
    SHAPES,
    Batch,
    kernel_call,
    make_batch,
)
from paged_engine.kernels import paged_decode_cpu

SAMPLES, CALLS = 15, 5

pytestmark = pytest.mark.usefixtures("one_thread")  # bench/conftest.py


def _gather(b: Batch, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix ``group``'s K and V gathered out of the pool: ``[tokens, kv_heads, dim]``."""
    blocks = b.prefix[group]
    kv_heads, dim = b.k.shape[2], b.k.shape[3]
    k, v = (t.index_select(0, blocks).view(-1, kv_heads, dim) for t in (b.k, b.v))
    return k, v


def _per_head(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, kv_heads, dim]`` as the flash kernel's ``[1, kv_heads, tokens, dim]`` views."""
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def parts(shape: str, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    b = make_batch(shape, dtype)
    batch, heads, dim = b.q.shape
    kv_heads = b.k.shape[2]
    group_of = torch.arange(batch) % PREFIXES
    whole = torch.cat([b.prefix[group_of], b.own], 1)
    lens_whole = torch.full((batch,), BLOCK * (PREFIX_BLOCKS + OWN_BLOCKS), dtype=torch.int32)
    lens_own = torch.full((batch,), BLOCK * OWN_BLOCKS, dtype=torch.int32)
    members = [torch.nonzero(group_of == g).flatten() for g in range(PREFIXES)]
    # each group's query heads stacked per kv head: [1, kv_heads, members * group, dim]
    queries = [
        b.q[m].view(len(m), kv_heads, heads // kv_heads, dim).transpose(0, 1)
        .reshape(1, kv_heads, -1, dim)
        for m in members
    ]  # fmt: skip
    gathered = [_per_head(*_gather(b, g)) for g in range(PREFIXES)]
    kept = [(k.contiguous(), v.contiguous()) for k, v in gathered]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def prefixes(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
        def run() -> object:
            pairs = zip(queries, kv, strict=True)
            return [flash(q, k, v, 0.0, False, scale=dim**-0.5)[:2] for q, (k, v) in pairs]

        return run

    out, lse = flash(queries[0], *kept[0], 0.0, False, scale=dim**-0.5)[:2]
    assert out.shape == queries[0].shape and lse.shape == queries[0].shape[:3]
    on_gathered = flash(queries[0], *gathered[0], 0.0, False, scale=dim**-0.5)[0]
    assert torch.equal(on_gathered, out), "the strided read changed the result"
    return {
        "kernel_whole": kernel_call(b.q, b.k, b.v, whole, lens_whole),
        "kernel_own": kernel_call(b.q, b.k, b.v, b.own, lens_own),
        "prefix_kept": prefixes(kept),
        "prefix_gather": lambda: [_gather(b, g) for g in range(PREFIXES)],
        "prefix_on_gathered": prefixes(gathered),
    }


def measure(runs: dict[str, Callable[[], object]]) -> dict[str, Any]:
    mins, meds = sampled_in_turn(runs, SAMPLES, CALLS)
    ratios = {}
    for stat, f in (("min", mins), ("median", meds)):
        ratios[f"best_case_over_kernel_{stat}"] = round(
            (f["kernel_own"] + f["prefix_kept"]) / f["kernel_whole"], 3
        )
        per_step = f["kernel_own"] + f["prefix_gather"] + f["prefix_on_gathered"]
        ratios[f"gathered_each_step_over_kernel_{stat}"] = round(per_step / f["kernel_whole"], 3)
    return {
        "us_min": {k: round(v * 1e6, 1) for k, v in mins.items()},
        "us_median": {k: round(v * 1e6, 1) for k, v in meds.items()},
        **ratios,
    }


@pytest.mark.benchmark(group="prefix-cascade")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefix_cascade_parts(benchmark: Any, shape: str, dtype: str) -> None:
    if paged_decode_cpu.cpu_kernels_problem() is not None:
        pytest.skip(f"no compiled kernel: {paged_decode_cpu.cpu_kernels_problem()}")
    runs = parts(shape, DTYPES[dtype])
    result = benchmark.pedantic(lambda: measure(runs), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\n{shape} {dtype}: {json.dumps(result)}")
