"""The Triton attention backend: our own kernels for the paged KV cache.

``store_kv`` (shared with flash-attn, in ``kernel_base``) scatters the step's K/V rows with
the store kernel; ``attend`` sends a decode step (one new token per sequence) to the
split-K decode kernel and anything else to the prefill kernel, which reads the whole context
(cached prefix + new tokens) through the block table. Both kernels run compiled on CUDA, or
on CPU under ``TRITON_INTERPRET=1`` (slowly; for tests), at any cache block size.

Arguments are checked and launches planned once per step and shape (``StepMemo``): the
step's other layers only pack arguments and launch.
"""

from __future__ import annotations

import torch

from paged_engine.kernels.launch import run_launches
from paged_engine.kernels.paged_decode_attention import decode_launches, plan_paged_decode
from paged_engine.kernels.paged_prefill_attention import plan_paged_prefill, prefill_launches
from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.dense import attend_uncached
from paged_engine.layers.attention.kernel_base import (
    KernelAttentionBackend,
    cache_is_empty,
    shape_key,
)
from paged_engine.layers.attention.requirements import triton_problem

__all__ = ["TritonAttentionBackend"]


class TritonAttentionBackend(KernelAttentionBackend):
    """Attention over the paged KV cache with this package's Triton kernels."""

    name = "triton"

    def __init__(
        self,
        block_size: int,
        dtype: torch.dtype,
        *,
        head_dim: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        problem = triton_problem(torch.device(device), block_size, dtype, head_dim)
        if problem is not None:
            raise ValueError(f"TritonAttentionBackend: {problem}")
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
        """Causal attention of the step's queries over each sequence's whole context.

        The decode kernel sizes its split plan from the block table's width rather than
        ``meta.max_seq_len``: the table is what CUDA-graph capture fixes, so a graph captured
        on short contexts still covers the long ones it replays.
        """
        if cache_is_empty(k_cache, meta):
            return attend_uncached(query, key, value, meta.query_lens_cpu, scale)
        tables, lens = meta.block_tables, meta.seq_lens
        out = torch.empty_like(query)
        if not meta.is_prefill:
            plan = self.memo.get(
                meta,
                ("decode", shape_key(query, k_cache, v_cache)),
                lambda: plan_paged_decode(query, k_cache, v_cache, tables, lens),
            )
            run_launches(decode_launches(plan, query, k_cache, v_cache, tables, lens, scale, out))
            return out
        qsl, max_q = meta.query_start_loc, meta.max_query_len
        prefill = self.memo.get(
            meta,
            ("prefill", shape_key(query, k_cache, v_cache)),
            lambda: plan_paged_prefill(query, k_cache, v_cache, tables, qsl, lens, max_q),
        )
        run_launches(
            prefill_launches(prefill, query, k_cache, v_cache, tables, qsl, lens, scale, out)
        )
        return out
