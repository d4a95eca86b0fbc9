"""Linear layers on oneDNN-packed weights (``Linear.process_weights_after_loading``).

The packed product must be ``F.linear`` with the checkpoint's weight, up to the GEMM's
rounding: float32 within 1e-5 relative (oneDNN's sums run in another order than MKL's),
bfloat16 within bfloat16's own rounding. The check is shown to fail on a mutant that
drops the bias on the packed path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paged_engine import LLM
from paged_engine.layers import linear
from paged_engine.layers.linear import (
    Linear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
)

pytestmark = pytest.mark.skipif(not linear._ONEDNN, reason="torch built without oneDNN")

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


def _layers(bias: bool) -> list[Linear]:
    return [
        Linear(48, 40, bias=bias),
        MergedLinear(48, [24, 24], bias=bias),
        QKVLinear(48, head_dim=8, num_heads=4, num_kv_heads=2, bias=bias),
        RowParallelLinear(48, 40, bias=bias),
    ]


def check_packed_matches_dense(layer: Linear, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = layer.to(dtype)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    weight = layer.weight.detach().clone()
    bias = None if layer.bias is None else layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert layer._packed is not None
    assert tuple(layer.weight.shape) == (0, 48)  # the dense copy is released
    for shape in ((1, 48), (7, 48), (2, 3, 48)):
        x = torch.randn(shape, generator=gen).to(dtype)
        expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        got = layer(x)
        assert got.shape == (*shape[:-1], layer.output_size) and got.dtype == dtype
        rtol, atol = TOL[dtype]
        scale = float(expected.abs().max())
        assert float((got.float() - expected).abs().max()) <= atol * scale + rtol * scale, (
            type(layer).__name__,
            shape,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("index", range(4), ids=["linear", "merged", "qkv", "row"])
def test_a_packed_linear_computes_the_dense_product(
    dtype: torch.dtype, bias: bool, index: int
) -> None:
    check_packed_matches_dense(_layers(bias)[index], dtype)


def test_packing_twice_is_packing_once() -> None:
    layer = Linear(16, 8)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 16)
    expected = layer(x)
    layer.process_weights_after_loading()
    packed = layer._packed
    layer.process_weights_after_loading()  # the weight is empty now: must not repack it
    assert layer._packed is packed
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_float16_stays_dense() -> None:
    layer = Linear(16, 8).half()
    torch.nn.init.normal_(layer.weight)
    layer.process_weights_after_loading()
    assert layer._packed is None and tuple(layer.weight.shape) == (8, 16)


def test_the_model_runner_packs_every_linear_on_cpu(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kvcache_blocks=64, max_model_len=256)
    layers = [m for m in llm.model_runner.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * llm.model_runner.layout.num_layers  # qkv, o, gate_up, down
    assert all(m._packed is not None for m in layers)


class PackedPathDropsBias(Linear):
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super().matmul(x, None if self._packed is not None else bias)


def test_the_check_catches_a_packed_path_without_its_bias() -> None:
    with pytest.raises(AssertionError):
        check_packed_matches_dense(PackedPathDropsBias(48, 40, bias=True), torch.float32)
