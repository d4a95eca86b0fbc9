"""Attention over the paged KV cache: the batch layout, the backend interface, the layer.

Every backend (the torch oracle here, Triton and flash-attn beside it) implements the same
two operations so that the model, the model runner and the oracle tests never branch on
which one runs:

* ``store_kv`` writes this step's new K/V rows into their cache slots;
* ``attend`` computes causal attention for this step's queries against each sequence's
  whole context (cached prefix + the new tokens just stored), read through its block table.

Cache layout, per layer: ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``j`` of a sequence lives in
slot ``block_table[j // block_size] * block_size + j % block_size`` of the flattened
``[num_blocks * block_size, num_kv_heads, head_dim]`` view.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.context import get_forward_context


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """One step's batch layout, shared by every attention layer of the step.

    The batch's new tokens are packed: sequence ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]`` of q/k/v. Its context is ``seq_lens[i]``
    tokens; the first ``seq_lens[i] - query_len_i`` are already in the cache (a prefix-cache
    hit, an earlier prefill chunk, earlier decode steps) and the last ``query_len_i`` are this
    step's tokens, at positions ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``.
    """

    is_prefill: bool
    """False means a decode step: every sequence has exactly one new token."""
    slot_mapping: torch.Tensor
    """``[num_tokens]`` int64: cache slot of each new token; -1 means "do not store"."""
    query_start_loc: torch.Tensor
    """``[num_seqs + 1]`` int32: cumulative new-token counts (flash-attn's cu_seqlens_q)."""
    seq_start_loc: torch.Tensor
    """``[num_seqs + 1]`` int32: cumulative context lengths (flash-attn's cu_seqlens_k)."""
    seq_lens: torch.Tensor
    """``[num_seqs]`` int32: context length of each sequence after this step."""
    block_tables: torch.Tensor
    """``[num_seqs, max_blocks_per_seq]`` int32, rows padded with -1."""
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: tuple[int, ...]
    """Host copies of the per-sequence lengths, so backends never sync with the device."""
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def has_cached_prefix(self) -> bool:
        """True when some sequence attends to tokens it does not compute in this step."""
        return any(s != q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu, strict=True))


class AttentionBackend(Protocol):
    """What a KV-cache attention implementation provides. See the module docstring."""

    name: str

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to their slots."""
        ...

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
        """Causal attention for ``query`` ``[num_tokens, num_heads, head_dim]``.

        Called after ``store_kv``; ``key``/``value`` are this step's rows, for backends that
        prefer them over the cache when nothing is cached. An empty cache (``numel() == 0``,
        a warm-up pass before the pool is sized) means: attend over ``key``/``value`` only.
        Returns ``[num_tokens, num_heads, head_dim]``.
        """
        ...


# --------------------------------------------------------------------------------------------
# The torch backend: the oracle the fast backends are tested against, and the CPU path.
# --------------------------------------------------------------------------------------------


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


def _grouped_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA for one sequence with grouped-query heads, without repeating K/V.

    ``q`` ``[n, H, d]``, ``k``/``v`` ``[L, kvh, d]``, ``mask`` ``[n, L]`` (True = attend).
    Query head ``h`` uses kv head ``h // group``, so the ``group`` heads of one kv head are
    folded into the query-row axis: ``[kvh, group * n, d]`` against ``[kvh, L, d]``.
    """
    n, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    qg = q.view(n, num_kv_heads, group, d).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, d)
    mask_g = mask.unsqueeze(0).expand(group, n, mask.shape[1]).reshape(group * n, -1)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask_g, scale=scale
    )  # [kvh, group * n, d]
    return out.view(num_kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, num_heads, d)


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """``[query_len, context_len]`` bool: the new tokens are the context's last ones."""
    rows = torch.arange(query_len, device=device)[:, None] + (context_len - query_len)
    return torch.arange(context_len, device=device)[None, :] <= rows


