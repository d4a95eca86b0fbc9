"""The flash-attn backend: Tri Dao's kernels for attention, our Triton kernel for the store.

* Decode: ``flash_attn_with_kvcache`` with ``cache_seqlens`` and ``block_table`` (the query is
  ``[B, 1, H, D]``; with one query row, ``causal=True`` lets it see the whole context).
* Prefill with a cached prefix (prefix-cache hit, later prefill chunk):
  ``flash_attn_varlen_func`` on the cache itself, with ``block_table=``, ``cu_seqlens_k`` the
  cumulative *context* lengths and ``causal=True``; flash-attn aligns the causal mask to the
  bottom-right corner, i.e. the new tokens are the context's last ones, which is our layout.
* Prefill without a prefix, and the warm-up pass on an empty cache: plain varlen attention
  over the step's own K/V, which skips the block-table indirection.

flash-attn is optional and CUDA-only, so it is imported in the constructor, which refuses
with ``requirements.flash_attn_problem``'s reason any configuration flash-attn cannot run
(the same function "auto" consults before falling back to Triton).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.kernel_base import KernelAttentionBackend, cache_is_empty
from paged_engine.layers.attention.requirements import flash_attn_problem

__all__ = ["FlashAttnBackend"]


class FlashAttnBackend(KernelAttentionBackend):
    """Attention over the paged KV cache with flash-attn (>= 2.6, for ``block_table``)."""

    name = "flash-attn"

    def __init__(
        self,
        block_size: int,
        dtype: torch.dtype,
        *,
        head_dim: int | None = None,
        device: torch.device | str = "cuda",
    ) -> None:
        problem = flash_attn_problem(torch.device(device), block_size, dtype, head_dim)
        if problem is not None:
            raise ValueError(f"FlashAttnBackend: {problem}")
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:
            raise ValueError(
                f"FlashAttnBackend: flash-attn is not importable ({exc}); "
                "install it with `pip install flash-attn>=2.6`"
            ) from exc
        self._varlen: Callable[..., torch.Tensor] = flash_attn_varlen_func
        self._with_kvcache: Callable[..., torch.Tensor] = flash_attn_with_kvcache
        # The base class brings the store: our Triton kernel (flash-attn has no scatter).
        super().__init__(block_size, dtype)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of the step's queries over each sequence's whole context."""
        if not cache_is_empty(k_cache, meta) and not meta.is_prefill:
            out = self._with_kvcache(
                query.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        # A cached prefix is read from the cache through the block table; otherwise (an empty
        # cache included) each context is the sequence's own new rows, so the context lengths
        # are the query lengths.
        paged = meta.has_cached_prefix
        return self._varlen(
            query,
            k_cache if paged else key,
            v_cache if paged else value,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.seq_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables if paged else None,
        )
