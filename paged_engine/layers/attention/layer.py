"""The model's attention layer: store this step's K/V, then attend through the backend."""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.attention.base import AttentionBackend
from paged_engine.layers.context import get_forward_context

__all__ = ["Attention"]


class Attention(nn.Module):
    """The model's attention op: store this step's K/V, then attend through the backend.

    ``k_cache``/``v_cache`` start empty; the model runner assigns this layer's views of the
    KV pool, ``[num_blocks, block_size, num_kv_heads, head_dim]``. They are plain
    attributes, not buffers, so they never enter a state dict or get moved by ``.to()``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[N, H*d]`` or ``[N, H, d]`` (k/v likewise with kv heads) → ``[N, H*d]``."""
        meta = get_forward_context()
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() != 0:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, meta)
        out = self.backend.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)
