"""The layer modules' calls into the fused CPU kernels: one pass of checks, then the kernel.

``fused_ops_cpu``'s launchers serve any caller: rows at any stride, views, every bad argument
refused with a ``ValueError``. The layers used to ask ``fused_ok`` first and then call those
launchers, so each layer call ran two sets of checks, looked its instruction-set level up
again and allocated its outputs from a shape; at decode that Python took longer than the
kernel (bench/test_fused_ops_bench.py's ``launcher`` and ``fused`` columns time a call
both ways).

A layer's tensors are the contiguous outputs of the projection before it (the rotation's is
the q/k heads of the qkv output, contiguous within each token). So each call here asks, once,
only what a layer's tensors can differ in, and answers None where the kernels do not take
them; the module then runs the launcher's general path or torch, as before:

* every tensor on the CPU, of one kernel dtype, contiguous (the rotation: heads contiguous
  within a token, tokens at any stride), not a lazily negated view, and none needing a
  gradient while grad mode is on;
* the shapes the kernel reads (the weight ``[n]``, the residual like ``x``, the rows' width
  within ``MAX_COLS``), and torch's sum order known to the kernels (as ``fused_ok`` asked:
  the norms need it, and the activation keeps the rule it had; the rotation alone sums
  nothing).

Whatever passes is exactly what the launcher would have passed and computed the same way:
the same entry point, level (``fused_ops_cpu.isa_levels``'s first, whose answer is kept
until the platform's ``CpuInfo`` changes) and thread count, so the bits are the launcher's
(tests/test_fused_ops_layers.py compares them).
"""

from __future__ import annotations

import torch

from paged_engine import platform
from paged_engine.kernels import fused_ops_cpu
from paged_engine.kernels.cpu_library import ISA_CODES
from paged_engine.kernels.fused_ops_cpu import MAX_COLS
from paged_engine.kernels.fused_ops_entry import (
    DTYPES,
    run_add_rms_norm,
    run_qk_norm_rope,
    run_silu_and_mul,
    tokens_overlap,
)

__all__ = ["add_rms_norm_layer", "qk_norm_rope_layer_", "silu_and_mul_layer"]

_level_memo: tuple[object, object, int] | None = None
"""(the ``CpuInfo`` and compiled module it was read for, the level's code): ``isa_levels``
reads both, and tests replace either, so the answer is kept per pair of objects."""


def _level(compiled: object) -> int:
    global _level_memo
    info = platform.cpu_info()
    memo = _level_memo
    if memo is None or memo[0] is not info or memo[1] is not compiled:
        memo = _level_memo = (info, compiled, ISA_CODES[fused_ops_cpu.isa_levels()[0]])
    return memo[2]


def _plain(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """All on the CPU, of ``dtype``, contiguous, not negated views, none needing a
    gradient where one would be recorded."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or not t.is_contiguous() or t.is_neg():
            return False
        if grad and t.requires_grad:
            return False
    return True


def add_rms_norm_layer(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``fused_ops_cpu.add_rms_norm_cpu(x, residual, weight, eps)`` for a layer's tensors,
    or None where they are not ones this path takes (see the module)."""
    compiled = fused_ops_cpu.compiled()
    dtype = x.dtype
    if compiled is None or not x.is_cpu or dtype not in DTYPES or x.dim() == 0:
        return None
    n = x.shape[-1]
    if not 1 <= n <= MAX_COLS or weight.shape != (n,):
        return None
    if residual is None:
        if not _plain(dtype, x, weight):
            return None
    elif residual.shape != x.shape or not _plain(dtype, x, residual, weight):
        return None
    lanes = fused_ops_cpu.torch_sum_lanes()
    if lanes is None:
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = None if residual is None else torch.empty_like(out)
    rows = x.numel() // n
    x2 = x.view(rows, n)
    r2 = None if residual is None else residual.view(rows, n)
    run_add_rms_norm(compiled.module, x2, r2, weight, out, res_out, eps, lanes, _level(compiled))
    return out, res_out


def qk_norm_rope_layer_(
    qk: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
) -> torch.Tensor | None:
    """``fused_ops_cpu.qk_norm_rope_cpu_`` (in place, returning ``qk``) for a layer's
    ``qk`` ``[N, heads, d]`` (heads contiguous within a token, tokens at any stride) and a
    step's ``cos``/``signed_sin`` ``[N, d]``, with both weights or neither; or None where
    they are not ones this path takes, with ``qk`` untouched."""
    compiled = fused_ops_cpu.compiled()
    dtype = qk.dtype
    if compiled is None or not qk.is_cpu or dtype not in DTYPES or qk.dim() != 3:
        return None
    tokens, heads, d = qk.shape
    if qk.stride(2) != 1 or qk.stride(1) != d or d % 2 or not 2 <= d <= MAX_COLS:
        return None
    if tokens_overlap(qk):
        return None
    if not 0 <= num_q_heads <= heads or (q_weight is None) != (k_weight is None):
        return None
    if qk.is_neg() or (qk.requires_grad and torch.is_grad_enabled()):
        return None
    if cos.shape != (tokens, d) or signed_sin.shape != (tokens, d):
        return None
    weights = () if q_weight is None or k_weight is None else (q_weight, k_weight)
    if any(w.shape != (d,) for w in weights) or not _plain(dtype, cos, signed_sin, *weights):
        return None
    lanes = fused_ops_cpu.torch_sum_lanes() if weights else 16  # the rotation sums nothing
    if lanes is None:
        return None
    run_qk_norm_rope(
        compiled.module,
        qk,
        q_weight,
        k_weight,
        num_q_heads,
        eps,
        cos,
        signed_sin,
        lanes,
        _level(compiled),
    )
    return qk


def silu_and_mul_layer(x: torch.Tensor) -> torch.Tensor | None:
    """``fused_ops_cpu.silu_and_mul_cpu(x)`` for a layer's ``x = [gate | up]``, or None
    where it is not one this path takes."""
    compiled = fused_ops_cpu.compiled()
    dtype = x.dtype
    if compiled is None or not x.is_cpu or dtype not in DTYPES or x.dim() == 0:
        return None
    # as fused_ok did: the kernels only where torch's sum order is known, though this sums nothing
    if not _plain(dtype, x) or fused_ops_cpu.torch_sum_lanes() is None:
        return None
    width = x.shape[-1]
    if width % 2:
        return None
    d = width // 2
    out = x.new_empty((*x.shape[:-1], d))
    rows = x.numel() // width if width else 0
    run_silu_and_mul(compiled.module, x.view(rows, width), out.view(rows, d), _level(compiled))
    return out
