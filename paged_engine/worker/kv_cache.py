"""The paged KV pool: its layout, how many blocks it gets, and the one tensor behind it.

One tensor ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` holds the
whole pool; each attention layer gets its ``[num_blocks, block_size, kv_heads, head_dim]``
views of K and V. Block ids are the allocator's: block ``b`` of every layer belongs to the
sequence whose block table holds ``b``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_engine.config import EngineConfig, available_memory_bytes

logger = logging.getLogger("paged_engine")

AUTO_POOL_MEMORY_FRACTION = 0.5
"""The automatic CPU pool takes at most this share of the memory available at start (the
weights, not loaded yet, and activations need the rest)."""


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def pool_size(
    cfg: EngineConfig,
    layout: KVCacheLayout,
    device: torch.device,
    cuda_budget: Callable[[], int],
) -> int:
    """Blocks for the pool, refused when it cannot hold one ``max_model_len`` sequence.

    ``num_kvcache_blocks``, else on CUDA ``cuda_budget()`` bytes (a warm-up pass's
    measurement), else ``kv_cache_memory`` bytes, else (CPU, "auto") ``max_num_seqs``
    sequences of ``max_model_len`` tokens, capped at ``AUTO_POOL_MEMORY_FRACTION`` of the
    available memory (logged).
    """
    per_block = layout.bytes_per_block
    needed = cfg.max_blocks_per_seq()
    if cfg.num_kvcache_blocks is not None:
        blocks = cfg.num_kvcache_blocks
    elif device.type == "cuda":
        blocks = cuda_budget() // per_block
    elif cfg.kv_cache_memory is not None:
        blocks = cfg.kv_cache_memory // per_block
    else:
        return _auto_cpu_pool_size(cfg, layout, needed)
    if blocks < needed:
        raise ValueError(
            f"the KV pool ({blocks} blocks of {layout.block_size} tokens, "
            f"{per_block} bytes each) cannot hold one max_model_len={cfg.max_model_len} "
            f"sequence ({needed} blocks): raise kv_cache_memory / num_kvcache_blocks "
            "or lower max_model_len"
        )
    return blocks


def _auto_cpu_pool_size(cfg: EngineConfig, layout: KVCacheLayout, needed: int) -> int:
    """``max_num_seqs * max_blocks_per_seq()`` blocks, capped by free memory."""
    per_block = layout.bytes_per_block
    wanted = cfg.max_num_seqs * needed
    available = available_memory_bytes()
    share = AUTO_POOL_MEMORY_FRACTION
    blocks, why = wanted, ""
    if available is not None:
        cap = int(available * share) // per_block
        blocks = min(wanted, cap)
        why = f"{share:.0%} of the {available / 2**20:.0f} MiB of memory available"
    if blocks < needed:
        raise ValueError(
            f"the automatic KV pool (at most {why}: {blocks} blocks of {layout.block_size} "
            f"tokens, {per_block} bytes each) cannot hold one "
            f"max_model_len={cfg.max_model_len} sequence ({needed} blocks): lower "
            "max_model_len, free memory, or set kv_cache_memory / num_kvcache_blocks"
        )
    logger.info(
        "KV pool sized automatically: %d blocks (%.1f MiB), %s",
        blocks,
        blocks * per_block / 2**20,
        f"max_num_seqs={cfg.max_num_seqs} x max_model_len={cfg.max_model_len}"
        + (f", capped at {why}" if blocks < wanted else f" (within {why or 'no known limit'})"),
    )
    return blocks


def allocate_kv_cache(
    model: torch.nn.Module, layout: KVCacheLayout, num_blocks: int, device: torch.device
) -> torch.Tensor:
    """The pool tensor, with each attention layer's K and V views attached to it."""
    # torch.empty: pages are committed as blocks are first used; backends never read a
    # slot before it is written (the torch backend points padded positions it gathers at
    # a written slot of the same sequence).
    cache = torch.empty(
        2,
        layout.num_layers,
        num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
        dtype=layout.dtype,
        device=device,
    )
    layers = [m for m in model.modules() if hasattr(m, "k_cache") and hasattr(m, "backend")]
    for i, layer in enumerate(layers):
        layer.k_cache = cache[0, i]
        layer.v_cache = cache[1, i]
    return cache
