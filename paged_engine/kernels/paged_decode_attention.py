"""Decode attention over the paged KV cache: one new query token per sequence.

Decode is memory-bound: every step streams each sequence's whole K/V context once and does
little arithmetic per byte. The kernel is shaped around that:

* **One program per (sequence, KV head, context split).** All ``G = H // KVH`` query heads
  that share a KV head are processed together as the rows of one ``[G, D]`` query tile, so
  each K/V tile is loaded from memory once, not ``G`` times. The rows are padded to 16 so the
  score and value products can use ``tl.dot`` (tensor cores); the padding costs arithmetic,
  which decode has to spare, not bandwidth.
* **Block table walked per token.** A tile of ``BLOCK_N`` logical tokens gathers each token's
  physical block id from the block table, so the tile size is independent of the cache block
  size (any block size works, from 1 to thousands) and tiles may straddle blocks.
* **Split-K ("flash-decoding").** With few sequences, or long contexts, ``B * KVH`` programs
  cannot keep every SM streaming, and one very long sequence would serialise the tail of the
  step. The context is then cut into ``num_splits`` partitions handled by separate programs,
  each writing an un-normalised partial output plus its running max and sum (float32); a
  second small kernel merges the partials with the usual log-sum-exp rescaling.
* **Online softmax in float32**, in base 2 (the softmax scale is folded with ``log2(e)``).

The number of splits is a host-side decision made from static shapes only (batch size, KV
heads, the block table's width) so it never needs a device sync and stays fixed under CUDA
graph capture.
"""

# Triton kernels cannot carry Python annotations on their parameters (Triton reads
# annotations as specialisation hints), and triton.jit is untyped: exempt just those two checks.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from paged_engine.kernels.store_kv import (
    check_int_vector,
    check_launchable,
    check_query_and_tables,
    kernel_is_interpreted,
)

