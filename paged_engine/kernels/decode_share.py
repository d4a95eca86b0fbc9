"""Shared-prefix groups for the CPU decode kernel (``csrc/paged_decode_share.h``).

Sequences whose block tables begin with the same blocks (a cached system prompt, the
``n`` samples of one prompt) attend over the same K/V rows. The kernel's share pass scores
a group's query heads together against those rows, each row read once for the group, and
every member then attends over the rest of its context from the state the pass left. The
output is the same bits as without the groups where ``same_bits`` says so (most layouts;
``tests/test_cpu_kernel_share.py``): only the work is shared.

``DecodeShare`` is what one call takes: built once per step from host data (the "cpu"
backend plans it from the step's host block tables), valid for every layer of the step.
The kernel checks it again in C before any read (a row in two groups, a member whose table
differs from its group's, a start that is not whole blocks or lies past the context: a
ValueError naming it); ``decode_share`` checks what it can on the host first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DecodeShare", "decode_share", "same_bits"]


def same_bits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a call with groups gives exactly the bits of the call without them for this
    head layout: where each kv head has 2 or more query heads and head_dim is 32 or more
    (tests/test_cpu_kernel_share.py). Elsewhere the results agree to float32 rounding, not
    to the bit: GCC's fast-math orders the sums of the plain copies for one query head per
    kv head, and for head_dim 16, its own way, and the share pass cannot follow it."""
    return heads // kv_heads >= 2 and head_dim >= 32


@dataclass(frozen=True, slots=True)
class DecodeShare:
    """The groups of one decode call, as the kernel reads them (int32, contiguous, CPU)."""

    starts: torch.Tensor
    """``[batch]``: the tokens row ``b``'s group shares (whole blocks), 0 outside groups."""
    rows: torch.Tensor
    """The groups' batch rows, group after group."""
    bounds: torch.Tensor
    """``[groups + 1]``: group ``g`` is ``rows[bounds[g]:bounds[g + 1]]``."""

    def __post_init__(self) -> None:
        # What the kernel reads as raw int32 arrays, so that it reads nothing beyond them.
        arrays = (self.starts, self.rows, self.bounds)
        if any(
            t.dtype != torch.int32
            or t.dim() != 1
            or not t.is_contiguous()
            or t.device.type != "cpu"
            for t in arrays
        ):
            raise ValueError(
                "DecodeShare: starts, rows and bounds must be 1-D contiguous int32 on the CPU"
            )
        if self.bounds.numel() < 2:
            raise ValueError("DecodeShare: bounds must hold one group at least")
        if self.rows.numel() < int(self.bounds.max()):
            raise ValueError(
                f"DecodeShare: bounds reach row {int(self.bounds.max())} of {self.rows.numel()}"
            )

    @property
    def groups(self) -> int:
        return self.bounds.numel() - 1

    def kernel_args(self, batch: int) -> tuple[int, int, int, int]:
        """The trailing arguments of ``paged_decode_f32`` / ``paged_decode_bf16`` for a
        call of ``batch`` sequences (a ValueError when the groups are for another batch)."""
        if self.starts.numel() != batch:
            raise ValueError(
                f"DecodeShare: starts has {self.starts.numel()} rows for a batch of {batch}"
            )
        return (self.starts.data_ptr(), self.rows.data_ptr(), self.bounds.data_ptr(), self.groups)


def decode_share(
    groups: Sequence[tuple[Sequence[int], int]], batch: int, block_size: int
) -> DecodeShare | None:
    """The kernel's form of ``groups``: each a pair (batch rows, shared tokens), the rows'
    tables beginning with the same ``shared tokens / block_size`` blocks. None when there is
    no group; a ValueError for a group of no rows, rows outside ``batch`` or in two groups,
    or a token count that is not a positive number of whole blocks."""
    if not groups:
        return None
    starts = [0] * batch
    rows: list[int] = []
    bounds = [0]
    for g, (members, tokens) in enumerate(groups):
        if not members or tokens <= 0 or tokens % block_size:
            raise ValueError(
                f"decode_share: group {g} has {len(members)} rows and {tokens} shared tokens; "
                f"a group needs rows and a positive multiple of the block size {block_size}"
            )
        for b in members:
            if not 0 <= b < batch or starts[b]:
                raise ValueError(
                    f"decode_share: group {g}'s row {b} lies outside the batch of {batch} or "
                    "in another group"
                )
            starts[b] = tokens
        rows.extend(members)
        bounds.append(len(rows))
    i32 = torch.int32
    return DecodeShare(
        torch.tensor(starts, dtype=i32),
        torch.tensor(rows, dtype=i32),
        torch.tensor(bounds, dtype=i32),
    )
