"""The gated activation of Qwen3's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last axis.

    Works on the fused gate_up projection's output, so the MLP runs one matmul for both.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
