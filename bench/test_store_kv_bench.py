"""The CPU backend's store (the compiled row copy, csrc/store_kv_cpu.c) against the torch
backend's (``index_copy_``), one thread, in one process.

Shapes: the 29M Qwen3 of bench/test_vllm_bench.py (4 KV heads of 64), key and value as
views of the qkv projection's output (8 + 2 x 4 heads of 64 per row), as the model hands
them over; a decode step of 32 and 64 rows and prefill chunks of 256 and 1,024 rows; the
slots of the rows are those of consecutive 32-token blocks drawn at random from a pool of
2,048 (bench-vllm's block size and about its pool). float32 and bfloat16. Each backend's
``store_kv`` is called as a layer calls it (the step's metadata given), so the torch side
includes its per-step memo and the compiled side its per-step checks.

The two alternate sample by sample (``test_fused_ops_bench.measure``: each sample the mean of
its ``CALLS`` calls). Reported: ``us_min``/``us_median`` per side and
``ratio_min``/``ratio_median`` = compiled / torch (below 1: the compiled copy is faster).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from bench.test_fused_ops_bench import measure
from paged_engine.kernels.paged_decode_cpu import cpu_kernels_problem
from paged_engine.layers.attention.base import make_attention_metadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.layers.attention.torch_backend import TorchAttentionBackend

pytestmark = [
    pytest.mark.skipif(cpu_kernels_problem() is not None, reason="no compiled kernels"),
    pytest.mark.usefixtures("one_thread"),  # bench/conftest.py
]

HEADS, KV_HEADS, HEAD_DIM, BLOCK, POOL_BLOCKS = 8, 4, 64, 32, 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step_meta(rows: int, decode: bool, rng: random.Random) -> Any:
    """A decode step of ``rows`` sequences (one new token each, 200 tokens in) or one
    prefill chunk of ``rows`` tokens, its blocks drawn from the pool."""
    blocks = rng.sample(range(POOL_BLOCKS), rows * 7 if decode else -(-rows // BLOCK))
    if decode:
        tables = [blocks[i * 7 : (i + 1) * 7] for i in range(rows)]
        return make_attention_metadata([1] * rows, [200] * rows, tables, BLOCK)
    return make_attention_metadata([rows], [rows], [blocks], BLOCK)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "decode"), [(32, True), (64, True), (256, False), (1024, False)])
def test_store(benchmark: Any, rows: int, decode: bool, dtype: str) -> None:
    dt = DTYPES[dtype]
    meta = step_meta(rows, decode, random.Random(rows))
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(dt)
    q_end, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    k = qkv[:, q_end : q_end + kv].view(rows, KV_HEADS, HEAD_DIM)
    v = qkv[:, q_end + kv :].view(rows, KV_HEADS, HEAD_DIM)
    backends = {
        "torch": TorchAttentionBackend(BLOCK, dt),
        "compiled": CpuAttentionBackend(BLOCK, dt),
    }
    pools = {
        name: [torch.zeros(POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dt) for _ in "kv"]
        for name in backends
    }
    candidates = {
        name: (lambda b=b, p=pools[name]: b.store_kv(k, v, *p, meta.slot_mapping, meta))
        for name, b in backends.items()
    }
    result: dict[str, Any] = {}
    benchmark.pedantic(lambda: result.update(measure(candidates)), rounds=1, iterations=1)
    assert torch.equal(pools["torch"][0], pools["compiled"][0])  # both stored the same rows
    info = {"rows": rows, "step": "decode" if decode else "prefill", "dtype": dtype, **result}
    benchmark.extra_info.update(info)
    print(json.dumps(info))
