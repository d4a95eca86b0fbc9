"""The sampler's per-row pass (csrc/sample_ops.c: each row's argmax and whether it is all
finite) against the torch ops the sampler ran before it, at one thread.

``torch``: ``logits.float()``, ``isfinite(...).all(-1)`` and ``argmax(-1)``, what every step
cost the sampler before the pass (the float32 copy included: the sampler made it for
every batch). ``compiled``: ``sample_ops_cpu.argmax_finite_cpu`` on the logits as the model
returns them (launcher checks included). Vocabularies: SmolLM2-135M's 49,152 and Qwen3's
151,936; rows of a decode step, 1 to 64; float32 and bfloat16. The two alternate call by
call in one process, ``CALLS`` timed calls each after a warm-up; reported (``extra_info``,
printed): each side's min and median in ms and ``compiled / torch`` from the fastest and
the median calls (below 1: the pass is faster).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.alternation import alternate, figures
from paged_engine.kernels import sample_ops_cpu
from paged_engine.kernels.sample_ops_cpu import argmax_finite_cpu

if sample_ops_cpu.sample_ops_problem() is not None:
    pytest.skip(sample_ops_cpu.sample_ops_problem() or "", allow_module_level=True)

CALLS = 20


def torch_pass(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wide = logits.float()
    return wide.argmax(dim=-1), torch.isfinite(wide).all(dim=-1)


@pytest.mark.benchmark(group="sample_ops")
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_argmax_finite(benchmark: Any, rows: int, vocab: int, dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    calls = {"torch": lambda: torch_pass(logits), "compiled": lambda: argmax_finite_cpu(logits)}
    times = alternate(benchmark, calls, CALLS)
    want, got = torch_pass(logits), argmax_finite_cpu(logits)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    info: dict[str, Any] = {"suite": "sample_ops", "rows": rows, "vocab": vocab}
    info["dtype"] = str(dtype)
    info.update(figures(times, "compiled", "torch"))
    benchmark.extra_info.update(info)
    print("\nSAMPLE_OPS", {k: round(v, 3) if isinstance(v, float) else v for k, v in info.items()})
