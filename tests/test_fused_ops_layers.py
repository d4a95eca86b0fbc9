"""The layer modules' calls into the fused CPU kernels (kernels/fused_ops_layers.py).

Where a call takes its tensors it must give the references' bits (the norms and the
rotation exactly, the activation the launcher's bits), write nothing else, and run the
level the platform allows; where it does not, it must answer None and leave every input as
it was, and the module must still give the references' result through its other paths.
Each mutant in tests/fused_layers_mutants/ (a patch of the module) must fail one of these
checks with an AssertionError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

import pytest
import torch

from paged_engine import platform
from paged_engine.kernels import fused_ops_cpu, fused_ops_layers
from paged_engine.kernels.cpu_library import ISA_CODES
from paged_engine.kernels.fused_ops_ref import (
    add_rms_norm_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from paged_engine.layers import activation, layernorm
from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.layernorm import RMSNorm
from paged_engine.layers.rotary import RopeSpec, RotaryEmbedding
from tests.patch_mutants import ROOT, import_copy, patched_copy, read_patch

F32, BF16 = torch.float32, torch.bfloat16
EPS = 1e-6
SOURCE = "paged_engine/kernels/fused_ops_layers.py"
MUTANTS = sorted(p.stem for p in (ROOT / "tests" / "fused_layers_mutants").glob("*.patch"))

pytestmark = pytest.mark.skipif(
    fused_ops_cpu.compiled() is None, reason="the compiled CPU kernels are not built"
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_norms(calls: ModuleType) -> None:
    """Both norms (with and without a residual) bit for bit the reference, inputs intact."""
    for rows, n, dtype, seed in [
        (1, 64, F32, 0),
        (5, 512, BF16, 1),
        (3, 9000, F32, 2),
        (4, 6, F32, 3),
    ]:
        g = _gen(seed)
        x, res = (
            (torch.randn(rows, n, generator=g) * 3).to(dtype),
            torch.randn(rows, n, generator=g).to(dtype),
        )
        weight = (torch.rand(n, generator=g) + 0.5).to(dtype)
        before = (x.clone(), res.clone())
        got = calls.add_rms_norm_layer(x, res, weight, EPS)
        assert got is not None, f"declined contiguous {dtype} rows {rows}x{n}"
        want = add_rms_norm_ref(x, res, weight, EPS)
        assert got[1] is not None and torch.equal(got[1], want[1]), (
            f"sum differs, {rows}x{n} {dtype}"
        )
        assert torch.equal(got[0], want[0]), f"norm differs, {rows}x{n} {dtype}"
        alone = calls.add_rms_norm_layer(x, None, weight, EPS)
        assert alone is not None and alone[1] is None
        assert torch.equal(alone[0], rms_norm_ref(x, weight, EPS)), (
            f"norm alone differs, {rows}x{n}"
        )
        assert torch.equal(x, before[0]) and torch.equal(res, before[1]), "an input was written"
    # rows in more than two dims, and no rows at all
    x3, r3 = torch.randn(2, 3, 40, generator=_gen(9)), torch.randn(2, 3, 40, generator=_gen(10))
    w3 = torch.rand(40, generator=_gen(11)) + 0.5
    got3 = calls.add_rms_norm_layer(x3, r3, w3, EPS)
    want3 = add_rms_norm_ref(x3, r3, w3, EPS)
    assert got3 is not None and got3[1] is not None, "declined 3-D rows"
    assert torch.equal(got3[0], want3[0]) and torch.equal(got3[1], want3[1]), "3-D rows differ"
    empty = calls.add_rms_norm_layer(torch.empty(0, 40), None, w3, EPS)
    assert empty is not None and empty[0].shape == (0, 40)


def check_rotation(calls: ModuleType) -> None:
    """q/k heads taken from a qkv output (tokens at its row stride): normed and rotated, or
    rotated alone, in place, bit for bit the reference; the v columns untouched."""
    rotary = RotaryEmbedding(16, RopeSpec(theta=1e4))
    for tokens, q_heads, kv_heads, dtype, normed in [
        (5, 4, 2, F32, True),
        (3, 6, 2, BF16, True),
        (4, 2, 1, F32, False),
    ]:
        g = _gen(tokens)
        qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * 16, generator=g) * 2).to(dtype)
        qk = qkv[:, : (q_heads + kv_heads) * 16].view(tokens, q_heads + kv_heads, 16)
        v_before, qk_before = qkv[:, qk.shape[1] * 16 :].clone(), qk.clone()
        positions = torch.arange(tokens) * 37 + 5
        cos, signed_sin = rotary.cos_signed_sin(positions, dtype)
        qw, kw = ((torch.rand(16, generator=g) + 0.5).to(dtype) for _ in range(2))
        if normed:
            plain_cos, plain_sin = rotary.cos_sin(positions, dtype)
            want = qk_norm_rope_ref(qk_before, qw, kw, q_heads, EPS, plain_cos, plain_sin)
            got = calls.qk_norm_rope_layer_(qk, qw, kw, q_heads, EPS, cos, signed_sin)
        else:
            want = rotary.rotate(positions, qk_before)
            got = calls.qk_norm_rope_layer_(qk, None, None, 0, 0.0, cos, signed_sin)
        assert got is qk, f"declined a qkv view, {dtype} normed={normed}"
        assert torch.equal(qk, want), f"rotation differs, {tokens} tokens {dtype} normed={normed}"
        assert torch.equal(qkv[:, qk.shape[1] * 16 :], v_before), "wrote into the v columns"
    # one token at a token stride no dense tensor has: the stride is never stepped over
    one = torch.randn(1, 3, 16, generator=_gen(12)).as_strided((1, 3, 16), (1000, 16, 1))
    before = one.clone()
    cos, signed_sin = rotary.cos_signed_sin(torch.tensor([9]), F32)
    assert calls.qk_norm_rope_layer_(one, None, None, 0, 0.0, cos, signed_sin) is one
    assert torch.equal(one, rotary.rotate(torch.tensor([9]), before)), "one token differs"


def check_activation(calls: ModuleType) -> None:
    """The launcher's bits (the same kernel and level), close to the reference."""
    for rows, width, dtype in [(1, 64, F32), (7, 3584, BF16), (3, 10, F32)]:
        x = (torch.randn(rows, width, generator=_gen(width)) * 4).to(dtype)
        before = x.clone()
        got = calls.silu_and_mul_layer(x)
        assert got is not None, f"declined contiguous {dtype} {rows}x{width}"
        assert torch.equal(got, fused_ops_cpu.silu_and_mul_cpu(x)), f"differs, {rows}x{width}"
        torch.testing.assert_close(got.float(), silu_and_mul_ref(x).float(), rtol=2**-6, atol=1e-6)
        assert torch.equal(x, before), "the input was written"


