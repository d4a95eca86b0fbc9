"""What the Triton and flash-attn backends share.

Both store K/V with this package's Triton scatter kernel, and both attend with kernels that
read the paged cache, so both must tell an empty cache apart: the warm-up pass that measures
peak memory runs before the KV pool exists, stores nothing, and attends over the step's own
K/V rows. Nothing here imports Triton at module level, so importing the flash-attn backend
stays free of it.
"""

from __future__ import annotations

import torch

from paged_engine.layers.attention import AttentionMetadata


class KernelAttentionBackend:
    """The store half of a kernel backend; subclasses add ``name`` and ``attend``."""

    def __init__(self, block_size: int, dtype: torch.dtype) -> None:
        from paged_engine.kernels.store_kv import store_kv

        self._store_kv = store_kv
        self.block_size = block_size
        self.dtype = dtype

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter the rows whose slot is not -1 into the cache; no-op on an empty cache."""
        if k_cache.numel() == 0:
            return
        self._store_kv(key, value, k_cache, v_cache, slot_mapping)


def cache_is_empty(k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether ``attend`` runs without a cache (warm-up), where every context is the step's
    own rows; a step that needs a cached prefix cannot run so and is refused."""
    if k_cache.numel() != 0:
        return False
    if meta.has_cached_prefix:
        raise ValueError("attention over a cached prefix needs a KV cache; it is empty")
    return True
