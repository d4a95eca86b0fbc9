"""What every attention backend shares: one step's batch layout and the backend interface.

Every backend (torch, the compiled CPU kernel, Triton, flash-attn; one module each beside
this one) implements the same two operations, so that the model, the model runner and the
oracle tests never branch on which one runs:

* ``store_kv`` writes this step's new K/V rows into their cache slots;
* ``attend`` computes causal attention for this step's queries against each sequence's
  whole context (cached prefix + the new tokens just stored), read through its block table.

Cache layout, per layer: ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``j`` of a sequence lives in
slot ``block_table[j // block_size] * block_size + j % block_size`` of the flattened
``[num_blocks * block_size, num_kv_heads, head_dim]`` view.

This module imports no backend: each backend imports it, ``selection`` imports them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from paged_engine.engine.indexing import slot_mapping
from paged_engine.layers.attention.staging import HostStaging

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "HostMetadata",
    "make_attention_metadata",
]


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
    block_tables_cpu: tuple[tuple[int, ...], ...] = ()
    """Host copy of the block tables (unpadded); empty when the caller did not provide one
    (backends then use ``block_tables``). The torch backend plans shared-prefix decode
    attention from it without a device sync."""
    slots_all_valid: bool | None = None
    """Host knowledge of ``slot_mapping``: True when no slot is -1, False when some are,
    None when unknown (a backend that must know then reads the tensor, a device sync on
    CUDA). ``make_attention_metadata`` always sets it."""

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
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to their slots.

        ``meta``, when given, is the step ``slot_mapping`` belongs to: its host-side fields
        let a backend skip work (and device syncs) it would otherwise derive from tensors.
        """
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


@dataclass(slots=True, frozen=True)
class HostMetadata:
    """A step's layout on the host: the arrays to copy, and the fields that stay here.

    ``make_attention_metadata`` builds one, copies ``arrays()`` with a ``HostStaging`` and
    wraps the device tensors with ``on_device``; the model runner does the same but adds its
    own arrays (token ids, positions) to the same copy.
    """

    is_prefill: bool
    slots: np.ndarray
    query_start_loc: np.ndarray
    seq_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_tables_cpu: tuple[tuple[int, ...], ...]

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        is_prefill: bool | None = None,
    ) -> HostMetadata:
        """See ``make_attention_metadata``."""
        if len(query_lens) != len(seq_lens) or (
            block_tables and len(block_tables) != len(seq_lens)
        ):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per sequence"
            )
        slots: list[int] = []
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if not 1 <= q_len <= s_len:
                raise ValueError(
                    f"sequence {i}: need 1 <= query_len <= seq_len, got {q_len}, {s_len}"
                )
            if block_tables:
                slots.extend(slot_mapping(list(block_tables[i]), block_size, s_len - q_len, s_len))
            else:
                slots.extend([-1] * q_len)
        width = max((len(row) for row in block_tables), default=0)
        # numpy, not torch.tensor: quicker on ragged host lists, and this runs every step
        tables = np.full((len(seq_lens), width), -1, dtype=np.int32)
        for i, row in enumerate(block_tables):
            tables[i, : len(row)] = row
        return HostMetadata(
            is_prefill=max(query_lens) > 1 if is_prefill is None else is_prefill,
            slots=np.asarray(slots, dtype=np.int64),
            query_start_loc=np.asarray([0, *itertools.accumulate(query_lens)], dtype=np.int32),
            seq_start_loc=np.asarray([0, *itertools.accumulate(seq_lens)], dtype=np.int32),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            block_tables=tables,
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
            block_tables_cpu=tuple(map(tuple, block_tables)),
        )

    def arrays(self) -> list[tuple[np.ndarray, torch.dtype]]:
        """The device tensors' contents, in ``on_device``'s order."""
        i32 = torch.int32
        return [
            (self.slots, torch.int64),
            (self.query_start_loc, i32),
            (self.seq_start_loc, i32),
            (self.seq_lens, i32),
            (self.block_tables, i32),
        ]

    def on_device(self, tensors: Sequence[torch.Tensor]) -> AttentionMetadata:
        slots, qsl, ssl, lens, tables = tensors
        return AttentionMetadata(
            is_prefill=self.is_prefill,
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_start_loc=ssl,
            seq_lens=lens,
            block_tables=tables,
            max_query_len=max(self.query_lens_cpu),
            max_seq_len=max(self.seq_lens_cpu),
            query_lens_cpu=self.query_lens_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
            block_tables_cpu=self.block_tables_cpu,
            slots_all_valid=bool(self.slots.size == 0 or self.slots.min() >= 0),
        )


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    is_prefill: bool | None = None,
    *,
    staging: HostStaging | None = None,
) -> AttentionMetadata:
    """One step's layout from plain lists: the model runner's, and tests'.

    Sequence ``i``'s new tokens are the last ``query_lens[i]`` of its ``seq_lens[i]``-token
    context; their slots come from its block table through ``engine.indexing.slot_mapping``
    (the arithmetic CrossHair checks). Empty ``block_tables`` (no cache yet: warm-up) give
    slot -1 everywhere and a ``[num_seqs, 0]`` table. ``is_prefill`` defaults to "some
    sequence has more than one new token". ``staging`` (one per device, reused across
    steps, on ``device``) makes the copies asynchronous; without one they are plain copies.
    """
    host = HostMetadata.build(query_lens, seq_lens, block_tables, block_size, is_prefill)
    staging = staging or HostStaging(torch.device(device), pin=False)
    return host.on_device(staging.stage(host.arrays()))
