"""``Linear`` on a oneDNN-packed weight against ``F.linear`` on the dense one, at one thread.

Shapes: the four projections of the 29M Qwen3-shaped model (``bench/test_vllm_bench.py``:
hidden 512, 8 / 4 heads of 64, intermediate 1792) at 32 rows (a decode step), 512 and
2,048 rows (prefill chunks), float32 and bfloat16; and SmolLM2-135M's tied LM head at 1-64
rows (``test_packed_lm_head``). Per case the two alternate call by call
in one process (the machine is shared), ``CALLS`` timed calls each after a warm-up; the
figures (``extra_info``, printed) are each side's min and median in ms and
``packed / dense`` from the fastest and the median calls (below 1: packing pays).
pytest-benchmark's own time is the whole measurement, not a figure.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bench.alternation import alternate, figures
from paged_engine.layers import linear
from paged_engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from paged_engine.layers.linear import Linear

if not linear.packs(torch.float32):
    pytest.skip("torch has no oneDNN linear ops here", allow_module_level=True)

CALLS = 15
SHAPES = {"qkv": (512, 1024), "o": (512, 512), "gate_up": (512, 3584), "down": (1792, 512)}
CASES = [
    pytest.param(name, rows, dtype, id=f"{name}-{rows}-{str(dtype)[6:]}")
    for dtype in (torch.float32, torch.bfloat16)
    for rows in (32, 512, 2048)
    for name in SHAPES
]


def report(benchmark: Any, info: dict[str, Any], times: dict[str, list[float]], tag: str) -> None:
    info.update(figures(times, "packed", "dense"))
    benchmark.extra_info.update(info)
    print(f"\n{tag}", {key: round(v, 3) for key, v in info.items() if "ms" in key or "over" in key})


@pytest.mark.benchmark(group="linear")
@pytest.mark.parametrize(("name", "rows", "dtype"), CASES)
def test_packed_linear(benchmark: Any, name: str, rows: int, dtype: torch.dtype) -> None:
    if not linear.packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (torch's mkldnn bf16 probe)")
    torch.set_num_threads(1)
    k, n = SHAPES[name]
    dense = torch.randn(n, k).to(dtype)
    layer = Linear(k, n).to(dtype)
    layer.weight.data.copy_(dense)
    layer.process_weights_after_loading()
    assert layer._packed is not None
    x = torch.randn(rows, k).to(dtype)
    times = alternate(
        benchmark, {"dense": lambda: F.linear(x, dense), "packed": lambda: layer(x)}, CALLS
    )
    torch.testing.assert_close(layer(x).float(), F.linear(x, dense).float(), rtol=2e-2, atol=1e-1)
    info: dict[str, Any] = {"suite": "linear", "shape": [rows, k, n], "dtype": str(dtype)}
    report(benchmark, info, times, f"LINEAR {name} {rows} {dtype}")


HEAD = (576, 49152)
"""SmolLM2-135M's LM head (hidden 576, vocabulary 49,152; tied to its embedding)."""


@pytest.mark.benchmark(group="linear")
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_packed_lm_head(benchmark: Any, rows: int, dtype: torch.dtype) -> None:
    """The tied head as the model runs it (``ParallelLMHead`` after
    ``process_weights_after_loading``) against ``F.linear`` on the embedding's matrix, at
    decode-step rows."""
    if not linear.packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (torch's mkldnn bf16 probe)")
    torch.set_num_threads(1)
    k, n = HEAD
    embed = VocabParallelEmbedding(n, k).to(dtype)
    embed.weight.data.copy_(torch.randn(n, k))
    head = ParallelLMHead(n, k, embed).to(dtype)
    head.process_weights_after_loading()
    assert head._packed is not None
    x = torch.randn(rows, k).to(dtype)
    dense = embed.weight
    times = alternate(
        benchmark, {"dense": lambda: F.linear(x, dense), "packed": lambda: head(x)}, CALLS
    )
    torch.testing.assert_close(head(x).float(), F.linear(x, dense).float(), rtol=2e-2, atol=1e-1)
    info: dict[str, Any] = {"suite": "lm_head", "shape": [rows, k, n], "dtype": str(dtype)}
    report(benchmark, info, times, f"LM_HEAD {rows} {dtype}")
