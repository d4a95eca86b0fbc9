"""RMSNorm with Qwen3's exact numerics, and an optional fused residual add."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn


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
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

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
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
