"""The Triton kernel of prefill attention over the paged KV cache: many new tokens per
sequence, causal.

Sequence ``i`` brings ``q_len_i`` new tokens, the LAST ``q_len_i`` of its ``seq_len_i``-token
context; their K/V are already in the cache (``store_kv`` ran first), together with the
``seq_len_i - q_len_i`` cached prefix tokens (a prefix-cache hit or earlier prefill chunks).
Query token ``m`` (0-based among the new ones) sits at absolute position
``seq_len_i - q_len_i + m`` and sees context tokens ``0 ..= that position``: the causal mask
is aligned to the bottom-right corner, as in flash-attn.

Reading everything through the block table (instead of taking this step's K/V from the
projection) is what makes one kernel serve fresh prompts, prefix hits and chunked prefills.

Design: one program per (query tile, sequence, KV head). The tile's rows are
``BLOCK_M`` new tokens x all ``G`` query heads of the KV head (row ``r`` is token
``r // G_pad``, head ``r % G_pad``), so each K/V tile loaded serves ``G`` heads at once, the
same reuse the decode kernel gets. The program walks the context in ``BLOCK_N``-token tiles up
to its last row's causal limit, gathering each token's physical block from the table, and
keeps a float32 online softmax (base 2). Programs whose tile lies beyond their sequence's
``q_len`` exit at once, so a batch of one long and many short prompts wastes only launches.

The host side (``prefill_plan`` decides tiles from static shapes; ``paged_prefill_attention``
checks arguments and packs the launch) never needs a device sync.
"""

# Triton kernels cannot carry Python annotations on their parameters (Triton reads
# annotations as specialisation hints), and triton.jit is untyped: exempt just those two checks.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["prefill_kernel"]


@triton.jit
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_bt,
    max_blocks,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M * GROUP_P2
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # elements from one cached token to the next
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_start = tile * BLOCK_M
    if tile_start >= q_len:
        return
    # Clamp to the table's width so a bad length cannot read past the block table.
    context_len = tl.minimum(tl.load(seq_lens_ptr + seq), max_blocks * BLOCK_SIZE)
    prefix_len = context_len - q_len

    offs_r = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    token = tile_start + offs_r // GROUP_P2  # index among this sequence's new tokens
    g = offs_r % GROUP_P2
    heads = kv_head * GROUP + g  # query head h -> KV head h // GROUP
    r_mask = (token < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    position = prefix_len + token  # absolute position of each row's token

    # Keys past the tile's last token are invisible to every row: stop the walk there.
    kv_end = tl.minimum(prefix_len + tl.minimum(tile_start + BLOCK_M, q_len), context_len)

    m_i = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * HEAD_DIM
    for n_start in range(0, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block * (BLOCK_SIZE * ROW) + ((offs_n % BLOCK_SIZE) * ROW + head_off)
        k_t = tl.load(
            k_cache_ptr + rows[None, :] + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k_t, input_precision="ieee") * qk_scale  # [BLOCK_Q, BLOCK_N]
        visible = n_mask[None, :] & (offs_n[None, :] <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))

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

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
