"""The Triton and flash-attn attention backends, driven through engine steps.

``run_engine_steps`` plays fresh prompts, chunked prefills after a mid-block prefix and
decode steps through a backend the way the model runner does, checking each output against
dense causal attention over an unpaged K/V history kept by the test. The flash-attn backend's
wiring runs against a torch stand-in for flash-attn (``_fake_flash_attn``), so it is checked
without CUDA; its realistic-shape run on a GPU is in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import math
import random
import sys
from typing import Any

import pytest
import torch

from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.flash import FlashAttnBackend
from paged_engine.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernel_cases import CUDA, DEVICE, FLASH, INTERPRETED, assert_close, requires_kernels

pytestmark = requires_kernels

# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


def make_meta(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Build the step's metadata directly from the interface dataclass."""
    slots = [
        tables[i][pos // block_size] * block_size + pos % block_size
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        for pos in range(s - q, s)
    ]
    width = max(len(r) for r in tables)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return AttentionMetadata(
        is_prefill=max(query_lens) > 1,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], **i32),
        seq_start_loc=torch.tensor([0, *itertools.accumulate(seq_lens)], **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=torch.tensor([r + [-1] * (width - len(r)) for r in tables], **i32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unpaged oracle: ``q`` are the last ``len(q)`` of the ``len(k)`` context tokens."""
    group = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    pos = torch.arange(len(k) - len(q), len(k), device=q.device)
    scores = scores.masked_fill(
        torch.arange(len(k), device=q.device)[None, :] > pos[:, None], -math.inf
    )
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


BACKEND_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


Step = list[tuple[int, int]]
"""One engine step: (sequence index, new tokens) for each scheduled sequence."""

SMALL_STEPS: list[Step] = [
    [(0, 12), (1, 35), (2, 7)],  # fresh prompts (seq 0 only its first chunk)
    [(0, 8)],  # second chunk: a 12-token prefix, ending mid-block
    [(0, 1), (1, 1), (2, 1)],  # decode
    [(0, 1), (1, 1), (2, 1)],
]


def run_engine_steps(
    backend: Any, steps: list[Step], block_size: int, dtype: torch.dtype, seed: int = 7
) -> None:
    """Drive ``backend`` through ``steps`` like the model runner; check every output.

    Blocks come from a shuffled pool; the oracle is ``dense_causal`` over each sequence's
    K/V history kept here, unpaged, so it shares nothing with the code under test.
    """
    kvh, group, d = 2, 2, 32
    num_seqs = 1 + max(i for step in steps for i, _ in step)
    final = [sum(n for step in steps for i, n in step if i == s) for s in range(num_seqs)]
    needed = [math.ceil(n / block_size) for n in final]
    pool = list(range(sum(needed) + 2))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    k_cache = torch.zeros(sum(needed) + 2, block_size, kvh, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    gen = torch.Generator().manual_seed(seed)
    history: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in final]
    lengths = [0] * num_seqs
    for step in steps:
        seqs, query_lens = [i for i, _ in step], [n for _, n in step]
        for i, n in step:
            lengths[i] += n
        meta = make_meta(
            query_lens, [lengths[i] for i in seqs], [tables[i] for i in seqs], block_size
        )
        q, k, v = (
            torch.randn(sum(query_lens), heads, d, generator=gen).to(DEVICE, dtype)
            for heads in (kvh * group, kvh, kvh)
        )
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k, v, k_cache, v_cache, meta, d**-0.5)
        starts = [0, *itertools.accumulate(query_lens)]
        for j, i in enumerate(seqs):
            s, e = starts[j], starts[j + 1]
            history[i][0].append(k[s:e])
            history[i][1].append(v[s:e])
            keys, values = (torch.cat(h) for h in history[i])
            assert_close(out[s:e], dense_causal(q[s:e], keys, values, d**-0.5))


@pytest.mark.parametrize("dtype", BACKEND_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_backend_chunked_prefill_then_decode(dtype: torch.dtype) -> None:
    """Fresh prompts, a second chunk after a mid-block prefix, then two decode steps."""
    run_engine_steps(TritonAttentionBackend(block_size=16, dtype=dtype), SMALL_STEPS, 16, dtype)


def test_triton_backend_empty_cache_is_plain_causal_attention() -> None:
    backend = TritonAttentionBackend(block_size=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    query_lens = [5, 12, 1]
    n = sum(query_lens)
    q = torch.randn(n, 4, 32, generator=gen).to(DEVICE)
    k = torch.randn(n, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(n, 2, 32, generator=gen).to(DEVICE)
    meta = make_meta(query_lens, query_lens, [[0], [1], [2]], 16)
    empty = torch.empty(0, device=DEVICE)
    backend.store_kv(k, v, empty, empty, meta.slot_mapping)  # warm-up: nothing to store
    out = backend.attend(q, k, v, empty, empty, meta, 0.3)
    starts = [0, *itertools.accumulate(query_lens)]
    for s, e in itertools.pairwise(starts):
        assert_close(out[s:e], dense_causal(q[s:e], k[s:e], v[s:e], 0.3))
    prefix_meta = make_meta([2], [9], [[0]], 16)
    with pytest.raises(ValueError, match="cached prefix needs a KV cache"):
        backend.attend(q[:2], k[:2], v[:2], empty, empty, prefix_meta, 0.3)


@pytest.mark.parametrize("block_size", [24, 48])
def test_triton_backend_takes_block_sizes_that_are_not_powers_of_two(block_size: int) -> None:
    """Fresh prompts, a mid-block second chunk, then decode, at block sizes 24 and 48: the
    kernels gather per token and mask past each context, so any block size works."""
    backend = TritonAttentionBackend(block_size=block_size, dtype=torch.float16)
    run_engine_steps(backend, SMALL_STEPS, block_size, torch.float16)


@pytest.mark.parametrize(
    ("block_size", "dtype", "head_dim", "match"),
    [
        (0, torch.float16, None, "positive int"),
        (16, torch.float64, None, "not supported"),
        (16, torch.float16, 8, "head_dim 16..256"),
        (16, torch.float16, 320, "head_dim 16..256"),
    ],
)
def test_triton_backend_rejects_bad_configuration(
    block_size: int, dtype: torch.dtype, head_dim: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        TritonAttentionBackend(block_size=block_size, dtype=dtype, head_dim=head_dim)


@pytest.mark.skipif(not INTERPRETED, reason="bfloat16 is only refused under the interpreter")
def test_triton_backend_refuses_bfloat16_under_the_interpreter() -> None:
    with pytest.raises(ValueError, match="bfloat16 is unsupported under TRITON_INTERPRET=1"):
        TritonAttentionBackend(block_size=16, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("block_size", "dtype", "head_dim", "match"),
    [
        (256, torch.float32, None, "float16 and bfloat16 only"),
        (16, torch.float16, None, "% 256 == 0"),
        (384, torch.bfloat16, None, "% 256 == 0"),
        (256, torch.float16, 100, "head_dim a multiple of 8"),
        (256, torch.float16, 264, "head_dim a multiple of 8 up to 256"),
    ],
)
def test_flash_backend_rejects_unsupported_configuration(
    block_size: int, dtype: torch.dtype, head_dim: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        FlashAttnBackend(block_size=block_size, dtype=dtype, head_dim=head_dim)


@pytest.mark.skipif(FLASH, reason="flash-attn runs here")
def test_flash_backend_says_why_it_cannot_run_here() -> None:
    match = "flash-attn is not installed" if CUDA else "needs a CUDA device"
    with pytest.raises(ValueError, match=match):
        FlashAttnBackend(block_size=256, dtype=torch.float16)


def test_flash_backend_refuses_gpus_before_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability 8\.0\+ .* this device is 7\.5"):
        FlashAttnBackend(block_size=256, dtype=torch.float16, head_dim=128)


def _fake_flash_attn() -> Any:
    """A torch stand-in for flash-attn 2.6+'s two entry points, same parameter names.

    It follows flash-attn's documented semantics (bottom-right-aligned causal mask; with
    ``block_table``, ``k``/``v`` are the paged caches and ``cu_seqlens_k`` counts context
    tokens), and has no ``**kwargs``: a misspelt argument raises TypeError. It lets the
    backend's wiring (which function, which lengths, which tables) be tested without CUDA.
    """

    def paged(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        assert cache.shape[1] % 256 == 0, "flash-attn needs page_block_size % 256 == 0"
        blocks = table[: math.ceil(length / cache.shape[1])].long()
        return cache[blocks].flatten(0, 1)[:length]

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        assert causal and dropout_p == 0.0 and softmax_scale is not None
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
            if block_table is None:
                kk, vv = k[ks:ke], v[ks:ke]
            else:
                kk, vv = paged(k, block_table[i], ke - ks), paged(v, block_table[i], ke - ks)
            out[qs:qe] = dense_causal(q[qs:qe], kk, vv, softmax_scale)
        return out

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    ):  # fmt: skip
        assert k is None and v is None and causal and softmax_scale is not None
        assert q.dim() == 4 and block_table is not None and cache_seqlens.dtype == torch.int32
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            length = int(cache_seqlens[b])
            kk, vv = paged(k_cache, block_table[b], length), paged(v_cache, block_table[b], length)
            out[b] = dense_causal(q[b], kk, vv, softmax_scale)
        return out

    module = type(sys)("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # find_spec sees it
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def test_flash_backend_wiring_against_a_fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh prompts (plain varlen), prefixed chunks (block_table varlen), decode (kvcache)."""
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend = FlashAttnBackend(block_size=256, dtype=torch.float16, head_dim=32)
    steps: list[Step] = [
        [(0, 300), (1, 40), (2, 7)],
        [(0, 230), (1, 260)],  # prefixes of 300 (past a block edge) and 40 tokens
        [(0, 1), (1, 1), (2, 1)],
    ]
    run_engine_steps(backend, steps, 256, torch.float16)
