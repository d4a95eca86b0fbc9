"""The compiled CPU kernels' instruction-set levels against their baseline copy, one thread.

Each kernel is compiled at every level of csrc/isa.h (the baseline; on x86-64 with GCC 12,
x86-64-v3 and v4) and the launchers pick one from the platform layer; this bench is why
the levels above the baseline are kept. Shapes are the 29M Qwen3 of
bench/test_vllm_bench.py (hidden 512, 8 heads / 4 KV heads, head_dim 64, intermediate
1792): one decode-attention layer call for 32 sequences of 512-token contexts (16-token
blocks, shuffled over the pool; bfloat16 on the portable variant, whose level the
launcher picks), and each fused op at 32 rows (a decode step) and 2,048 rows (a prefill
chunk), float32 and bfloat16.

Every level this CPU runs (``isa_levels()``) is timed in one process, the levels
alternating sample by sample (the machine is shared and noisy); a sample is the mean of
``CALLS`` calls. Reported per level: ``us_min``/``us_median`` and ``ratio_min``/
``ratio_median`` = level / baseline (below 1: the level pays). The outputs of every level
are checked against the baseline's first: equal for the norms and the rotation (exact
arithmetic), within float32 rounding elsewhere. pytest-benchmark's own time is the whole
measurement, not a figure.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from paged_engine.kernels import fused_ops_cpu, paged_decode_cpu
from paged_engine.layers.attention import make_attention_metadata

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 512, 8, 4, 64, 1792
SAMPLES, CALLS = 30, 10
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXACT = ("add_rms_norm", "qk_norm_rope")


pytestmark = pytest.mark.usefixtures("one_thread")  # bench/conftest.py


def measure(candidates: dict[str, Callable[[], torch.Tensor]], exact: bool) -> dict[str, Any]:
    first = {name: fn().clone() for name, fn in candidates.items()}  # also the warm-up
    base = first["baseline"]
    for name, out in first.items():
        if exact:
            assert torch.equal(out, base), f"{name} gives other bits than the baseline"
        else:
            torch.testing.assert_close(out.float(), base.float(), rtol=1e-5, atol=1e-5)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for sample in range(SAMPLES):
        for name in names if sample % 2 else names[::-1]:
            fn = candidates[name]
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            times[name].append((time.perf_counter() - start) / CALLS)
    mins = {k: min(v) for k, v in times.items()}
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "us_min": {k: round(v * 1e6, 2) for k, v in mins.items()},
        "us_median": {k: round(v * 1e6, 2) for k, v in medians.items()},
        "ratio_min": {k: round(v / mins["baseline"], 3) for k, v in mins.items()},
        "ratio_median": {k: round(v / medians["baseline"], 3) for k, v in medians.items()},
    }


def decode_candidates(dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    batch, context, bs = 32, 512, 16
    blocks = context // bs
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch * blocks, bs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch * blocks, bs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).tolist()
    meta = make_attention_metadata([1] * batch, [context] * batch, order, bs)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    args = (q, k, v, meta.block_tables, meta.seq_lens)
    out = torch.empty_like(q)
    variant = "portable" if dtype == torch.bfloat16 else "auto"

    def level(isa: str) -> Callable[[], torch.Tensor]:
        launch = paged_decode_cpu.check_paged_decode_cpu(*args, bf16_variant=variant, isa=isa)
        return lambda: paged_decode_cpu.run_paged_decode_cpu(launch, *args, HEAD_DIM**-0.5, out)

    return {isa: level(isa) for isa in paged_decode_cpu.isa_levels()}


def op_candidates(op: str, rows: int, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if op == "add_rms_norm":
        x, res = (torch.randn(2, rows, HIDDEN, generator=gen) * 3).to(dtype)
        w = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)

        def call(isa: str) -> torch.Tensor:
            return fused_ops_cpu.add_rms_norm_cpu(x, res, w, 1e-6, isa=isa)[0]

    elif op == "qk_norm_rope":
        heads = HEADS + KV_HEADS
        qk0 = torch.randn(rows, heads, HEAD_DIM, generator=gen).to(dtype)
        qk = qk0.clone()
        wq, wk = (torch.rand(2, HEAD_DIM, generator=gen) + 0.5).to(dtype)
        cos, sin = torch.randn(2, rows, HEAD_DIM, generator=gen).to(dtype)

        def call(isa: str) -> torch.Tensor:
            qk.copy_(qk0)  # in place: every call starts from the same values
            return fused_ops_cpu.qk_norm_rope_cpu_(qk, wq, wk, HEADS, 1e-6, cos, sin, isa=isa)

    else:
        gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).to(dtype)

        def call(isa: str) -> torch.Tensor:
            return fused_ops_cpu.silu_and_mul_cpu(gate_up, isa=isa)

    return {isa: (lambda isa=isa: call(isa)) for isa in fused_ops_cpu.isa_levels()}


def report(benchmark: Any, info: dict[str, Any], candidates: dict[str, Any], exact: bool) -> None:
    if len(candidates) < 2:
        pytest.skip(f"this CPU runs the baseline level only ({list(candidates)})")
    result: dict[str, Any] = {}
    benchmark.pedantic(lambda: result.update(measure(candidates, exact)), rounds=1, iterations=1)
    info.update(threads=1, **result)
    benchmark.extra_info.update(info)
    print(json.dumps(info))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_layer(benchmark: Any, dtype: str) -> None:
    info = {"kernel": "paged_decode", "batch": 32, "context": 512, "dtype": dtype}
    report(benchmark, info, decode_candidates(DTYPES[dtype]), exact=False)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [32, 2048])
@pytest.mark.parametrize("op", ["add_rms_norm", "qk_norm_rope", "silu_and_mul"])
def test_fused_op(benchmark: Any, op: str, rows: int, dtype: str) -> None:
    info = {"kernel": op, "rows": rows, "dtype": dtype}
    report(benchmark, info, op_candidates(op, rows, DTYPES[dtype]), exact=op in EXACT)
