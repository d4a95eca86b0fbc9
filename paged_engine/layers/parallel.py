"""Tensor parallelism as the layers see it: this rank's place in the group, the sharding
rules, and the two collectives the model needs.

A model built for rank ``r`` of ``N`` holds ``1/N`` of every large matrix (Megatron-LM's
layout, as vLLM and nano-vllm run it):

* QKV, gate_up: **column-parallel**. Each rank holds ``1/N`` of the attention heads and of
  the MLP's intermediate features, so attention and the activation run on local data.
* o_proj, down: **row-parallel**. Each rank multiplies its slice of the input features;
  the partial sums are added across ranks by one all-reduce of ``[tokens, hidden]``.
* Embedding: **vocabulary-parallel**. Each rank holds rows ``[r V/N, (r+1) V/N)``; a token
  outside them looks up zeros (the mask) and one all-reduce assembles the rows.
* LM head: each rank computes the logits of its vocabulary slice; rank 0 gathers them.

Cost per forward pass: ``2 L + 1`` all-reduces of ``[tokens, hidden]`` (``L`` layers) and
one gather of ``[sampled rows, V/N]`` per rank; ``bench/test_tp_costs_bench.py`` prints what
that is at Qwen3-0.6B's shapes.

**KV heads.** With ``num_key_value_heads >= N`` they are split like the query heads (each
rank holds ``kvh / N`` of them, so ``N`` must divide ``kvh``). With fewer KV heads than
ranks each KV head is *replicated*: ``N`` must be a multiple of ``kvh``, and rank ``r``
holds KV head ``r * kvh // N``, the one its query heads ``[r H/N, (r+1) H/N)`` attend to
(those queries lie in one group of ``H / kvh``, since ``N / kvh`` ranks share the head).
Each rank's KV pool holds only its own KV heads.

The group is passed to each layer at construction (never a global): a model built
without one is the single-device model, op for op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's rank in a tensor-parallel group of ``size`` ranks. ``size == 1``
    (``SINGLE``) is one device: no collective is ever called. The collectives run on
    torch.distributed's default process group, which ``worker/distributed.py`` creates."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' ``x`` concatenated along the last dimension, on rank 0; None on the
        others. Every rank must pass the same shape."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
"""One device, no tensor parallelism (immutable, so one shared instance is safe)."""


def split(total: int, tp: TPGroup) -> tuple[int, int]:
    """``(first, count)`` of this rank's equal share of ``total`` items (``check_divisible``
    has refused a remainder)."""
    count = total // tp.size
    return tp.rank * count, count


def kv_head_split(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """``(first, count)`` of the KV heads this rank holds: its share when there are at
    least as many KV heads as ranks, else the one replicated head its queries use (see
    the module docstring)."""
    if num_kv_heads >= tp.size:
        return split(num_kv_heads, tp)
    return tp.rank * num_kv_heads // tp.size, 1


def check_divisible(config: Any, size: int) -> None:
    """Refuse, naming the field, a model that ``size`` ranks cannot shard evenly: query
    heads, KV heads (split or replicated, see the module docstring), the MLP's
    intermediate size and the vocabulary must divide. Reads only config.json's fields."""
    if size == 1:
        return
    where = f"tensor_parallel_size={size}"
    for name in ("num_attention_heads", "intermediate_size", "vocab_size"):
        value = int(getattr(config, name))
        if value % size:
            raise ValueError(f"{name}={value} is not divisible by {where}")
    kvh = int(config.num_key_value_heads)
    if kvh >= size and kvh % size:
        raise ValueError(
            f"num_key_value_heads={kvh} is not divisible by {where} (KV heads are split "
            "across ranks when there are at least as many as ranks)"
        )
    if kvh < size and size % kvh:
        raise ValueError(
            f"num_key_value_heads={kvh} does not divide {where} (with fewer KV heads than "
            "ranks each KV head is replicated on tensor_parallel_size / num_key_value_heads "
            "ranks)"
        )
