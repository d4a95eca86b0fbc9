"""Shared-prefix (cascade) decode attention: the grouping rule with exact groups, and the
maths against ``naive_attention`` on both of its paths (torch's fused CPU kernel and the
plain-op fallback). The attention machine (tests/test_attention_machine.py) runs the
cascade through the engine's own allocator and metadata, with mutants."""

from __future__ import annotations

import random

import pytest
import torch

import paged_engine.layers.cascade as cascade
from paged_engine.layers.attention import (
    TorchAttentionBackend,
    make_attention_metadata,
    naive_attention,
)
from paged_engine.layers.cascade import SharedPrefix, find_shared_prefixes


def test_groups_by_first_block_and_longest_common_prefix() -> None:
    # Block size 4. Rows 0, 2 and 3 start with block 7; row 3 leaves the others after two
    # blocks, so the group shares [7, 8]. Row 1 starts elsewhere and is alone: no group.
    # Row 4 starts with block 20 like row 5, but row 5's context is 4 tokens with 1 new, so
    # no block of it is wholly cached: row 4 has no partner.
    tables = [[7, 8, 9, 30], [11, 12], [7, 8, 9, 31], [7, 8, 40, 41], [20, 21], [20]]
    seq_lens = [14, 6, 15, 13, 7, 4]
    query_lens = [1, 1, 1, 1, 1, 1]
    groups = find_shared_prefixes(tables, seq_lens, query_lens, 4, min_saved_tokens=0)
    assert groups == (SharedPrefix(seqs=(0, 2, 3), blocks=(7, 8)),)


def test_shared_blocks_stop_before_the_first_new_token() -> None:
    # Both tables are [5, 6, 7], but row 1 computes its last 5 tokens in this step (a
    # prefill chunk): its first new token is token 7, inside block 6 (tokens 4-7), so only
    # block 5 lies wholly before it.
    tables = [[5, 6, 7], [5, 6, 7]]
    groups = find_shared_prefixes(tables, [12, 12], [1, 5], 4, min_saved_tokens=0)
    assert groups == (SharedPrefix(seqs=(0, 1), blocks=(5,)),)


def test_groups_below_the_threshold_are_left_to_the_plain_path() -> None:
    # Three sequences sharing two blocks of 4 save (3 - 1) * 2 * 4 = 16 gathered positions.
    tables = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    lens, ones = [10, 10, 10], [1, 1, 1]
    assert find_shared_prefixes(tables, lens, ones, 4, min_saved_tokens=16)
    assert find_shared_prefixes(tables, lens, ones, 4, min_saved_tokens=17) == ()


def test_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="shared_prefix_min_tokens"):
        TorchAttentionBackend(16, torch.float32, shared_prefix_min_tokens=-1)


def _shared_prefix_batch(
    seed: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    prefix_blocks: int = 4,
    q_scale: float = 1.0,
) -> tuple[list[list[int]], list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode batch: 2-3 prefixes of 1-``prefix_blocks`` blocks, each shared by 1-4
    sequences, plus each sequence's own blocks; a NaN pool with exactly the context slots
    written. ``q_scale`` sharpens the attention (larger scores, peakier softmax)."""
    rng = random.Random(seed)
    free = list(range(200))
    rng.shuffle(free)
    tables, lens = [], []
    for _ in range(rng.randint(2, 3)):
        prefix = [free.pop() for _ in range(rng.randint(1, prefix_blocks))]
        for _ in range(rng.randint(1, 4)):
            own = rng.randint(1, 3 * block_size)
            tables.append(prefix + [free.pop() for _ in range(-(-own // block_size))])
            lens.append(len(prefix) * block_size + own)
    shape = (200, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for table, n in zip(tables, lens, strict=True):
        for pos in range(n):
            b, o = table[pos // block_size], pos % block_size
            if torch.isnan(k_cache[b, o]).any():  # shared slots: written once
                k_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
                v_cache[b, o] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(tables), num_kv_heads * group, head_dim, generator=gen) * q_scale
    return tables, lens, q.to(dtype), k_cache, v_cache


TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
SHAPES = {
    # block size, kv heads, group, head dim, prefix blocks, query scale
    "short": (4, 2, 3, 8, 4, 1.0),
    # contexts of up to ~370 tokens and sharp attention: where half-precision sums drift
    "long-sharp": (16, 2, 4, 64, 20, 4.0),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain-ops"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", range(4))
def test_cascade_equals_naive_attention(
    monkeypatch: pytest.MonkeyPatch, fused: bool, dtype: torch.dtype, shape: str, seed: int
) -> None:
    if not fused:
        monkeypatch.setattr(cascade, "_FUSED", None)
    elif cascade._FUSED is None:
        pytest.fail("torch has no fused CPU attention op: the production path is untested")
    bs, kvh, group, d, prefix_blocks, q_scale = SHAPES[shape]
    tables, lens, q, k_cache, v_cache = _shared_prefix_batch(
        seed, bs, kvh, group, d, dtype, prefix_blocks, q_scale
    )
    meta = make_attention_metadata([1] * len(lens), lens, tables, bs)
    backend = TorchAttentionBackend(bs, dtype, shared_prefix_min_tokens=0)
    plan = backend._decode_plan(meta, bs, dtype, kvh)
    assert isinstance(plan, cascade.CascadePlan), "the batch shares prefixes: must cascade"
    out = backend.attend(q, q, q, k_cache, v_cache, meta, d**-0.5)  # key/value unused here
    assert not torch.isnan(out).any()
    tol = TOLERANCE[dtype]
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        slots = [table[p // bs] * bs + p % bs for p in range(n)]
        k = k_cache.view(-1, kvh, d)[slots]
        v = v_cache.view(-1, kvh, d)[slots]
        want = naive_attention(q[i : i + 1], k, v, d**-0.5, causal_offset=n - 1)
        torch.testing.assert_close(out[i : i + 1], want, **tol)
