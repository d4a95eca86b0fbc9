"""Dense attention: the independent oracle, and attention over a step's own rows.

Neither reads the paged cache. ``naive_attention`` is the textbook formula every backend is
tested against; ``attend_uncached`` is what every backend runs when a sequence's context is
only this step's tokens (the warm-up pass before the pool exists, and fresh prompts in the
torch backend).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["attend_uncached", "causal_bias", "naive_attention", "sdpa"]


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int
) -> torch.Tensor:
    """Textbook causal attention, the independent oracle for every backend.

    ``q`` ``[n, num_heads, d]``; ``k``/``v`` ``[L, num_kv_heads, d]``: the whole context.
    Query row ``r`` sits at position ``causal_offset + r`` and sees keys ``0..that``. Plain
    matmul + softmax in float32 (no SDPA, no paging), so it shares no code path with the
    backends it checks. Returns ``[n, num_heads, d]`` in ``q``'s dtype.
    """
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, n, d]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, n, L]
    rows = torch.arange(n, device=q.device)[:, None] + causal_offset
    cols = torch.arange(length, device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, n, d]
    return out.transpose(0, 1).to(q.dtype)


_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""``scaled_dot_product_attention(..., enable_gqa=True)`` exists from torch 2.5."""


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA over 4-D ``q`` ``[B, H, n, d]`` and ``k``/``v`` ``[B, kvh, L, d]``.

    Grouped-query heads share their kv head (query head ``h`` uses ``h // group``) without
    copying K/V where torch supports it. 4-D inputs keep CPU on its flash kernel (3-D ones
    fall back to the unfused math path).
    """
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def causal_bias(
    query_len: int, context_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[query_len, context_len]`` additive mask in ``dtype``: 0 where a new token may look
    (the new tokens are the context's last ones), -inf past it. On the CPU, SDPA gives the
    same bits as with the boolean mask (tests/test_dense_attention.py) and runs faster with
    this one, which it need not convert (bench/test_prefill_mask_bench.py). On CUDA the
    cuDNN kernel would have filled a boolean mask with -65504 rather than -inf: the same
    softmax where every row sees a key, which each does here, but not checked bit for bit."""
    if not 0 <= query_len <= context_len:
        raise ValueError(
            f"causal_bias: {query_len} new tokens do not fit a context of {context_len}"
        )
    mask = torch.full((query_len, context_len), float("-inf"), dtype=dtype, device=device)
    return mask.triu_(context_len - query_len + 1)


def attend_uncached(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Each sequence attends causally over its own new rows only: the warm-up pass before
    the pool exists (every backend), and prefill without a cached prefix. Host-side
    lengths drive the slicing (no device sync); 4-D SDPA keeps memory linear in length."""
    out = torch.empty_like(query)
    start = 0
    for q_len in query_lens:
        end = start + q_len
        q = query[start:end].transpose(0, 1)[None]
        k = key[start:end].transpose(0, 1)[None]
        v = value[start:end].transpose(0, 1)[None]
        out[start:end] = sdpa(q, k, v, scale, causal=True)[0].transpose(0, 1)
        start = end
    return out
