"""The CPU attention backend: the torch backend with decode on the compiled kernel.

A decode step (one new token per sequence), which is most of a generation's steps, runs
``paged_decode_attention_cpu``: each context read once, straight from the paged pool, with
an online softmax, instead of torch's gather-then-attend. So do the decode rows of a mixed
step (S2m: the running sequences' decodes first, then prefill chunks): the step's leading
one-token sequences go to the kernel, the chunks after them to the torch backend (which cuts
the step: ``layers.attention.mixed``). float32 and bfloat16 caches alike (bfloat16 with
AVX512-BF16 dot products where the CPU has them, float32 arithmetic throughout). The step's
new K/V rows go into the pool through the compiled row copy (``store_kv_cpu``) instead of
torch's element-wise ``index_copy_``. Everything else (prefill attention, a cache-less
warm-up, a dtype or head layout the kernel lacks) is the torch backend's path, unchanged.

The launcher's shape, stride and dtype checks would be paid by every layer of every decode
step, in Python, for arguments laid out alike; they run once per step and argument layout
instead (``StepMemo``, as the Triton backend does), and the kernel checks block ids and
lengths in C on every call.
"""

from __future__ import annotations

from typing import Any

import torch

from paged_engine.kernels.decode_share import DecodeShare, decode_share, same_bits
from paged_engine.kernels.paged_decode_cpu import (
    DecodeLaunch,
    check_paged_decode_cpu,
    geometry_problem,
    run_paged_decode_cpu,
)
from paged_engine.kernels.store_kv_cpu import check_store_kv_cpu, run_store_kv_cpu
from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.kernel_base import StepMemo
from paged_engine.layers.attention.requirements import cpu_problem
from paged_engine.layers.attention.torch_backend import TorchAttentionBackend
from paged_engine.layers.cascade import find_shared_prefixes

__all__ = ["CpuAttentionBackend"]


def _layout(*tensors: torch.Tensor) -> tuple[Any, ...]:
    """Everything the launcher's checks read from ``tensors``."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.is_neg(), t.is_conj()) for t in tensors)


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention on the CPU: the compiled decode kernel, torch for the rest.

    The torch backend's shared-prefix cascades are off; the kernel has its own: with
    ``share_prefixes`` the decode sequences that begin with the same blocks are found once
    per step from the host block tables (``layers.cascade.find_shared_prefixes``) and handed
    to the kernel as groups (``kernels.decode_share``), whose query heads it scores together
    against the shared rows, only where that gives the same bits as without groups
    (``decode_share.same_bits``), so that a sequence's output never depends on its batch.
    None (the default) shares in bfloat16, where it measured faster, and not in float32,
    where it did not (``bench/test_prefix_order_bench.py``'s ``shared`` layout).

    ``bf16_variant`` picks the bfloat16 kernel ("auto", "avx512bf16" or "portable"; see
    ``paged_decode_cpu.bf16_variants``), for benchmarks and tests of each.
    """

    name = "cpu"

    def __init__(
        self,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        bf16_variant: str = "auto",
        share_prefixes: bool | None = None,
    ) -> None:
        dtype = dtype or torch.float32
        problem = cpu_problem(torch.device("cpu"), block_size or 1, dtype)
        if problem is not None:
            raise ValueError(f"CpuAttentionBackend: {problem}")
        if bf16_variant != "auto":
            from paged_engine.kernels.paged_decode_cpu import bf16_variants

            if dtype != torch.bfloat16 or bf16_variant not in bf16_variants():
                raise ValueError(
                    f"CpuAttentionBackend: bf16_variant {bf16_variant!r} needs dtype bfloat16 "
                    f"and one of {bf16_variants()} (got dtype {dtype})"
                )
        super().__init__(block_size, dtype, shared_prefix_min_tokens=None)
        self.bf16_variant = bf16_variant
        self.share_prefixes = dtype == torch.bfloat16 if share_prefixes is None else share_prefixes
        self._checks = StepMemo()
        self._shares = StepMemo()
        self._store_checks = StepMemo()  # its own: a step's store and decode key differently

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        """The compiled row copy, checked once per step and argument layout; the torch
        backend's store where the rows' dtype is not the cache's (it converts them)."""
        if k_cache.numel() == 0 or key.dtype != k_cache.dtype:
            super().store_kv(key, value, k_cache, v_cache, slot_mapping, meta)
            return
        key_layout = _layout(key, value, k_cache, v_cache, slot_mapping)
        launch = self._store_checks.get(
            slot_mapping if meta is None else meta,
            key_layout,
            lambda: check_store_kv_cpu(key, value, k_cache, v_cache, slot_mapping),
        )
        run_store_kv_cpu(launch, key, value, k_cache, v_cache, slot_mapping)

    def _decode_checked_per_step(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        share: DecodeShare | None = None,
    ) -> torch.Tensor:
        """The launcher, its checks made once per step (a step's block table is one tensor
        for all its layers) and argument layout."""
        key = _layout(query, k_cache, v_cache, block_tables, seq_lens)
        launch: DecodeLaunch = self._checks.get(
            block_tables,
            key,
            lambda: check_paged_decode_cpu(
                query, k_cache, v_cache, block_tables, seq_lens, bf16_variant=self.bf16_variant
            ),
        )
        return run_paged_decode_cpu(
            launch, query, k_cache, v_cache, block_tables, seq_lens, scale, share=share
        )

    def _share(self, meta: AttentionMetadata, block_size: int) -> DecodeShare | None:
        """The step's shared-prefix groups (once per step), or None."""
        if not self.share_prefixes or not meta.block_tables_cpu:
            return None

        def plan() -> DecodeShare | None:
            groups = find_shared_prefixes(
                meta.block_tables_cpu, meta.seq_lens_cpu, meta.query_lens_cpu, block_size, 1
            )
            pairs = [(g.seqs, len(g.blocks) * block_size) for g in groups]
            return decode_share(pairs, meta.num_seqs, block_size)

        share: DecodeShare | None = self._shares.get(meta, block_size, plan)
        return share

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
        """Decode on the kernel when it can take the step; otherwise the torch backend,
        which sends a mixed step's decodes back here as a decode step of their own."""
        if (
            meta.max_query_len == 1
            and k_cache.numel() != 0
            and query.dtype == k_cache.dtype
            and geometry_problem(query.shape[1], k_cache.shape[2], query.shape[2], query.dtype)
            is None
        ):
            layout = (query.shape[1], k_cache.shape[2], query.shape[2])
            share = self._share(meta, k_cache.shape[1]) if same_bits(*layout) else None
            return self._decode_checked_per_step(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, share
            )
        return super().attend(query, key, value, k_cache, v_cache, meta, scale)