class TorchAttentionBackend:
    """Paged attention in plain torch: gathers each context through its block table.

    Correct on any device and fast enough on CPU; the decode step (one new token per
    sequence) is a single batched SDPA call, prefill loops over sequences.
    """

    name = "torch"

    def __init__(self, block_size: int | None = None, dtype: torch.dtype | None = None) -> None:
        # Accepted for a uniform constructor with the other backends; the layout is read from
        # the cache tensors themselves.
        self.block_size = block_size
        self.dtype = dtype

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Copy the rows whose slot is not -1 into the flattened cache (in place)."""
        if k_cache.numel() == 0:
            return
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        valid = (slot_mapping >= 0).nonzero().squeeze(1)
        slots = slot_mapping.index_select(0, valid).long()
        k_flat.index_copy_(0, slots, key.index_select(0, valid).to(k_flat.dtype))
        v_flat.index_copy_(0, slots, value.index_select(0, valid).to(v_flat.dtype))

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
            return self._attend_uncached(query, key, value, meta, scale)
        if meta.max_query_len == 1:
            return self._attend_decode(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        block_size = k_cache.shape[1]
        starts = [0, *itertools.accumulate(meta.query_lens_cpu)]  # host copy: no device sync
        for i, (q_len, ctx_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            n_blocks = -(-ctx_len // block_size)
            blocks = meta.block_tables[i, :n_blocks].long()
            k = k_cache[blocks].flatten(0, 1)[:ctx_len]
            v = v_cache[blocks].flatten(0, 1)[:ctx_len]
            mask = _causal_mask(q_len, ctx_len, query.device)
            s, e = starts[i], starts[i + 1]
            out[s:e] = _grouped_sdpa(query[s:e], k.to(query.dtype), v.to(query.dtype), mask, scale)
        return out

    def _attend_uncached(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """No cache (warm-up): each sequence attends over its own new rows only."""
        out = torch.empty_like(query)
        starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
        for i, q_len in enumerate(meta.query_lens_cpu):
            s, e = starts[i], starts[i + 1]
            mask = _causal_mask(q_len, q_len, query.device)
            out[s:e] = _grouped_sdpa(query[s:e], key[s:e], value[s:e], mask, scale)
        return out

    def _attend_decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One new token per sequence: gather every context at once, one SDPA call.

        Padding (-1) entries of the block tables are clamped to block 0, and every position
        at or past a sequence's length is masked out *and zeroed*: unused slots may hold
        anything (stale rows, NaN from an uninitialised pool), and a masked NaN still
        poisons SDPA's sums (``0 * nan``).
        """
        num_seqs, num_heads, d = query.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        n_blocks = -(-meta.max_seq_len // block_size)
        blocks = meta.block_tables[:, :n_blocks].clamp(min=0).long()
        k = k_cache[blocks].flatten(1, 2)  # [B, L, kvh, d]
        v = v_cache[blocks].flatten(1, 2)
        positions = torch.arange(k.shape[1], device=query.device)
        mask = positions[None, :] < meta.seq_lens.to(query.device).long()[:, None]  # [B, L]
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        k = torch.where(mask[:, :, None, None], k.to(query.dtype), zero).transpose(1, 2)
        v = torch.where(mask[:, :, None, None], v.to(query.dtype), zero).transpose(1, 2)
        q = query.view(num_seqs, num_kv_heads, group, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        return out.reshape(num_seqs, num_heads, d)


# --------------------------------------------------------------------------------------------
# The layer, backend selection, and a metadata builder for tests and simple callers.
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """The model's attention op: store this step's K/V, then attend through the backend.

    ``k_cache``/``v_cache`` start empty; the model runner assigns this layer's views of the
    KV pool, ``[num_blocks, block_size, num_kv_heads, head_dim]``. They are plain
    attributes, not buffers, so they never enter a state dict or get moved by ``.to()``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[N, H*d]`` or ``[N, H, d]`` (k/v likewise with kv heads) → ``[N, H*d]``."""
        meta = get_forward_context()
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() != 0:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = self.backend.attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)


FLASH_ATTN_BLOCK_MULTIPLE = 256
"""flash-attn's paged KV cache needs page sizes that are a multiple of this."""


def _flash_attn_problem(device: torch.device, block_size: int, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"flash-attn needs CUDA; this device is {device.type}"
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (
            f"flash-attn's paged KV cache needs kvcache_block_size % "
            f"{FLASH_ATTN_BLOCK_MULTIPLE} == 0; got {block_size}"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn supports float16 and bfloat16 only; got {dtype}"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install flash-attn)"
    return None


def _triton_problem(device: torch.device) -> str | None:
    """Why the Triton backend cannot run here, or None (CPU works under TRITON_INTERPRET=1)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return f"triton attention needs CUDA (or TRITON_INTERPRET=1); this device is {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def get_attention_backend(
    name: str, device: torch.device, block_size: int, dtype: torch.dtype
) -> AttentionBackend:
    """Build the named backend, or fail before anything is allocated, saying why.

    "auto" picks torch on CPU; on CUDA flash-attn when it can run, else Triton.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif _flash_attn_problem(device, block_size, dtype) is None:
            name = "flash-attn"
        else:
            name = "triton"
    if name == "torch":
        return TorchAttentionBackend(block_size=block_size, dtype=dtype)
    if name == "triton":
        problem = _triton_problem(device)
        if problem:
            raise ValueError(f"attention backend 'triton' cannot run: {problem}")
        from paged_engine.layers.attention_triton import TritonAttentionBackend

        backend: AttentionBackend = TritonAttentionBackend(block_size=block_size, dtype=dtype)
        return backend
    if name == "flash-attn":
        problem = _flash_attn_problem(device, block_size, dtype)
        if problem:
            raise ValueError(f"attention backend 'flash-attn' cannot run: {problem}")
        from paged_engine.layers.attention_flash import FlashAttnBackend

        backend = FlashAttnBackend(block_size=block_size, dtype=dtype)
        return backend
    raise ValueError(
        f"unknown attention backend {name!r}; choose one of 'auto', 'torch', 'triton', 'flash-attn'"
    )


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    is_prefill: bool | None = None,
) -> AttentionMetadata:
    """Build one step's layout from plain lists (tests, warm-up, simple callers).

    Sequence ``i``'s new tokens are the last ``query_lens[i]`` of its ``seq_lens[i]``-token
    context; their slots follow from its block table. An empty ``block_tables`` (no cache)
    gives slot -1 everywhere and a ``[num_seqs, 0]`` table. ``is_prefill`` defaults to
    "some sequence has more than one new token".
    """
    if len(query_lens) != len(seq_lens) or (block_tables and len(block_tables) != len(seq_lens)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    slots: list[int] = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got {q_len}, {s_len}")
        for pos in range(s_len - q_len, s_len):
            if block_tables:
                slots.append(block_tables[i][pos // block_size] * block_size + pos % block_size)
            else:
                slots.append(-1)
    width = max((len(row) for row in block_tables), default=0)
    table = [list(row) + [-1] * (width - len(row)) for row in block_tables] or [
        [] for _ in seq_lens
    ]
    q_cum = [0, *itertools.accumulate(query_lens)]
    s_cum = [0, *itertools.accumulate(seq_lens)]

    def i32(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return AttentionMetadata(
        is_prefill=max(query_lens) > 1 if is_prefill is None else is_prefill,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=i32(q_cum),
        seq_start_loc=i32(s_cum),
        seq_lens=i32(list(seq_lens)),
        block_tables=i32(table).view(len(seq_lens), width),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
