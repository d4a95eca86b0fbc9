"""The attention kernels' references: plain float32 torch, one sequence at a time.

Readable rather than fast: each gathers a sequence's contiguous K/V through its block
table and computes softmax attention with the textbook formula. tests/test_kernels_*.py and
tests/test_cpu_kernel.py hold every kernel (Triton decode and prefill, the compiled CPU
decode kernel) to these.
"""

from __future__ import annotations

import torch

__all__ = ["gather_context_ref", "paged_decode_attention_ref", "paged_prefill_attention_ref"]


def gather_context_ref(
    cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence, ``[context_len, KVH, D]``, by table."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    if num_blocks and bool((blocks < 0).any()):
        raise ValueError("block table has a -1 entry inside the sequence's context")
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:context_len]


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference decode attention in plain float32 torch, one sequence at a time.

    Gathers each sequence's contiguous K/V through its block table, then computes
    ``softmax(q k^T * scale) v`` with query head ``h`` reading KV head ``h // (H // KVH)``.
    A sequence of length 0 yields zeros (flash-attn's convention for empty rows).
    """
    batch, num_heads, head_dim = query.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for b in range(batch):
        context_len = int(seq_lens[b])
        if context_len == 0:
            continue
        k = gather_context_ref(k_cache, block_tables[b], context_len).float()
        v = gather_context_ref(v_cache, block_tables[b], context_len).float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference prefill attention in plain float32 torch, one sequence at a time.

    Gathers the sequence's contiguous K/V through its block table, then computes
    ``softmax(q k^T * scale + causal_mask) v`` where new token ``m`` may see context positions
    ``<= seq_len - q_len + m``; query head ``h`` reads KV head ``h // (H // KVH)``.
    """
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for b in range(seq_lens.shape[0]):
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, context_len = q_end - q_start, int(seq_lens[b])
        if q_len == 0:
            continue
        if q_len > context_len:
            raise ValueError(f"sequence {b}: {q_len} new tokens but a context of {context_len}")
        k = gather_context_ref(k_cache, block_tables[b], context_len).float()
        v = gather_context_ref(v_cache, block_tables[b], context_len).float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        positions = torch.arange(context_len - q_len, context_len, device=query.device)
        visible = torch.arange(context_len, device=query.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q_start:q_end] = torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), v)
    return out.to(query.dtype)