def _declines(what: str, call: Callable[[], Any], *inputs: torch.Tensor) -> None:
    before = [t.detach().clone() for t in inputs]
    assert call() is None, f"took {what}"
    assert all(torch.equal(t.detach(), b) for t, b in zip(inputs, before, strict=True)), what


def check_declines(calls: ModuleType) -> None:
    """None, and nothing written, for every tensor the kernels must not be handed."""
    g = _gen(7)
    wide, w = torch.randn(3, 80, generator=g), torch.rand(64, generator=g) + 0.5
    x, res = wide[:, :64], torch.randn(3, 64, generator=g)
    norm = calls.add_rms_norm_layer
    _declines("strided rows", lambda: norm(x, None, w, EPS), wide)
    _declines("a strided residual", lambda: norm(res, x, w, EPS), wide, res)
    _declines("float64", lambda: norm(res.double(), None, w.double(), EPS), res)
    _declines("mixed dtypes", lambda: norm(res, None, w.to(BF16), EPS), res)
    _declines("a residual of another shape", lambda: norm(res, res[:2], w, EPS), res)
    _declines("a weight of another length", lambda: norm(res, None, w[:32], EPS), res)
    _declines("a negated view", lambda: norm(torch._neg_view(res), None, w, EPS), res)
    grad_x = res.clone().requires_grad_()
    _declines("a tensor needing a gradient", lambda: norm(grad_x, None, w, EPS), grad_x)
    qkv = torch.randn(4, 5 * 16, generator=g)
    cos, sin = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    qw = torch.rand(16, generator=g)
    rope = calls.qk_norm_rope_layer_
    qk = qkv[:, : 4 * 16].view(4, 4, 16)
    spread = torch.randn(4, 4, 32, generator=g)[:, :, :16]  # heads 32 elements apart
    _declines("heads not contiguous", lambda: rope(spread, qw, qw, 2, EPS, cos, sin), spread)
    base = torch.randn(4 * 64 + 32, generator=g)
    columns = base.as_strided((4, 4, 16), (64, 16, 2))  # heads 16 apart, elements 2 apart
    _declines("a strided head", lambda: rope(columns, qw, qw, 2, EPS, cos, sin), base)
    overlapping = qkv[:1, :64].view(1, 4, 16).expand(4, 4, 16)  # four tokens, one memory
    _declines("tokens that overlap", lambda: rope(overlapping, qw, qw, 2, EPS, cos, sin), qkv)
    neg_qk = torch._neg_view(qkv)[:, :64].view(4, 4, 16)
    _declines("a negated qk", lambda: rope(neg_qk, qw, qw, 2, EPS, cos, sin), qkv)
    grad_qk = qkv.clone().requires_grad_()
    grad_view = grad_qk[:, :64].view(4, 4, 16)
    _declines("a qk needing a gradient", lambda: rope(grad_view, qw, qw, 2, EPS, cos, sin), qkv)
    _declines("bfloat16 cos", lambda: rope(qk, qw, qw, 2, EPS, cos.to(BF16), sin), qkv)
    _declines("a short weight", lambda: rope(qk, qw, qw[:8], 2, EPS, cos, sin), qkv)
    _declines("one weight", lambda: rope(qk, qw, None, 2, EPS, cos, sin), qkv)
    _declines("too many q heads", lambda: rope(qk, qw, qw, 5, EPS, cos, sin), qkv)
    _declines("cos of another shape", lambda: rope(qk, qw, qw, 2, EPS, cos[:3], sin[:3]), qkv)
    strided_cos = torch.randn(4, 32, generator=g)[:, :16]
    _declines("a strided cos", lambda: rope(qk, qw, qw, 2, EPS, strided_cos, sin), qkv)
    odd = torch.randn(4, 3, 15, generator=g)
    _declines(
        "an odd head dim", lambda: rope(odd, None, None, 0, 0.0, cos[:, :15], sin[:, :15]), odd
    )
    act = calls.silu_and_mul_layer
    _declines("an odd width", lambda: act(torch.randn(3, 9, generator=g)))
    _declines("strided rows", lambda: act(wide[:, :64]), wide)
    _declines("float64", lambda: act(res.double()), res)


