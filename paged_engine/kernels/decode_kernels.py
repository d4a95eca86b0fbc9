"""The Triton kernels of decode attention over the paged KV cache: one new query token per
sequence.

Decode is memory-bound: every step streams each sequence's whole K/V context once and does
little arithmetic per byte. The kernel is shaped around that:

* **One program per (sequence, KV head, context split).** All ``G = H // KVH`` query heads
  that share a KV head are processed together as the rows of one ``[G, D]`` query tile, so
  each K/V tile is loaded from memory once, not ``G`` times. The rows are padded to 16 so the
  score and value products can use ``tl.dot`` (tensor cores); the padding costs arithmetic,
  which decode has to spare, not bandwidth.
* **Block table walked per token.** A tile of ``BLOCK_N`` logical tokens gathers each token's
  physical block id from the block table, so the tile size is independent of the cache block
  size (any block size works, powers of two or not: 24, 48, 1, thousands) and tiles may
  straddle blocks; tokens past the context are masked.
* **Cache strides from constexprs.** The caches are contiguous (the launcher checks), so a
  token's row is ``block * BLOCK_SIZE * KVH * D + offset * KVH * D + kv_head * D``: known
  multiples at compile time, which lets the compiler vectorise the K/V loads whatever
  values the runtime integers take. The block id is widened to int64 before the multiply:
  a pool of more than 2**31 elements (16 GiB of bfloat16) must not wrap around.
* **Split-K ("flash-decoding").** With few sequences, or long contexts, ``B * KVH`` programs
  cannot keep every SM streaming, and one very long sequence would serialise the tail of the
  step. The context is then cut into ``num_splits`` partitions handled by separate programs,
  each writing an un-normalised partial output plus its running max and sum (float32); a
  second small kernel merges the partials with the usual log-sum-exp rescaling.
* **Online softmax in float32**, in base 2 (the softmax scale is folded with ``log2(e)``).

The host side (``decode_plan`` decides tiles and splits from static shapes only;
``paged_decode_attention`` checks arguments and packs the launches) never needs a device
sync and stays fixed under CUDA graph capture; scripts/compile_kernels.py compiles the
kernels at every plan it can make and checks registers, spills and the instructions used.
"""

# Triton kernels cannot carry Python annotations on their parameters (Triton reads
# annotations as specialisation hints), and triton.jit is untyped: exempt just those two checks.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["decode_kernel", "decode_merge_kernel"]


@triton.jit
def decode_kernel(
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
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # elements from one token to the next

    # Never walk past the block table's width, whatever seq_lens says: a bad length then
    # yields a wrong answer instead of an out-of-bounds read.
    context_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE)
    start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
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
    head_off = kv_head * HEAD_DIM
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block * (BLOCK_SIZE * ROW) + ((offs_n % BLOCK_SIZE) * ROW + head_off)
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
def decode_merge_kernel(
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
