"""The torch backend's plain decode plan: every context of a decode step gathered at once.

A decode step attends each sequence's one new token over its whole context. The torch
backend gathers every context through its block table into one padded batch and runs one
SDPA call per layer; the slot indices and the padding mask are the same for every layer
of the step, so they are made once (``plain_plan``) and kept (``DecodePlan``). The other
decode plan, for sequences that share prefix blocks, is ``layers.cascade``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_engine.layers.attention.base import AttentionMetadata

__all__ = ["DecodePlan", "additive_mask", "plain_plan"]


@dataclass(slots=True, frozen=True)
class DecodePlan:
    """What every layer of one decode step reads, derived once per step."""

    index: torch.Tensor
    """``[num_seqs * L]`` int64: the cache slot of position ``j`` of sequence ``i`` at
    ``i * L + j`` (``L = max_seq_len``). Positions at or past a sequence's length point at
    its own first slot, which is always written: a padded position never reads a slot
    nothing wrote (the pool is uninitialised memory, NaN included)."""
    mask: torch.Tensor
    """``[num_seqs, 1, 1, L]`` additive (0 where ``j < seq_len_i``, else -inf) in the query
    dtype: made once per step, where a bool mask would be converted by every SDPA call."""


def plain_plan(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> DecodePlan:
    """``meta``'s decode step as one gather: each sequence's slots up to the batch's longest
    context, a padded position pointing at the sequence's own first slot, and the mask."""
    device = meta.block_tables.device
    num_seqs, length = meta.num_seqs, meta.max_seq_len
    tables = meta.block_tables[:, : -(-length // block_size)].long()
    first = tables[:, :1]
    tables = torch.where(tables < 0, first, tables)  # table padding: any real block
    offsets = torch.arange(block_size, device=device)
    slots = (tables[:, :, None] * block_size + offsets).view(num_seqs, -1)[:, :length]
    valid = torch.arange(length, device=device) < meta.seq_lens[:, None]
    return DecodePlan(
        index=torch.where(valid, slots, first * block_size).flatten(),
        mask=additive_mask(valid, dtype),
    )


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` bool (True = attend) -> ``[B, 1, 1, L]`` 0 / -inf in ``dtype``."""
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]
