"""The prefill kernel's host-side decisions: tiles, warps, grid.

Pure arithmetic on shapes (no tensors, no Triton import), shared by the launcher, the
Triton backend (once per step) and scripts/compile_kernels.py, like ``decode_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_engine.kernels.decode_plan import next_power_of_2

__all__ = ["PrefillPlan", "default_tiles", "prefill_launch_plan"]


def default_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(query rows, keys, warps) per tile.

    16-bit: 128 x 32 with 8 warps up to D=128, 64 x 32 with 8 warps at D=256; float32 (a
    testing dtype, whose dots run on FMA units): 32 x 16 with 8 warps. The query rows are
    ``BLOCK_M`` tokens x the group's heads (padded to a power of two). scripts/
    compile_kernels.py (tox env ``compile``) fails CI when these spill registers on sm_80
    or sm_90 for Qwen3-family shapes (head dim 128, GQA groups 1-8, 16-bit); its ``--all``
    sweep reports every other head dim and group.
    """
    if dtype.itemsize >= 4:
        return 32, 16, 8
    if next_power_of_2(head_dim) <= 128:
        return 128, 32, 8
    return 64, 32, 8


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Everything a prefill launch decides on the host, from shapes and ``max_query_len``."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_query_len: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2

    @property
    def grid(self) -> tuple[int, int, int]:
        return (-(-self.max_query_len // self.block_m), self.batch, self.num_kv_heads)

    def constexprs(self) -> dict[str, int]:
        group = self.num_heads // self.num_kv_heads
        return {
            "NUM_KV_HEADS": self.num_kv_heads,
            "GROUP": group,
            "GROUP_P2": next_power_of_2(group),
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": next_power_of_2(self.head_dim),
            "BLOCK_SIZE": self.block_size,
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
        }


def prefill_launch_plan(
    *,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    dtype: torch.dtype,
    block_m: int | None = None,
    block_n: int | None = None,
) -> PrefillPlan:
    """The plan for these (already checked) shapes; see ``paged_prefill_attention``."""
    what = "paged_prefill_attention"
    group_p2 = next_power_of_2(num_heads // num_kv_heads)
    rows, default_n, num_warps = default_tiles(dtype, head_dim)
    if block_m is None:
        block_m = max(1, rows // group_p2)
    if block_n is None:
        block_n = default_n
    if block_m < 1 or block_m & (block_m - 1) or block_m * group_p2 < 16:
        raise ValueError(
            f"{what}: block_m must be a power of two with block_m * {group_p2} >= 16 rows, "
            f"got {block_m}"
        )
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{what}: block_n must be a power of two >= 16, got {block_n}")
    return PrefillPlan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_query_len=max_query_len,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
    )