def check_levels(calls: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call runs the first of ``isa_levels()``, and follows the platform when its
    ``CpuInfo`` changes (an older CPU, forced here)."""
    compiled = fused_ops_cpu.compiled()
    assert compiled is not None
    seen: list[int] = []

    class Levels:
        def __getattr__(self, name: str) -> Any:
            def call(*args: Any) -> Any:
                seen.append(args[-1])
                return getattr(compiled.module, name)(*args)

            return call

    x = torch.randn(3, 32)
    qk = torch.randn(3, 2, 16)
    cos_sin = (torch.ones(3, 16), torch.zeros(3, 16))

    def run_all() -> None:
        seen.clear()
        assert calls.add_rms_norm_layer(x, x, torch.ones(32), EPS) is not None
        assert calls.silu_and_mul_layer(x) is not None
        assert calls.qk_norm_rope_layer_(qk, None, None, 0, 0.0, *cos_sin) is not None

    monkeypatch.setattr(fused_ops_cpu, "_COMPILED", replace(compiled, module=Levels()))
    run_all()
    assert seen == [ISA_CODES[fused_ops_cpu.isa_levels()[0]]] * 3, seen
    baseline = replace(platform.cpu_info(), flags=frozenset())
    monkeypatch.setattr(platform, "cpu_info", lambda: baseline)
    run_all()
    assert seen == [ISA_CODES["baseline"]] * 3, f"the platform allows only the baseline: {seen}"


CHECKS: dict[str, Callable[[ModuleType], None]] = {
    "norms": check_norms,
    "rotation": check_rotation,
    "activation": check_activation,
    "declines": check_declines,
}


@pytest.mark.parametrize("check", CHECKS)
def test_the_layer_calls(check: str) -> None:
    CHECKS[check](fused_ops_layers)


def test_the_layer_calls_run_the_level_the_platform_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    check_levels(fused_ops_layers, monkeypatch)


def test_the_modules_give_the_references_result_where_the_layer_calls_decline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Strided rows go through the launcher's general path, a gradient through torch."""
    answers: list[bool] = []
    for module, name in [(layernorm, "add_rms_norm_layer"), (activation, "silu_and_mul_layer")]:
        real = getattr(module, name)

        def asked(*args: Any, _real: Any = real) -> Any:
            answer = _real(*args)
            answers.append(answer is None)
            return answer

        monkeypatch.setattr(module, name, asked)
    g = _gen(3)
    wide = torch.randn(4, 96, generator=g)
    norm = RMSNorm(64, eps=EPS)
    norm.weight.data.copy_(torch.rand(64, generator=g) + 0.5)
    x, res = wide[:, :64], torch.randn(4, 64, generator=g)
    out, summed = norm(x, res)
    want, want_sum = add_rms_norm_ref(x, res, norm.weight, EPS)
    assert torch.equal(out, want) and torch.equal(summed, want_sum)
    torch.testing.assert_close(SiluAndMul()(wide[:, :64]), silu_and_mul_ref(wide[:, :64]))
    grad_x = res.clone().requires_grad_()
    out = norm(grad_x)
    assert out.grad_fn is not None and torch.equal(out, rms_norm_ref(grad_x, norm.weight, EPS))
    assert answers == [True, True, True], f"the layer calls took a tensor: {answers}"


def _mutant(name: str) -> ModuleType:
    patch = read_patch(name, ROOT / "tests" / "fused_layers_mutants" / f"{name}.patch")
    return import_copy(f"_fused_layers_mutant_{name}", patched_copy(name, patch) / SOURCE)


@pytest.mark.parametrize("name", MUTANTS)
def test_each_mutant_fails_a_check_the_module_passes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name == "level_memo_ignores_platform" and len(fused_ops_cpu.isa_levels()) < 2:
        pytest.skip("one level here (the baseline): forcing the baseline changes nothing")
    mutant = _mutant(name)
    failed = []
    for check, run in [*CHECKS.items(), ("levels", lambda m: check_levels(m, monkeypatch))]:
        try:
            run(mutant)
        except AssertionError as exc:
            failed.append(f"{check}: {exc}")
    assert failed, f"mutant {name} passed every check"


def test_there_are_mutants() -> None:
    assert len(MUTANTS) >= 4, MUTANTS