_LOG2E = 1.4426950408889634
_MIN_PARTITION = 256
"""Fewest tokens worth a split of their own: below this, per-program overhead dominates."""
_MAX_PARTITION = 1024
"""Most tokens one program streams before the context is split anyway (tail balance)."""
_PROGRAMS_PER_SM = 8
"""Split until roughly this many programs per SM exist, so waves stay short and balanced."""
_MAX_SPLITS = 128


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


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    max_blocks,
    stride_cb,
    stride_ct,
    stride_ch,
    partition_size,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    # Deliberate bugs for tests/kernel_mutants.py; the defaults are the correct kernel.
    MUTANT_BLOCK_WALK_FLOOR: tl.constexpr = False,
    MUTANT_GQA_INTERLEAVED: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Never walk past the block table's width, whatever seq_lens says: a bad length then
    # yields a wrong answer instead of an out-of-bounds read.
    context_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE)
    if MUTANT_BLOCK_WALK_FLOOR:
        # Off by one block: counts whole blocks (floor) instead of cdiv, dropping the tail.
        context_len = (context_len // BLOCK_SIZE) * BLOCK_SIZE
    start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    if MUTANT_GQA_INTERLEAVED:  # noqa: SIM108 (keep the two mappings side by side)
        heads = offs_g * NUM_KV_HEADS + kv_head  # wrong: query head h -> KV head h % KVH
    else:
        heads = kv_head * GROUP + offs_g  # query head h -> KV head h // GROUP
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # A finite floor instead of -inf keeps exp2(m_old - m_new) well-defined for empty splits.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = n_mask[None, :] & d_mask[:, None]
        k_t = tl.load(k_cache_ptr + rows[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)
        scores = tl.dot(q, k_t, input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + rows[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partials are [B, H, num_splits, (D)]; the merge kernel reads one (B, H) row of them.
        row = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program per (sequence, query head): rescale each split's partial to the global max
    # and normalise once. Empty splits carry l = 0 and m = -1e30, so they weigh nothing.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=-1.0e30)
    l_part = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
    total = tl.sum(w * l_part, axis=0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (1 off-GPU, where occupancy is moot)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """How many programs share one sequence's context (1 = no split, no merge kernel).

    Split when ``batch * num_kv_heads`` programs are too few to put ``_PROGRAMS_PER_SM`` on
    every SM, or when a context is long enough that one program would stream more than
    ``_MAX_PARTITION`` tokens; never make a split shorter than ``_MIN_PARTITION`` tokens. The
    partials cost ``B * H * splits * (D + 2)`` float32 writes and reads, well under 1% of the
    K/V bytes at these sizes. E.g. H200 (132 SMs), B=64, KVH=8: context 2048 -> 3 splits,
    8192 -> 8 splits; B=1, KVH=8, 8192 -> 32 splits.
    """
    work = max(1, batch * num_kv_heads)
    for_occupancy = math.ceil(_PROGRAMS_PER_SM * sm_count / work)
    for_length = math.ceil(max_context / _MAX_PARTITION)
    most = max(1, max_context // _MIN_PARTITION)
    return max(1, min(max(for_occupancy, for_length), most, _MAX_SPLITS))


def _check_decode_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    what = "paged_decode_attention"
    batch, num_heads, num_kv_heads, head_dim, block_size = check_query_and_tables(
        what, query, k_cache, v_cache, block_tables, one_query_per_sequence=True
    )
    check_int_vector(what, "seq_lens", seq_lens, batch, torch.int32)
    check_launchable(_decode_kernel, what, query, out, k_cache, v_cache, block_tables, seq_lens)
    return batch, num_heads, num_kv_heads, head_dim, block_size


def _default_block_n(dtype: torch.dtype, head_dim: int) -> int:
    """Tokens per K/V tile.

    16-bit caches: 64 tokens (16 KiB per K tile at D=128), 32 at D=256. float32 (a testing
    dtype) runs its dots on FMA units, whose register appetite spills beyond 16 tokens.
    Checked by compiling for sm_90 offline: no spills with these choices.
    """
    if dtype.itemsize >= 4:
        return 16
    return 64 if triton.next_power_of_2(head_dim) <= 128 else 32


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    kernel_flags: Mapping[str, bool] | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[B, H, D]``.

    ``query`` ``[B, H, D]`` (last dim contiguous), caches as written by ``store_kv``,
    ``block_tables`` ``[B, max_blocks]`` int32 padded with -1, ``seq_lens`` ``[B]`` int32
    (context length including the new token, already stored). Query head ``h`` reads KV head
    ``h // (H // KVH)``. A zero-length context yields zeros. ``head_dim`` may be any value in
    [16, 256]; the cache block size may be any positive integer.

    Keyword-only tuning knobs: ``max_seq_len`` (a host-known bound on ``seq_lens`` that
    shortens the split plan; default: the block table's capacity, which is what CUDA-graph
    capture needs), ``num_splits`` (override the split-K heuristic) and ``block_n`` (tokens
    per K/V tile, a power of two >= 16). ``seq_lens`` must not exceed ``max_seq_len``: the
    split plan covers only that many tokens. Block ids and lengths are not checked on the
    device (a sync per step); a -1 entry inside a context is undefined behaviour.

    ``kernel_flags`` switches on deliberate bugs (tests/kernel_mutants.py); leave it unset.
    """
    batch, num_heads, num_kv_heads, head_dim, block_size = _check_decode_args(
        query, k_cache, v_cache, block_tables, seq_lens, out
    )
    if out is None:
        out = torch.empty_like(query)
    if batch == 0 or num_heads == 0:
        return out
    if block_n is None:
        block_n = _default_block_n(query.dtype, head_dim)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(
            f"paged_decode_attention: block_n must be a power of two >= 16, got {block_n}"
        )

    capacity = block_tables.shape[1] * block_size
    max_context = capacity if max_seq_len is None else min(max_seq_len, capacity)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, _sm_count(query.device))
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_context, 1), block_n)))
    partition = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_context, 1), partition)
    split = num_splits > 1

    group = num_heads // num_kv_heads
    f32 = torch.float32
    if split:
        part_acc = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=f32, device=query.device
        )
        part_m = torch.empty(batch, num_heads, num_splits, dtype=f32, device=query.device)
        part_l = torch.empty(batch, num_heads, num_splits, dtype=f32, device=query.device)
    else:
        part_acc = part_m = part_l = out  # never touched by the kernel
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        block_tables.shape[1],
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        partition,
        num_splits,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        num_warps=4,
        num_stages=2,
        **(kernel_flags or {}),
    )
    if split:
        _decode_merge_kernel[(batch, num_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


def is_interpreted() -> bool:
    """Whether this module's kernels run under Triton's CPU interpreter."""
    return kernel_is_interpreted(_decode_kernel)
