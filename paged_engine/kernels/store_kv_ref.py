"""The store kernel's reference (``store_kv``): the scatter in plain torch, for the tests to
hold the Triton kernel to."""

from __future__ import annotations

import torch

__all__ = ["store_kv_ref"]


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference scatter, in plain torch: ``cache.flat[slot] = row`` for every slot != -1."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep]
