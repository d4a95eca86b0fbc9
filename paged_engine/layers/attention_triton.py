"""The Triton attention backend: our own kernels for the paged KV cache.

``store_kv`` (shared with flash-attn, in ``attention_kernel``) scatters the step's K/V rows
with the store kernel; ``attend`` sends a decode step (one new token per sequence) to the
split-K decode kernel and anything else to the prefill kernel, which reads the whole context
(cached prefix + new tokens) through the block table. Both kernels run compiled on CUDA, or
on CPU under ``TRITON_INTERPRET=1`` (slowly; for tests), which is why the constructor checks
that one of the two is really available.
"""

from __future__ import annotations

import torch

from paged_engine.kernels.paged_decode_attention import is_interpreted, paged_decode_attention
from paged_engine.kernels.paged_prefill_attention import paged_prefill_attention
from paged_engine.kernels.store_kv import INTERPRETER_DTYPES, SUPPORTED_DTYPES
from paged_engine.layers.attention import AttentionMetadata, attend_uncached
from paged_engine.layers.attention_kernel import KernelAttentionBackend, cache_is_empty


def triton_backend_problem(block_size: int, dtype: torch.dtype) -> str | None:
    """Why the Triton backend cannot run with this configuration here, or None if it can."""
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        return f"block_size must be a positive power of two, got {block_size!r}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported; use float16, bfloat16 or float32"
    interpreted = is_interpreted()
    if not interpreted and not torch.cuda.is_available():
        return (
            "no CUDA device, and the Triton kernels were not built for the CPU interpreter: "
            "set TRITON_INTERPRET=1 before paged_engine.kernels is first imported"
        )
    if interpreted and dtype not in INTERPRETER_DTYPES:
        return (
            f"dtype {dtype} is unsupported under TRITON_INTERPRET=1 (the interpreter's bfloat16 "
            "arithmetic is broken); use float16 or float32 there, or run on CUDA"
        )
    return None


class TritonAttentionBackend(KernelAttentionBackend):
    """Attention over the paged KV cache with this package's Triton kernels."""

    name = "triton"

    def __init__(self, block_size: int, dtype: torch.dtype) -> None:
        problem = triton_backend_problem(block_size, dtype)
        if problem is not None:
            raise ValueError(f"TritonAttentionBackend: {problem}")
        super().__init__(block_size, dtype)
        # Attributes, so that tests can swap in a mutant launcher (tests/kernel_mutants.py).
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention

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
        if not meta.is_prefill:
            return self._decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return self._prefill(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_query_len,
            scale,
        )
