"""Linear layers whose checkpoint shards load into fused parameters.

Hugging Face checkpoints store ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
as separate matrices; running them as one fused matmul saves kernel launches and reads the
input once. Each parameter carries a ``weight_loader(param, loaded_weight, shard_id)`` that
knows where a checkpoint shard lands in the fused matrix, so the loader never needs to know
the layout.

The tensor-parallel variants (``ColumnParallel``'s two fused forms and ``RowParallelLinear``,
rules in ``parallel.py``) hold one rank's slice. Their parameters also carry
``checkpoint_slice(shard_id, shape)``: the index of that slice in the checkpoint tensor,
so the loader reads only those bytes (safetensors ``get_slice``); None at one rank, where
the whole tensor is read as before. With a group of one they are the plain layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine import platform
from paged_engine.layers.parallel import SINGLE, TPGroup, kv_head_split, split

ShardId = str | int | None
Index = tuple[slice, ...]


def _check_shape(param_part: torch.Tensor, loaded: torch.Tensor) -> None:
    """Raise a ValueError naming both shapes; the loader prefixes the tensor's name."""
    if tuple(param_part.shape) != tuple(loaded.shape):
        raise ValueError(f"expected shape {tuple(param_part.shape)}, got {tuple(loaded.shape)}")


def packs(dtype: torch.dtype) -> bool:
    """Whether ``Linear.process_weights_after_loading`` packs a CPU weight of ``dtype`` for
    oneDNN on this machine (``platform.torch_cpu``): float32 wherever torch has oneDNN's
    linear ops, bfloat16 only where oneDNN also computes bfloat16 here (x86: AVX512BW, VL
    and DQ; elsewhere its reorder raises). Every other weight stays dense, on ``F.linear``,
    which computes every dtype on every CPU."""
    cpu = platform.torch_cpu()
    if not cpu.onednn_linear:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu.mkldnn_bf16)


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """``w`` reordered into oneDNN's blocked layout for ``packed_linear``, where ``packs``
    says this CPU can for its dtype; None for any other weight (another device included)."""
    if w.device.type != "cpu" or not packs(w.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)  # type: ignore[no-any-return]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ bias)`` for ``packed = pack_weight(W)``."""
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out  # type: ignore[no-any-return]


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a whole-tensor weight loader.

    On CPU, ``process_weights_after_loading`` (vLLM's name; the loader calls it once every
    weight is in) reorders the weight into oneDNN's blocked layout and matmuls through
    oneDNN from then on, as vLLM's CPU build does, where this machine's torch can
    (``packs``: float32 with oneDNN, bfloat16 only where oneDNN computes bfloat16; any
    other weight stays on ``F.linear``). Why: ``F.linear`` hands a plain row-major weight
    to the GEMM, which repacks it on every call; packed once, every call skips that work
    (``bench/test_linear_bench.py`` reports the ratios per projection and dtype; figures
    in the README). Cost: the packed copy replaces the dense weight (which is emptied,
    so memory does not double); ``weight`` then has 0 rows.
    The rounding is oneDNN's rather than MKL's: float32 results differ from ``F.linear``'s
    in the last bits (``tests/test_linear_packing.py`` bounds it).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self._packed: torch.Tensor | None = None
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

    def process_weights_after_loading(self) -> None:
        """Pack the weight for oneDNN (see the class), on CPU where ``packs`` says this
        machine can for its dtype, once; otherwise leave it dense."""
        if self._packed is not None:
            return
        self._packed = pack_weight(self.weight)
        if self._packed is not None:
            self.weight.data = self.weight.data.new_empty((0, self.input_size))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)``, through the packed weight when there is one."""
        if self._packed is None:
            return F.linear(x, self.weight, bias)
        return packed_linear(x, self._packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


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


# ---- tensor-parallel variants --------------------------------------------------------------


def _rows(full: int, shape: tuple[int, ...], first: int, count: int) -> Index:
    """Rows ``[first, first + count)`` of a checkpoint tensor with ``full`` rows."""
    if shape[0] != full:
        raise ValueError(f"expected {full} rows, got shape {shape}")
    return (slice(first, first + count),)


class QKVParallelLinear(QKVLinear):
    """This rank's query heads and KV heads (split or replicated: ``kv_head_split``),
    stacked ``[q | k | v]`` like ``QKVLinear``; the bias (if any) is sliced the same way."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup = SINGLE,
    ) -> None:
        q_first, q_count = split(num_heads, tp)
        kv_first, kv_count = kv_head_split(num_kv_heads, tp)
        super().__init__(hidden_size, head_dim, q_count, kv_count, bias)
        self.tp = tp
        d = head_dim
        self._full = {"q": (q_first * d, num_heads * d), "k": (kv_first * d, num_kv_heads * d)}
        self._full["v"] = self._full["k"]
        for p in self.parameters():
            p.checkpoint_slice = self.checkpoint_slice  # type: ignore[attr-defined]

    def checkpoint_slice(self, shard_id: ShardId, shape: tuple[int, ...]) -> Index | None:
        if self.tp.size == 1:
            return None
        start, end = self.shard_range(shard_id)  # refuses an unknown shard
        first, full = self._full[str(shard_id)]
        return _rows(full, shape, first, end - start)


class MergedColumnParallelLinear(MergedLinear):
    """This rank's ``1/N`` of each stacked output (gate_up: of each of gate and up)."""

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(input_size, [split(n, tp)[1] for n in output_sizes], bias)
        self.tp = tp
        self.full_sizes = tuple(output_sizes)
        for p in self.parameters():
            p.checkpoint_slice = self.checkpoint_slice  # type: ignore[attr-defined]

    def checkpoint_slice(self, shard_id: ShardId, shape: tuple[int, ...]) -> Index | None:
        if self.tp.size == 1:
            return None
        self.shard_range(shard_id)  # refuses an unknown shard
        full = self.full_sizes[int(shard_id)]  # type: ignore[arg-type]
        return _rows(full, shape, *split(full, self.tp))


class RowParallelLinear(Linear):
    """``x W^T``, ``x`` holding this rank's ``1/N`` of the input features and ``W`` the
    matching columns; the ranks' partial products are summed by one all-reduce, then
    the (replicated) bias is added once."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = SINGLE
    ) -> None:
        self.first_input, count = split(input_size, tp)
        super().__init__(count, output_size, bias)
        self.tp = tp
        self.full_input_size = input_size
        self.weight.checkpoint_slice = self.checkpoint_slice  # type: ignore[attr-defined]

    def checkpoint_slice(self, shard_id: ShardId, shape: tuple[int, ...]) -> Index | None:
        if self.tp.size == 1:
            return None
        if len(shape) != 2 or shape[1] != self.full_input_size:
            raise ValueError(f"expected {self.full_input_size} columns, got shape {shape}")
        return (slice(None), slice(self.first_input, self.first_input + self.input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias
