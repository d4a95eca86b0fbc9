"""The prefill's SDPA over a cached prefix with a boolean causal mask against the additive
one the torch backend builds (``dense.causal_bias``), one thread.

Shapes: the end-to-end workload's (``bench/test_e2e_bench.py``): 16-128 new rows over a
context of 144-640 tokens, the 29M model's heads (8 query / 4 KV heads of 64), float32 and
bfloat16. ``CALLS`` calls of mask-and-SDPA a side, the two masks alternating call by call
(``bench/alternation.py``); reported per cell: ms min and median, and ``bias / bool`` of
each (below 1: the additive mask is faster). Both masks give the same bits, checked first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.alternation import alternate, figures
from paged_engine.layers.attention.dense import causal_bias, sdpa

SHAPES = ((16, 144), (16, 528), (72, 400), (128, 256), (128, 640))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HEADS, KV_HEADS, DIM = 8, 4, 64
CALLS = 100

pytestmark = pytest.mark.usefixtures("one_thread")  # bench/conftest.py


def bool_mask(rows: int, context: int) -> torch.Tensor:
    """The boolean mask the torch backend used before ``causal_bias``."""
    seen = torch.arange(rows)[:, None] + (context - rows)
    return torch.arange(context)[None, :] <= seen


def calls(rows: int, context: int, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, rows, DIM, generator=gen).to(dtype)
    k, v = torch.randn(2, 1, KV_HEADS, context, DIM, generator=gen).to(dtype)
    scale = DIM**-0.5
    cpu = torch.device("cpu")
    return {
        "bool": lambda: sdpa(q, k, v, scale, bool_mask(rows, context)),
        "bias": lambda: sdpa(q, k, v, scale, causal_bias(rows, context, dtype, cpu)),
    }


@pytest.mark.benchmark(group="prefill-mask")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "context"), SHAPES)
def test_prefill_mask(benchmark: Any, rows: int, context: int, dtype: str) -> None:
    runs = calls(rows, context, DTYPES[dtype])
    assert torch.equal(runs["bool"](), runs["bias"]())
    result = figures(alternate(benchmark, runs, CALLS), "bias", "bool")
    benchmark.extra_info.update(result)
    shown = {k: round(v, 3) for k, v in result.items()}
    print(f"\n{rows} over {context} {dtype}: {json.dumps(shown)}")
