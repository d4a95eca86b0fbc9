"""The Triton kernels and the flash-attn backend at realistic shapes on CUDA (marked gpu).

16 query heads, 8 KV heads, head dim 128, float16 and bfloat16, block sizes 16 and 256;
skipped without CUDA and compiled kernels (TRITON_INTERPRET unset).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from paged_engine.kernels.store_kv import store_kv
from paged_engine.kernels.store_kv_ref import store_kv_ref
from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.flash import FlashAttnBackend
from tests.kernel_cases import (
    DEVICE,
    FLASH,
    Case,
    Tensors,
    assert_close,
    decode_case,
    gpu,
    needs_cuda,
    ref_decode,
    ref_prefill,
    requires_kernels,
    run_decode,
    run_prefill,
)

pytestmark = requires_kernels

# --------------------------------------------------------------------------------------------
# GPU: realistic shapes (16 query heads, 8 KV heads, head dim 128)
# --------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_GEOMETRY = {"num_kv_heads": 8, "group": 2, "head_dim": 128}


def _random_lens(seed: int, n: int, lo: int, hi: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


def make_tensors_fast(case: Case) -> Tensors:
    """``make_tensors`` for GPU-sized cases: bulk fill on the device, NaN in unused slots.

    Blocks are shuffled but not shared (sharing is covered at CPU sizes).
    """
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [math.ceil(s / bs) for s in case.seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(case.seed)).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n
    width = max(needed) + 1
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=DEVICE).to(case.dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=DEVICE).to(case.dtype)
    used = torch.zeros(num_blocks * bs, dtype=torch.bool, device=DEVICE)
    for row, s in zip(tables, case.seq_lens, strict=True):
        slots = torch.tensor(row, device=DEVICE)[:, None] * bs + torch.arange(bs, device=DEVICE)
        used[slots.flatten()[:s]] = True
    k_cache.view(-1, kvh, d)[~used] = float("nan")
    v_cache.view(-1, kvh, d)[~used] = float("nan")
    num_tokens, num_heads = sum(case.query_lens), kvh * case.group
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return Tensors(
        query=torch.randn(num_tokens, num_heads, d, generator=gen, device=DEVICE).to(case.dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor([r + [-1] * (width - len(r)) for r in tables], **i32),
        seq_lens=torch.tensor(case.seq_lens, **i32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(case.query_lens)], **i32),
        scale=d**-0.5,
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_decode_realistic(dtype: torch.dtype, block_size: int) -> None:
    seq_lens = (*_random_lens(1, 14, 1, 3000), 2048, 8192)
    t = make_tensors_fast(decode_case(seq_lens, block_size=block_size, dtype=dtype, **GPU_GEOMETRY))
    expected = ref_decode(t)
    for num_splits in (None, 1, 7):
        assert_close(run_decode(t, num_splits=num_splits), expected)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_prefill_realistic(dtype: torch.dtype, block_size: int) -> None:
    case = Case(
        seq_lens=(700, 1500, 2049, 530, 300),
        query_lens=(700, 300, 1, 17, 300),
        block_size=block_size,
        dtype=dtype,
        **GPU_GEOMETRY,
    )
    t = make_tensors_fast(case)
    assert_close(run_prefill(t), ref_prefill(t))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_store_kv_realistic(dtype: torch.dtype) -> None:
    k_cache = torch.randn(64, 256, 8, 128, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(3000, 32, 128, device=DEVICE).to(dtype)
    key, value = qkv[:, 16:24], qkv[:, 24:]
    slots = torch.randperm(64 * 256, device=DEVICE)[:3000]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@gpu
@needs_cuda
@pytest.mark.skipif(not FLASH, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_flash_backend_matches_refs(dtype: torch.dtype) -> None:
    backend = FlashAttnBackend(block_size=256, dtype=dtype)
    geometry = {"block_size": 256, "dtype": dtype, **GPU_GEOMETRY}
    scale = 128**-0.5

    # Decode over a paged context.
    t = make_tensors_fast(decode_case((1, 255, 256, 257, 3000), **geometry))
    meta = _meta_from_tensors(t, is_prefill=False)
    k, v = _step_rows(t.k_cache, meta), _step_rows(t.v_cache, meta)
    out = backend.attend(t.query, k, v, t.k_cache, t.v_cache, meta, scale)
    assert_close(out, ref_decode(t))

    # Prefill with cached prefixes (the block_table path), then fresh prompts (plain varlen).
    for seq_lens, query_lens in [((700, 1500, 530), (700, 300, 17)), ((700, 33, 530),) * 2]:
        t = make_tensors_fast(Case(seq_lens=seq_lens, query_lens=query_lens, **geometry))
        meta = _meta_from_tensors(t, is_prefill=True)
        k, v = _step_rows(t.k_cache, meta), _step_rows(t.v_cache, meta)
        out = backend.attend(t.query, k, v, t.k_cache, t.v_cache, meta, scale)
        assert_close(out, ref_prefill(t))


def _meta_from_tensors(t: Tensors, is_prefill: bool) -> AttentionMetadata:
    seq_lens = [int(x) for x in t.seq_lens]
    qsl = [int(x) for x in t.query_start_loc]
    query_lens = [b - a for a, b in itertools.pairwise(qsl)]
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc=t.query_start_loc,
        seq_start_loc=torch.tensor(
            [0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=DEVICE
        ),
        seq_lens=t.seq_lens,
        block_tables=t.block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def _step_rows(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The step's own K (or V) rows, packed: each context's last ``q_len`` tokens."""
    bs = cache.shape[1]
    rows = []
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        blocks = meta.block_tables[i, : math.ceil(s / bs)].long()
        rows.append(cache[blocks].flatten(0, 1)[s - q : s])
    return torch.cat(rows)
