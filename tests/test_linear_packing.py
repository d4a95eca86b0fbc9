"""Linear layers on oneDNN-packed weights (``Linear.process_weights_after_loading``), and
on dense ones where this machine's oneDNN cannot take the dtype.

The packed product must be ``F.linear`` with the checkpoint's weight, up to the GEMM's
rounding: float32 within 1e-5 relative (oneDNN's sums run in another order than MKL's),
bfloat16 within bfloat16's own rounding. The check is shown to fail on a mutant that
drops the bias on the packed path. bfloat16 packs only where oneDNN computes bfloat16
(torch's ``_is_mkldnn_bf16_supported``: AVX-512 on x86); elsewhere the weight stays dense
on ``F.linear``, which is tested on every CPU by telling the layer that oneDNN lacks
bfloat16 (the platform probe monkeypatched).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paged_engine import LLM, platform
from paged_engine.layers.linear import (
    Linear,
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
)

# What torch itself says, not what the code under test concluded from it.
ONEDNN = torch.backends.mkldnn.is_available()
ONEDNN_BF16 = ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
CAPABILITY = torch.backends.cpu.get_cpu_capability()
needs_onednn = pytest.mark.skipif(
    not ONEDNN, reason="torch.backends.mkldnn.is_available() is False"
)
needs_onednn_bf16 = pytest.mark.skipif(
    not ONEDNN_BF16,
    reason=f"torch.ops.mkldnn._is_mkldnn_bf16_supported() is False (CPU capability {CAPABILITY})",
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.fixture
def no_onednn_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as it is, but with oneDNN unable to compute bfloat16 (an AVX2 CPU)."""
    without = dataclasses.replace(platform.torch_cpu(), mkldnn_bf16=False)
    monkeypatch.setattr(platform, "torch_cpu", lambda: without)


def _layers(bias: bool) -> list[Linear]:
    return [
        Linear(48, 40, bias=bias),
        MergedLinear(48, [24, 24], bias=bias),
        QKVLinear(48, head_dim=8, num_heads=4, num_kv_heads=2, bias=bias),
        RowParallelLinear(48, 40, bias=bias),
    ]


def check_packed_matches_dense(layer: Linear, dtype: torch.dtype, packed: bool = True) -> None:
    """After ``process_weights_after_loading`` the layer is packed (its dense copy released)
    or, with ``packed`` False, still dense; either way it computes the dense product."""
    gen = torch.Generator().manual_seed(0)
    layer = layer.to(dtype)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    weight = layer.weight.detach().clone()
    bias = None if layer.bias is None else layer.bias.detach().clone()
    layer.process_weights_after_loading()
    if packed:
        assert layer._packed is not None
        assert tuple(layer.weight.shape) == (0, 48)  # the dense copy is released
    else:
        assert layer._packed is None
        assert torch.equal(layer.weight, weight)  # the dense weight stays, untouched
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


DTYPES = [
    pytest.param(torch.float32, marks=needs_onednn, id="float32"),
    pytest.param(torch.bfloat16, marks=needs_onednn_bf16, id="bfloat16"),
]
LAYERS = pytest.mark.parametrize("index", range(4), ids=["linear", "merged", "qkv", "row"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@LAYERS
def test_a_packed_linear_computes_the_dense_product(
    dtype: torch.dtype, bias: bool, index: int
) -> None:
    check_packed_matches_dense(_layers(bias)[index], dtype)


@pytest.mark.parametrize("bias", [False, True])
@LAYERS
def test_bfloat16_without_onednn_bf16_stays_dense_and_computes_the_product(
    no_onednn_bf16: None, bias: bool, index: int
) -> None:
    """The path every CPU without AVX-512 takes (and AVX-512 ones when told so): no
    packing, no crash, ``F.linear`` on the dense bfloat16 weight."""
    check_packed_matches_dense(_layers(bias)[index], torch.bfloat16, packed=False)


def test_bfloat16_packs_exactly_where_torch_says_onednn_computes_it() -> None:
    layer = Linear(16, 8).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    layer.process_weights_after_loading()  # never raises, whatever the CPU
    assert (layer._packed is not None) == ONEDNN_BF16, CAPABILITY


class PacksAFloat32Copy(Linear):
    """A wrong fallback: packs the bfloat16 weight widened to float32 (which oneDNN packs
    everywhere) instead of leaving it dense."""

    def process_weights_after_loading(self) -> None:
        weight = self.weight.detach().float()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)


@needs_onednn
def test_the_check_fails_on_a_fallback_that_packs_anyway(no_onednn_bf16: None) -> None:
    with pytest.raises(AssertionError):
        check_packed_matches_dense(PacksAFloat32Copy(48, 40), torch.bfloat16, packed=False)


@needs_onednn
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


@needs_onednn
def test_the_model_runner_packs_every_linear_on_cpu(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kvcache_blocks=64, max_model_len=256)
    layers = [m for m in llm.model_runner.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * llm.model_runner.layout.num_layers  # qkv, o, gate_up, down
    assert all(m._packed is not None for m in layers)


class PackedPathDropsBias(Linear):
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super().matmul(x, None if self._packed is not None else bias)


@needs_onednn
def test_the_check_catches_a_packed_path_without_its_bias() -> None:
    with pytest.raises(AssertionError):
        check_packed_matches_dense(PackedPathDropsBias(48, 40, bias=True), torch.float32)
