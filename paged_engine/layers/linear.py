"""Linear layers whose checkpoint shards load into fused parameters.

Hugging Face checkpoints store ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
as separate matrices; running them as one fused matmul saves kernel launches and reads the
input once. Each parameter carries a ``weight_loader(param, loaded_weight, shard_id)`` that
knows where a checkpoint shard lands in the fused matrix, so the loader never needs to know
the layout. Single device: no tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

ShardId = str | int | None


def _check_shape(param_part: torch.Tensor, loaded: torch.Tensor) -> None:
    """Raise a ValueError naming both shapes; the loader prefixes the tensor's name."""
    if tuple(param_part.shape) != tuple(loaded.shape):
        raise ValueError(f"expected shape {tuple(param_part.shape)}, got {tuple(loaded.shape)}")


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a whole-tensor weight loader."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(output_size), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.bias = None

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """Rows ``[start, end)`` of the output that ``shard_id`` fills: all of them here."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return 0, self.output_size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy ``loaded_weight`` into the rows of ``param`` that ``shard_id`` owns."""
        start, end = self.shard_range(shard_id)
        part = param.data.narrow(0, start, end - start)
        _check_shape(part, loaded_weight)
        part.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears of the same input stacked along the output (gate_up: shards 0, 1)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = tuple(output_sizes)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedLinear has shards 0..{len(self.output_sizes) - 1}, not {shard_id!r}"
            )
        start = sum(self.output_sizes[:shard_id])
        return start, start + self.output_sizes[shard_id]


class QKVLinear(Linear):
    """The fused query/key/value projection: rows ``[q | k | v]`` (shards "q", "k", "v")."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        starts = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        if shard_id not in starts:
            raise ValueError(f"QKVLinear has shards 'q', 'k', 'v', not {shard_id!r}")
        start = starts[shard_id]
        return start, start + (self.q_size if shard_id == "q" else self.kv_size)
