"""Readable references for the fused small ops (``csrc/fused_ops.c``): plain torch, op for
op as transformers' Qwen3 computes them, so each states where the result is rounded.

* Residual adds happen in the model dtype.
* RMSNorm takes its statistics in float32 and casts the normalised row back to the model
  dtype *before* the weight multiply (``weight * x.to(input_dtype)``).
* Rotary is ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``; in
  bfloat16 each product and the sum are rounded to bfloat16, cos and sin too.
* The MLP's activation is ``silu(gate) * up``: in bfloat16 silu's result is rounded before
  the multiply.

The fused norms and rotation equal these bit for bit (float32 and bfloat16); the fused
activation is within a few float32 ulps of ``silu_and_mul_ref`` (its exp is glibc's, not
torch's), and so within one bfloat16 rounding step in bfloat16. tests/test_fused_ops.py
holds them together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm over the last axis (``weight`` broadcasts against it)."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rms_norm(residual + x), residual + x)``; ``(rms_norm(x), None)`` without one."""
    if residual is None:
        return rms_norm_ref(x, weight, eps), None
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` along the last axis."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_ref(
    qk: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Qwen3's q/k step: ``qk`` ``[N, heads, d]`` (q heads first), each head normed with its
    weight, then rotated by ``cos``/``sin`` ``[N, d]``; without weights (both None) the
    rotation alone. A new tensor."""
    normed = qk
    if q_weight is not None and k_weight is not None:
        q = rms_norm_ref(qk[:, :num_q_heads], q_weight, eps)
        k = rms_norm_ref(qk[:, num_q_heads:], k_weight, eps)
        normed = torch.cat((q, k), dim=1)
    return normed * cos[:, None, :] + rotate_half(normed) * sin[:, None, :]


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last axis."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
