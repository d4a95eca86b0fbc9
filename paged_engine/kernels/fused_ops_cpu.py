"""Launcher for the compiled fused small ops (``csrc/fused_ops.c``): residual add + RMSNorm,
per-head q/k RMSNorm + rotary in place, and silu(gate) * up, on CPU tensors.

The kernels read raw addresses, so everything they could misread is checked here first
(dtypes, devices, shapes, unit last strides) and a bad argument raises ``ValueError``
before anything is written. The readable references are in ``fused_ops_ref.py``. The layer
modules (``layers/layernorm.py``, ``rotary.py``, ``activation.py``) reach the kernels
through ``fused_ops_layers.py``'s one pass of checks where their tensors are the contiguous
ones a model step makes; otherwise through these launchers where ``fused_ok`` says the
tensors qualify, and torch's ops everywhere else.

The norms are bit for bit torch's op chain only if their mean square adds its squares in
the order of torch's own CPU sum, whose vector width depends on how torch was built and on
the CPU: ``torch_sum_lanes`` measures it once (a three-element probe, below) and without a
width the kernel knows, ``fused_ok`` is False and the modules stay on torch.

The kernels live in the ``_cpu_kernels`` library as a second module, ``_fused_ops``
(``cpu_library``, which binds it once): an older build without it leaves
``fused_ops_problem`` set and the modules on torch. Each op is compiled once per
instruction-set level (csrc/isa.h, as the decode kernel); every call runs the best of
``isa_levels()``, the levels the platform layer allows, unless a caller names one (``isa``,
for tests and bench/test_isa_levels_bench.py).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from paged_engine import platform
from paged_engine.kernels.cpu_library import CompiledModule, level_code, load_fused_module
from paged_engine.kernels.fused_ops_entry import (
    DTYPES,
    PARALLEL_MIN_ELEMENTS,
    run_add_rms_norm,
    run_qk_norm_rope,
    run_silu_and_mul,
    tokens_overlap,
)

__all__ = ["DTYPES", "MAX_COLS", "PARALLEL_MIN_ELEMENTS", "add_rms_norm_cpu", "compiled"]
__all__ += ["fused_ok"]
__all__ += ["fused_ops_problem", "isa_levels", "qk_norm_rope_cpu_", "silu_and_mul_cpu"]
__all__ += ["torch_sum_lanes"]

MAX_COLS = 16384
"""The longest row (hidden size or head dim) the norm kernels take (csrc's MAX_COLS)."""


_COMPILED, _PROBLEM = load_fused_module()
"""The compiled module (``_fused_ops``), bound once; or None, and why."""


def compiled() -> CompiledModule | None:
    """The bound module (None where ``fused_ops_problem`` says why), read at every call:
    tests swap it."""
    return _COMPILED


def fused_ops_problem() -> str | None:
    """Why the fused CPU kernels cannot be used, or None when they can."""
    return _PROBLEM


@cache
def torch_sum_lanes() -> int | None:
    """How many float32 lanes torch's CPU sum keeps apart (4 for aarch64's NEON vectors, 8
    for AVX2's, 16 for AVX-512's), or None when its order is not the lane cascade the
    kernels reproduce.

    The probe: ``2**24`` in element 0, ``-2**24`` in the last, ``1`` in element ``j``. The
    lanes are summed apart and then left to right from lane 0, so the 1 survives exactly
    when it shares the last element's lane (``1 - 2**24`` is exact; ``2**24 + 1`` is not).
    """
    n, big = 64, 2.0**24
    survivors = []
    for j in range(1, n - 1):
        x = torch.zeros(n, device="cpu")
        x[0], x[j], x[n - 1] = big, 1.0, -big
        if float(x.sum()) == 1.0:
            survivors.append(j)
    for lanes in (4, 8, 16):
        if survivors == [j for j in range(1, n - 1) if j % lanes == lanes - 1]:
            return lanes
    return None


def fused_ok(*tensors: torch.Tensor, sum_order: bool = True) -> bool:
    """Whether the kernels take these tensors: all on the CPU, all float32 or all bfloat16,
    with a unit last stride, none needing a gradient, and (unless ``sum_order`` is False:
    the rotation alone sums nothing) torch's sum order known to the kernels. A few
    attribute reads a tensor: the modules ask where ``fused_ops_layers`` declines."""
    if _COMPILED is None or (sum_order and torch_sum_lanes() is None):
        return False
    dtype = tensors[0].dtype
    if dtype not in DTYPES:
        return False
    grad = torch.is_grad_enabled()
    return all(
        t.is_cpu
        and t.dtype == dtype
        and not (grad and t.requires_grad)
        and (t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1)
        for t in tensors
    )


def _module(what: str) -> ModuleType:
    if _COMPILED is None:
        raise RuntimeError(f"{what}: {_PROBLEM}")
    return _COMPILED.module


def isa_levels() -> tuple[str, ...]:
    """The instruction-set levels (``cpu_library.ISA_CODES``' names) the kernels run at
    here, best first: those the built module has and this CPU executes (its own check) that
    the platform layer also finds the CPU's flags for (``platform.CpuInfo.isa_levels``);
    every call takes the first. Empty without the module."""
    if _COMPILED is None:
        return ()
    return _COMPILED.levels_allowed(platform.cpu_info().isa_levels)


def _lanes(what: str) -> int:
    lanes = torch_sum_lanes()
    if lanes is None:
        raise RuntimeError(f"{what}: torch's CPU sum order is not one this kernel reproduces")
    return lanes


def _check(what: str, dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    """Every tensor on the CPU, of ``dtype`` (float32 or bfloat16), with a unit last stride
    and no lazy negation (the kernel would read the raw, unnegated data)."""
    if dtype not in DTYPES:
        raise ValueError(f"{what}: only float32 and bfloat16 are supported, got {dtype}")
    for name, t in tensors.items():
        if not t.is_cpu:
            raise ValueError(f"{what}: {name} must be on the CPU, got {t.device}")
        if t.dtype != dtype:
            raise ValueError(f"{what}: {name} is {t.dtype}, expected {dtype} like the input")
        if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{what}: {name} needs a unit last stride, got {t.stride()}")
        if t.is_neg():
            raise ValueError(f"{what}: {name} is a lazily negated view; resolve_neg() it first")


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[rows, n]``: itself when 2-D, else a view where torch can make one (a
    copy otherwise); the last stride stays 1 either way."""
    return t if t.dim() == 2 else t.reshape(-1, n)


def add_rms_norm_cpu(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(x + residual) * weight, x + residual)``, or ``(rms_norm(x) * weight,
    None)`` without a residual, over the last axis; new tensors shaped like ``x``, the
    inputs untouched. Bit for bit ``fused_ops_ref.add_rms_norm_ref``, at every ``isa``
    (the instruction-set level, ``isa_levels``; None: the best here)."""
    what = "add_rms_norm_cpu"
    others = {} if residual is None else {"residual": residual}
    _check(what, x.dtype, x=x, weight=weight, **others)
    n = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.shape != (n,):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} must be [{n}], x's last axis")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"{what}: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if not 1 <= n <= MAX_COLS:
        raise ValueError(f"{what}: rows of {n} elements; 1 to {MAX_COLS} supported")
    module, lanes, level = _module(what), _lanes(what), level_code(what, isa, isa_levels())
    x2 = _rows(x, n)
    r2 = None if residual is None else _rows(residual, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    run_add_rms_norm(module, x2, r2, weight, out, res_out, eps, lanes, level)
    return out, res_out


def qk_norm_rope_cpu_(
    qk: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    *,
    isa: str | None = None,
) -> torch.Tensor:
    """Qwen3's q/k step in place on ``qk`` ``[N, heads, d]`` (q heads first, then k heads;
    heads contiguous within a token, tokens at any stride): each head RMSNormed with
    ``q_weight`` or ``k_weight`` ``[d]``, then rotated by ``cos`` and ``signed_sin``
    ``[N, d]`` (sin with its first half negated, ``RotaryEmbedding.cos_signed_sin``).
    Without weights (both None) the rotation alone (the families without a q/k norm).
    Returns ``qk``. Bit for bit ``fused_ops_ref.qk_norm_rope_ref``, at every ``isa`` (as
    ``add_rms_norm_cpu``'s)."""
    what = "qk_norm_rope_cpu_"
    given = {n: w for n, w in (("q_weight", q_weight), ("k_weight", k_weight)) if w is not None}
    if len(given) == 1:
        raise ValueError(f"{what}: give both q_weight and k_weight, or neither")
    _check(what, qk.dtype, qk=qk, cos=cos, sin=signed_sin, **given)
    if qk.dim() != 3 or qk.stride(1) != qk.shape[2]:
        raise ValueError(
            f"{what}: qk must be [tokens, heads, head_dim] with contiguous heads, got "
            f"shape {tuple(qk.shape)} strides {qk.stride()}"
        )
    tokens, heads, d = qk.shape
    if tokens_overlap(qk):
        raise ValueError(
            f"{what}: qk's tokens overlap: token stride {qk.stride(0)} is under heads * "
            f"head_dim = {heads * d}"
        )
    if not 0 <= num_q_heads <= heads:
        raise ValueError(f"{what}: num_q_heads {num_q_heads} is not in [0, {heads}]")
    if any(w.shape != (d,) for w in given.values()):
        shapes = ", ".join(f"{n} {tuple(w.shape)}" for n, w in given.items())
        raise ValueError(f"{what}: {shapes} must be [{d}]")
    if cos.shape != (tokens, d) or signed_sin.shape != (tokens, d):
        raise ValueError(
            f"{what}: cos {tuple(cos.shape)} and sin {tuple(signed_sin.shape)} must be "
            f"[{tokens}, {d}]"
        )
    if cos.stride(0) != signed_sin.stride(0):
        raise ValueError(f"{what}: cos and sin need one row stride, got {cos.stride()}")
    if d % 2 or not 2 <= d <= MAX_COLS:
        raise ValueError(f"{what}: head_dim {d} must be even and at most {MAX_COLS}")
    lanes = _lanes(what) if given else 16  # no norm, no sum: any width the kernel takes
    module, level = _module(what), level_code(what, isa, isa_levels())
    run_qk_norm_rope(
        module, qk, q_weight, k_weight, num_q_heads, eps, cos, signed_sin, lanes, level
    )
    return qk


def silu_and_mul_cpu(x: torch.Tensor, *, isa: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last axis: a new tensor with
    half of ``x``'s last axis. Close to ``fused_ops_ref.silu_and_mul_ref``, not equal (glibc's
    expf against torch's exp; see csrc/fused_ops.c), and in float32 the levels (``isa``, as
    ``add_rms_norm_cpu``'s) differ in the last bits too (each its own vector expf)."""
    what = "silu_and_mul_cpu"
    _check(what, x.dtype, x=x)
    width = x.shape[-1] if x.dim() else 1
    if width % 2:
        raise ValueError(f"{what}: the last axis must be even ([gate | up]), got {width}")
    module, level = _module(what), level_code(what, isa, isa_levels())
    x2 = _rows(x, width)
    d = width // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    run_silu_and_mul(module, x2, out.view(x2.shape[0], d), level)
    return out
