"""Attention over the paged KV cache: the batch layout, the backend interface, the layer.

Every backend (the torch oracle here, Triton and flash-attn beside it) implements the same
two operations so that the model, the model runner and the oracle tests never branch on
which one runs:

* ``store_kv`` writes this step's new K/V rows into their cache slots;
* ``attend`` computes causal attention for this step's queries against each sequence's
  whole context (cached prefix + the new tokens just stored), read through its block table.

Cache layout, per layer: ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``j`` of a sequence lives in
slot ``block_table[j // block_size] * block_size + j % block_size`` of the flattened
``[num_blocks * block_size, num_kv_heads, head_dim]`` view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """One step's batch layout, shared by every attention layer of the step.

    The batch's new tokens are packed: sequence ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]`` of q/k/v. Its context is ``seq_lens[i]``
    tokens; the first ``seq_lens[i] - query_len_i`` are already in the cache (a prefix-cache
    hit, an earlier prefill chunk, earlier decode steps) and the last ``query_len_i`` are this
    step's tokens, at positions ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``.
    """

    is_prefill: bool
    """False means a decode step: every sequence has exactly one new token."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` int64: cache slot of each new token; -1 means "do not store"."""
    query_start_loc: torch.Tensor
    """``[num_seqs + 1]`` int32: cumulative new-token counts (flash-attn's cu_seqlens_q)."""
    seq_start_loc: torch.Tensor
    """``[num_seqs + 1]`` int32: cumulative context lengths (flash-attn's cu_seqlens_k)."""
    seq_lens: torch.Tensor
    """``[num_seqs]`` int32: context length of each sequence after this step."""
    block_tables: torch.Tensor
    """``[num_seqs, max_blocks_per_seq]`` int32, rows padded with -1."""
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: tuple[int, ...]
    """Host copies of the per-sequence lengths, so backends never sync with the device."""
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def has_cached_prefix(self) -> bool:
        """True when some sequence attends to tokens it does not compute in this step."""
        return any(s != q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu, strict=True))


class AttentionBackend(Protocol):
    """What a KV-cache attention implementation provides. See the module docstring."""

    name: str

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to their slots."""
        ...

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
        """Causal attention for ``query`` ``[num_tokens, num_heads, head_dim]``.

        Called after ``store_kv``; ``key``/``value`` are this step's rows, for backends that
        prefer them over the cache when nothing is cached. An empty cache (``numel() == 0``,
        a warm-up pass before the pool is sized) means: attend over ``key``/``value`` only.
        Returns ``[num_tokens, num_heads, head_dim]``.
        """
        ...
