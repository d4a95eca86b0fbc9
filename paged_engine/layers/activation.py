"""The gated activation of Qwen3's MLP.

On the CPU (float32 or bfloat16) it runs the compiled fused kernel
(``kernels/fused_ops_cpu.py``): one pass, no ``silu(gate)`` temporary. Its exp is glibc's,
so results are within a few float32 ulps of torch's ops (bfloat16: the same rounding
steps, rarely one bfloat16 step apart); torch's ops run everywhere else. A contiguous input
(the gate_up projection's output) reaches the kernel through ``kernels/fused_ops_layers.py``'s
one pass of checks; any other through the launcher's general path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.kernels.fused_ops_cpu import fused_ok, silu_and_mul_cpu
from paged_engine.kernels.fused_ops_layers import silu_and_mul_layer


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last axis.

    Works on the fused gate_up projection's output, so the MLP runs one matmul for both.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = silu_and_mul_layer(x)
        if fast is not None:
            return fast
        if fused_ok(x):
            return silu_and_mul_cpu(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
