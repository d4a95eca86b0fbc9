"""The torch backend: paged attention in plain torch, the CPU path and the last fallback.

It is also what the compiled CPU backend falls back to for everything but float32 decode.
Correct on any device, and never syncs with it: every decision (which rows to store, how
long a gather is, which sequences share a prefix) is made from the step's host-side
metadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.dense import attend_uncached, causal_bias, sdpa
from paged_engine.layers.attention.gather import DecodePlan, plain_plan
from paged_engine.layers.attention.mixed import MixedSplit, split_mixed
from paged_engine.layers.cascade import (
    CascadePlan,
    SharedPrefix,
    cascade_decode,
    find_shared_prefixes,
    make_plan,
)

__all__ = ["SHARED_PREFIX_MIN_TOKENS", "TorchAttentionBackend"]


SHARED_PREFIX_MIN_TOKENS = 512
"""Default ``TorchAttentionBackend(shared_prefix_min_tokens=...)``; see its docstring."""


class TorchAttentionBackend:
    """Paged attention in plain torch: gathers each context through its block table.

    Correct on any device; on CPU the reference path (the "cpu" backend replaces its
    float32 decode with a compiled kernel). A decode step (one new token per sequence) is
    one batched SDPA call per layer over every context, gathered through the block tables
    (slot indices and mask built once per step and shared by every layer); when sequences
    of the batch share prefix blocks, it is cascade attention instead (``layers.cascade``):
    each shared prefix attended once for its whole group. Prefill loops over sequences;
    one whose context is all new attends over its own K/V rows without touching the cache.
    A mixed step's leading decodes go the decode way, through ``attend`` (so a subclass's
    decode path takes them), and its chunks the prefill way (``layers.attention.mixed``).

    ``shared_prefix_min_tokens``: the gathered positions per layer a shared-prefix group
    must save to be attended as a cascade (``None`` turns cascades off). The default is
    where the cascade's extra tensor ops cost about what the gather they save does, on CPU.
    """

    name = "torch"
    supports_cuda_graphs = False
    """Decode gathers ``meta.max_seq_len`` positions and plans cascades from host data:
    values a captured graph would freeze at capture time."""

    def __init__(
        self,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        shared_prefix_min_tokens: int | None = SHARED_PREFIX_MIN_TOKENS,
    ) -> None:
        # Accepted for a uniform constructor with the other backends; the layout is read from
        # the cache tensors themselves.
        self.block_size = block_size
        self.dtype = dtype
        if shared_prefix_min_tokens is not None and shared_prefix_min_tokens < 0:
            raise ValueError(
                f"shared_prefix_min_tokens must be >= 0 or None, got {shared_prefix_min_tokens}"
            )
        self.shared_prefix_min_tokens = shared_prefix_min_tokens
        # Per-step values derived from the step's metadata, shared by all layers. Keyed by
        # identity: the metadata (frozen) and slot mapping are built once per step; holding
        # them keeps their ids from being reused while the memo lives.
        self._decode_memo: (
            tuple[AttentionMetadata, tuple[int, torch.dtype, int], DecodePlan | CascadePlan] | None
        ) = None
        self._store_memo: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._prefill_memo: (
            tuple[
                AttentionMetadata,
                tuple[int, torch.dtype],
                list[tuple[torch.Tensor, torch.Tensor] | None],
            ]
            | None
        ) = None
        self._mixed_memo: tuple[AttentionMetadata, MixedSplit | None] | None = None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Copy the rows whose slot is not -1 into the flattened cache (in place).

        Whether any slot is -1 is read from ``meta.slots_all_valid`` (host data) when the
        caller knows it; otherwise from the tensor, which on CUDA is a device sync (once per
        step: the answer is kept for the step's other layers).
        """
        if k_cache.numel() == 0:
            return
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        memo = self._store_memo
        if memo is not None and memo[0] is slot_mapping:
            valid = memo[1]
        else:
            # None: every row is stored (the usual case), so no row selection is needed.
            known = None if meta is None else meta.slots_all_valid
            if known is None:
                known = bool((slot_mapping >= 0).all())
            valid = None if known else (slot_mapping >= 0).nonzero().squeeze(1)
            self._store_memo = (slot_mapping, valid)
        if valid is None:
            slots = slot_mapping.long()
        else:
            slots = slot_mapping.index_select(0, valid).long()
            key, value = key.index_select(0, valid), value.index_select(0, valid)
        k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, value.to(v_flat.dtype))

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
        """Causal attention of each sequence's new tokens over its whole context."""
        if k_cache.numel() == 0:
            if meta.has_cached_prefix:
                raise ValueError("attention over a cached prefix needs a KV cache; it is empty")
            return attend_uncached(query, key, value, meta.query_lens_cpu, scale)
        if meta.max_query_len == 1:  # decode, or prefill chunks of one token each
            return self._attend_gathered(query, k_cache, v_cache, meta, scale)
        split = self._mixed_split(meta)
        if split is None:
            return self._attend_prefill(query, key, value, k_cache, v_cache, meta, scale)
        # A mixed step: its decodes as a decode step (through attend, so that a subclass's
        # decode path takes them), its chunks as a prefill step (not cut again).
        n, caches = split.rows, (k_cache, v_cache)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        out[:n] = self.attend(query[:n], key[:n], value[:n], *caches, split.decode, scale)
        out[n:] = self._attend_prefill(query[n:], key[n:], value[n:], *caches, split.rest, scale)
        return out

    def _attend_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Sequence by sequence: SDPA over the gathered context (causal mask), or over its
        own rows when nothing of it is cached."""
        out = torch.empty_like(query)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        gathers = self._prefill_plan(meta, k_cache.shape[1], query.dtype)
        start = 0
        for q_len, gather in zip(meta.query_lens_cpu, gathers, strict=True):
            end = start + q_len
            q = query[start:end].transpose(0, 1)[None]  # [1, H, n, d]
            if gather is None:  # nothing cached: the context is this step's own rows
                k, v = key[start:end], value[start:end]
                mask, causal = None, True
            else:
                slots, mask = gather
                k = k_flat.index_select(0, slots).to(query.dtype)
                v = v_flat.index_select(0, slots).to(query.dtype)
                causal = False
            o = sdpa(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, mask, causal)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    def _mixed_split(self, meta: AttentionMetadata) -> MixedSplit | None:
        """``split_mixed(meta)``, made by the step's first layer for all of them."""
        memo = self._mixed_memo
        if memo is None or memo[0] is not meta:
            memo = self._mixed_memo = (meta, split_mixed(meta))
        return memo[1]

    def _prefill_plan(
        self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per sequence of a step with new rows over a cached prefix, the cache slots of its
        context and its causal mask (``causal_bias``); None for a sequence with nothing
        cached. The same for every layer of the step, so made once per step."""
        key = (block_size, dtype)
        memo = self._prefill_memo
        if memo is not None and memo[0] is meta and memo[1] == key:
            return memo[2]
        device = meta.block_tables.device
        offsets = torch.arange(block_size, device=device)
        plan: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, (q_len, ctx_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            if q_len == ctx_len:
                plan.append(None)
                continue
            blocks = meta.block_tables[i, : -(-ctx_len // block_size)].long()
            slots = (blocks[:, None] * block_size + offsets).flatten()[:ctx_len]
            plan.append((slots, causal_bias(q_len, ctx_len, dtype, device)))
        self._prefill_memo = (meta, key, plan)
        return plan

    def _decode_plan(
        self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype, num_kv_heads: int
    ) -> DecodePlan | CascadePlan:
        key = (block_size, dtype, num_kv_heads)
        memo = self._decode_memo
        if memo is not None and memo[0] is meta and memo[1] == key:
            return memo[2]
        plan: DecodePlan | CascadePlan
        groups: tuple[SharedPrefix, ...] = ()
        if self.shared_prefix_min_tokens is not None and meta.block_tables_cpu:
            groups = find_shared_prefixes(
                meta.block_tables_cpu,
                meta.seq_lens_cpu,
                meta.query_lens_cpu,
                block_size,
                self.shared_prefix_min_tokens,
            )
        if groups:
            plan = make_plan(
                groups,
                meta.block_tables,
                meta.block_tables_cpu,
                meta.seq_lens_cpu,
                block_size,
                num_kv_heads,
            )
        else:
            plan = plain_plan(meta, block_size, dtype)
        self._decode_memo = (meta, key, plan)
        return plan

    def _attend_gathered(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One new token per sequence: gather every context at once, one SDPA call.

        Each context is read up to the batch's longest; the positions past a sequence's
        length read its own first slot (see ``DecodePlan``) and are masked out. The
        ``group`` query heads of one kv head ride SDPA's query-row axis, so K/V are never
        repeated per head.
        """
        num_seqs, num_heads, d = query.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        plan = self._decode_plan(meta, block_size, query.dtype, num_kv_heads)
        if isinstance(plan, CascadePlan):
            return cascade_decode(query, k_cache, v_cache, plan, scale)
        row = num_kv_heads * d
        shape = (num_seqs, meta.max_seq_len, num_kv_heads, d)
        k = k_cache.view(-1, row).index_select(0, plan.index).view(shape).transpose(1, 2)
        v = v_cache.view(-1, row).index_select(0, plan.index).view(shape).transpose(1, 2)
        q = query.view(num_seqs, num_kv_heads, group, d)
        k, v = k.to(query.dtype), v.to(query.dtype)  # [B, kvh, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
        return out.reshape(num_seqs, num_heads, d)
