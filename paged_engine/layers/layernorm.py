"""RMSNorm with Qwen3's exact numerics, and an optional fused residual add.

On the CPU (float32 or bfloat16) ``RMSNorm`` runs the compiled fused kernel
(``kernels/fused_ops_cpu.py``): the add and the norm in one pass over each row, bit for bit
the torch ops below (which run everywhere else, and on the CPU where the kernel is not
built). At decode that is one call instead of about eight; bench/test_fused_ops_bench.py
measures both. Contiguous rows (a projection's output, the residual stream) reach the
kernel through ``kernels/fused_ops_layers.py``'s one pass of checks; strided ones through
the launcher's general path.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.kernels.fused_ops_cpu import MAX_COLS, add_rms_norm_cpu, fused_ok
from paged_engine.kernels.fused_ops_layers import add_rms_norm_layer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, in transformers' op order.

    ``weight`` broadcasts against ``x``: ``[hidden]`` for one norm, or e.g. ``[heads, d]``
    to run several per-head norms (Qwen3's q and k norms) as one call.

    In float32 the casts are no-ops and torch's ``rms_norm`` runs the same ops in one call
    (``x * rsqrt(mean(x^2) + eps)``, then the weight; products commute bit for bit), so it
    is used there; half dtypes keep transformers' cast-before-weight order, which it lacks.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if weight.shape == x.shape[-1:]:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, x.shape[-1:], None, eps)
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed like transformers' Qwen3RMSNorm.

    The statistics run in float32 and the result is cast back to the input dtype *before*
    the weight multiply, exactly as transformers does, so float32 outputs match bit for bit
    and half-precision ones round the same way.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``.

        The fused form lets a decoder layer carry the residual stream between its two norms
        without a separate add; the sum is taken in the model dtype, as transformers does.
        """
        fast = add_rms_norm_layer(x, residual, self.weight, self.eps)
        if fast is not None:
            return fast[0] if fast[1] is None else (fast[0], fast[1])
        if x.shape[-1] <= MAX_COLS and (
            fused_ok(x, self.weight) if residual is None else fused_ok(x, residual, self.weight)
        ):
            out, summed = add_rms_norm_cpu(x, residual, self.weight, self.eps)
            return out if summed is None else (out, summed)
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
