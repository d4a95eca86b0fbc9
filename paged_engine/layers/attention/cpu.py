"""The CPU attention backend: the torch backend with decode on the compiled kernel.

A decode step (one new token per sequence), which is most of a generation's steps, runs
``paged_decode_attention_cpu``: each context read once, straight from the paged pool, with
an online softmax, instead of torch's gather-then-attend. Everything else (prefill, a
cache-less warm-up, a dtype or head layout the kernel lacks) is the torch backend's path,
unchanged.
"""

from __future__ import annotations

import torch

from paged_engine.kernels.paged_decode_cpu import geometry_problem, paged_decode_attention_cpu
from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.requirements import cpu_problem
from paged_engine.layers.attention.torch_backend import TorchAttentionBackend

__all__ = ["CpuAttentionBackend"]


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention on the CPU: the compiled decode kernel, torch for the rest.

    Shared-prefix cascades (the torch backend's decode speed-up) are off: the kernel reads
    each shared block from the pool for every sequence, and blocks shared by consecutive
    sequences are still in the CPU's cache when the next one reads them.
    """

    name = "cpu"

    def __init__(self, block_size: int | None = None, dtype: torch.dtype | None = None) -> None:
        problem = cpu_problem(torch.device("cpu"), block_size or 1, dtype or torch.float32)
        if problem is not None:
            raise ValueError(f"CpuAttentionBackend: {problem}")
        super().__init__(block_size, dtype, shared_prefix_min_tokens=None)
        self._decode = paged_decode_attention_cpu  # an attribute: tests count its calls

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
        """Decode on the kernel when it can take the step; otherwise the torch backend."""
        if (
            meta.max_query_len == 1
            and k_cache.numel() != 0
            and query.dtype == k_cache.dtype
            and geometry_problem(query.shape[1], k_cache.shape[2], query.shape[2], query.dtype)
            is None
        ):
            return self._decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        return super().attend(query, key, value, k_cache, v_cache, meta, scale)
