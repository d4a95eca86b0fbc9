"""The decode kernel's host-side decisions: tile size, warps, split-K plan, workspace.

Pure arithmetic on shapes (no tensors, no Triton import), so that the launcher, the
Triton backend (once per step), the CUDA memory warm-up (the split-K workspace it must
reserve) and scripts/compile_kernels.py (every plan, for GPUs this machine lacks) all
make the same choice from the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "LOG2E",
    "DecodePlan",
    "choose_num_splits",
    "decode_launch_plan",
    "default_block_n",
    "max_decode_workspace_bytes",
]

LOG2E = 1.4426950408889634
_MIN_PARTITION = 256
"""Fewest tokens worth a split of their own: below this, per-program overhead dominates."""
_MAX_PARTITION = 1024
"""Most tokens one program streams before the context is split anyway (tail balance)."""
_PROGRAMS_PER_SM = 8
"""Split until roughly this many programs per SM exist, so waves stay short and balanced."""
_MAX_SPLITS = 128


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """How many programs share one sequence's context (1 = no split, no merge kernel).

    Split when ``batch * num_kv_heads`` programs are too few to put ``_PROGRAMS_PER_SM`` on
    every SM, or when a context is long enough that one program would stream more than
    ``_MAX_PARTITION`` tokens; never make a split shorter than ``_MIN_PARTITION`` tokens. The
    partials cost ``B * H * splits * (D + 2)`` float32 writes and reads, well under 1% of the
    K/V bytes at these sizes.
    """
    work = max(1, batch * num_kv_heads)
    for_occupancy = math.ceil(_PROGRAMS_PER_SM * sm_count / work)
    for_length = math.ceil(max_context / _MAX_PARTITION)
    most = max(1, max_context // _MIN_PARTITION)
    return max(1, min(max(for_occupancy, for_length), most, _MAX_SPLITS))


def default_block_n(dtype: torch.dtype, head_dim: int) -> int:
    """Tokens per K/V tile: 32 for 16-bit caches, 16 for float32 (a testing dtype, whose
    dots run on FMA units). scripts/compile_kernels.py (tox env ``compile``) fails CI when
    these spill registers on sm_80 or sm_90 for Qwen3-family shapes (head dim 128, GQA
    groups 1-8, 16-bit); its ``--all`` sweep reports every other head dim and group."""
    del head_dim  # the same at every head dim (the sweep covers 16..256)
    return 16 if dtype.itemsize >= 4 else 32


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Everything a decode launch decides on the host, from static shapes only."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    table_width: int
    num_splits: int
    partition: int
    """Tokens per split, a multiple of ``block_n``."""
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    @property
    def workspace_bytes(self) -> int:
        """Bytes of float32 partials the split-K path allocates for one launch."""
        if not self.split:
            return 0
        return self.batch * self.num_heads * self.num_splits * (self.head_dim + 2) * 4

    def constexprs(self) -> dict[str, int | bool]:
        group = self.num_heads // self.num_kv_heads
        return {
            "NUM_KV_HEADS": self.num_kv_heads,
            "GROUP": group,
            "BLOCK_G": max(16, next_power_of_2(group)),
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": next_power_of_2(self.head_dim),
            "BLOCK_SIZE": self.block_size,
            "BLOCK_N": self.block_n,
            "SPLIT": self.split,
        }

    def merge_constexprs(self) -> dict[str, int]:
        return {
            "NUM_HEADS": self.num_heads,
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": next_power_of_2(self.head_dim),
            "BLOCK_S": next_power_of_2(self.num_splits),
        }


def decode_launch_plan(
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    table_width: int,
    dtype: torch.dtype,
    sm_count: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> DecodePlan:
    """The plan for these (already checked) shapes; see ``paged_decode_attention``."""
    if block_n is None:
        block_n = default_block_n(dtype, head_dim)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(
            f"paged_decode_attention: block_n must be a power of two >= 16, got {block_n}"
        )
    capacity = table_width * block_size
    max_context = max(1, capacity if max_seq_len is None else min(max_seq_len, capacity))
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, sm_count)
    num_splits = max(1, min(num_splits, cdiv(max_context, block_n)))
    partition = cdiv(cdiv(max_context, num_splits), block_n) * block_n
    return DecodePlan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        table_width=table_width,
        num_splits=cdiv(max_context, partition),
        partition=partition,
        block_n=block_n,
    )


def max_decode_workspace_bytes(
    *,
    max_num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    table_width: int,
    dtype: torch.dtype,
    sm_count: int,
) -> int:
    """The largest split-K workspace any decode batch of up to ``max_num_seqs`` sequences
    allocates (fewer sequences split more, so the maximum is not at the largest batch)."""
    return max(
        decode_launch_plan(
            batch=b,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            table_width=table_width,
            dtype=dtype,
            sm_count=sm_count,
        ).workspace_bytes
        for b in range(1, max_num_seqs + 1)
    )
