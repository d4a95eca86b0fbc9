"""The CPU decode kernel's algorithm, step for step, in plain torch: a readable statement
of ``csrc/paged_decode_head.h`` (every variant, float32 and bfloat16).

``paged_decode_attention_ref`` says *what* decode attention computes (gather, softmax,
weighted sum). This says *how* the kernel computes it, so the C can be read against it:
the context is walked through the block table in chunks of at most ``CHUNK`` tokens that
never cross a block's end; each chunk's scores update a running max ``m``, a running sum
``l`` and an accumulator ``acc`` rescaled by ``exp(m_old - m_new)`` (the online softmax);
the G query heads of a KV head share each K/V row. Everything after reading q and K/V is
float32; the output is rounded to the input dtype once. Slow (a Python loop per chunk):
for tests and for reading only.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "paged_decode_cpu_ref"]

CHUNK = 32
"""Tokens scored per online-softmax update (``CHUNK`` in csrc/paged_decode_cpu.h)."""


def paged_decode_cpu_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention ``[B, H, D]`` as the kernel computes it (arguments as
    ``paged_decode_attention_cpu``). A zero-length context gives zeros."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32)
    for b in range(batch):
        length = int(seq_lens[b])
        for kh in range(num_kv_heads):
            heads = slice(kh * group, (kh + 1) * group)  # query head h reads KV head h // G
            q = query[b, heads].float()  # [G, D]
            m = torch.full((group,), torch.finfo(torch.float32).min)
            l_sum = torch.zeros(group)
            acc = torch.zeros(group, head_dim)
            t0 = 0
            while t0 < length:
                block, off = int(block_tables[b, t0 // block_size]), t0 % block_size
                n = min(block_size - off, CHUNK, length - t0)
                k = k_cache[block, off : off + n, kh].float()  # [n, D]
                v = v_cache[block, off : off + n, kh].float()
                s = (q @ k.T) * scale  # [G, n]
                top = torch.maximum(m, s.max(dim=1).values)
                rescale = torch.exp(m - top)
                p = torch.exp(s - top[:, None])
                l_sum = l_sum * rescale + p.sum(dim=1)
                acc = acc * rescale[:, None] + p @ v
                m = top
                t0 += n
            if length:
                out[b, heads] = acc / l_sum[:, None]
    return out.to(query.dtype)
