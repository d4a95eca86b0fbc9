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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.engine.indexing import slot_mapping
from paged_engine.layers.cascade import (
    CascadePlan,
    SharedPrefix,
    cascade_decode,
    find_shared_prefixes,
    make_plan,
)
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
    block_tables_cpu: tuple[tuple[int, ...], ...] = ()
    """Host copy of the block tables (unpadded); empty when the caller did not provide one
    (backends then use ``block_tables``). The torch backend plans shared-prefix decode
    attention from it without a device sync."""

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


_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""``scaled_dot_product_attention(..., enable_gqa=True)`` exists from torch 2.5."""


def _sdpa(
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


def _causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """``[query_len, context_len]`` bool: the new tokens are the context's last ones."""
    rows = torch.arange(query_len, device=device)[:, None] + (context_len - query_len)
    return torch.arange(context_len, device=device)[None, :] <= rows


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
        out[start:end] = _sdpa(q, k, v, scale, causal=True)[0].transpose(0, 1)
        start = end
    return out


SHARED_PREFIX_MIN_TOKENS = 512
"""Default ``TorchAttentionBackend(shared_prefix_min_tokens=...)``; see its docstring."""


@dataclass(slots=True, frozen=True)
class _DecodePlan:
    """What every layer of one decode step reads, derived once per step."""

    index: torch.Tensor
    """``[num_seqs * L]`` int64: the cache slot of position ``j`` of sequence ``i`` at
    ``i * L + j`` (``L = max_seq_len``). Positions at or past a sequence's length point at
    its own first slot, which is always written: a padded position never reads a slot
    nothing wrote (the pool is uninitialised memory, NaN included)."""
    mask: torch.Tensor
    """``[num_seqs, 1, 1, L]`` additive (0 where ``j < seq_len_i``, else -inf) in the query
    dtype: made once per step, where a bool mask would be converted by every SDPA call."""


class TorchAttentionBackend:
    """Paged attention in plain torch: gathers each context through its block table.

    Correct on any device; on CPU the reference path (the "cpu" backend replaces its
    float32 decode with a compiled kernel). A decode step (one new token per sequence) is
    one batched SDPA call per layer over every context, gathered through the block tables
    (slot indices and mask built once per step and shared by every layer); when sequences
    of the batch share prefix blocks, it is cascade attention instead (``layers.cascade``):
    each shared prefix attended once for its whole group. Prefill loops over sequences;
    one whose context is all new attends over its own K/V rows without touching the cache.

    ``shared_prefix_min_tokens``: the gathered positions per layer a shared-prefix group
    must save to be attended as a cascade (``None`` turns cascades off). The default is
    where the cascade's extra tensor ops cost about what the gather they save does, on CPU.
    """

    name = "torch"

    def __init__(
        self,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        shared_prefix_min_tokens: int | None = SHARED_PREFIX_MIN_TOKENS,
    ) -> None:
        # Accepted for a uniform constructor with the other backends; the layout is read from
        # the cache tensors themselves.
        self.block_size = block_size
        self.dtype = dtype
        if shared_prefix_min_tokens is not None and shared_prefix_min_tokens < 0:
            raise ValueError(
                f"shared_prefix_min_tokens must be >= 0 or None, got {shared_prefix_min_tokens}"
            )
        self.shared_prefix_min_tokens = shared_prefix_min_tokens
        # Per-step values derived from the step's metadata, shared by all layers. Keyed by
        # identity: the metadata (frozen) and slot mapping are built once per step; holding
        # them keeps their ids from being reused while the memo lives.
        self._decode_memo: (
            tuple[AttentionMetadata, tuple[int, torch.dtype, int], _DecodePlan | CascadePlan] | None
        ) = None
        self._store_memo: tuple[torch.Tensor, torch.Tensor | None] | None = None

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
        memo = self._store_memo
        if memo is not None and memo[0] is slot_mapping:
            valid = memo[1]
        else:
            # None: every row is stored (the usual case), so no row selection is needed.
            valid = None if bool((slot_mapping >= 0).all()) else (slot_mapping >= 0).nonzero()
            if valid is not None:
                valid = valid.squeeze(1)
            self._store_memo = (slot_mapping, valid)
        if valid is None:
            slots = slot_mapping.long()
        else:
            slots = slot_mapping.index_select(0, valid).long()
            key, value = key.index_select(0, valid), value.index_select(0, valid)
        k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, value.to(v_flat.dtype))

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
            return attend_uncached(query, key, value, meta.query_lens_cpu, scale)
        if meta.max_query_len == 1:  # decode, or prefill chunks of one token each
            return self._attend_gathered(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        block_size = k_cache.shape[1]
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        offsets = torch.arange(block_size, device=query.device)
        start = 0
        for i, (q_len, ctx_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            end = start + q_len
            q = query[start:end].transpose(0, 1)[None]  # [1, H, n, d]
            if q_len == ctx_len:  # nothing cached: the context is this step's own rows
                k, v = key[start:end], value[start:end]
                mask, causal = None, True
            else:
                n_blocks = -(-ctx_len // block_size)
                blocks = meta.block_tables[i, :n_blocks].long()
                slots = (blocks[:, None] * block_size + offsets).flatten()[:ctx_len]
                k = k_flat.index_select(0, slots).to(query.dtype)
                v = v_flat.index_select(0, slots).to(query.dtype)
                mask, causal = _causal_mask(q_len, ctx_len, query.device), False
            o = _sdpa(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, mask, causal)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    def _decode_plan(
        self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype, num_kv_heads: int
    ) -> _DecodePlan | CascadePlan:
        key = (block_size, dtype, num_kv_heads)
        memo = self._decode_memo
        if memo is not None and memo[0] is meta and memo[1] == key:
            return memo[2]
        plan: _DecodePlan | CascadePlan
        groups: tuple[SharedPrefix, ...] = ()
        if self.shared_prefix_min_tokens is not None and meta.block_tables_cpu:
            groups = find_shared_prefixes(
                meta.block_tables_cpu,
                meta.seq_lens_cpu,
                meta.query_lens_cpu,
                block_size,
                self.shared_prefix_min_tokens,
            )
        if groups:
            plan = make_plan(
                groups,
                meta.block_tables,
                meta.block_tables_cpu,
                meta.seq_lens_cpu,
                block_size,
                num_kv_heads,
            )
        else:
            plan = self._plain_plan(meta, block_size, dtype)
        self._decode_memo = (meta, key, plan)
        return plan

    @staticmethod
    def _plain_plan(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _DecodePlan:
        device = meta.block_tables.device
        num_seqs, length = meta.num_seqs, meta.max_seq_len
        tables = meta.block_tables[:, : -(-length // block_size)].long()
        first = tables[:, :1]
        tables = torch.where(tables < 0, first, tables)  # table padding: any real block
        offsets = torch.arange(block_size, device=device)
        slots = (tables[:, :, None] * block_size + offsets).view(num_seqs, -1)[:, :length]
        valid = torch.arange(length, device=device) < meta.seq_lens[:, None]
        return _DecodePlan(
            index=torch.where(valid, slots, first * block_size).flatten(),
            mask=_additive_mask(valid, dtype),
        )

    def _attend_gathered(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """One new token per sequence: gather every context at once, one SDPA call.

        Each context is read up to the batch's longest; the positions past a sequence's
        length read its own first slot (see ``_DecodePlan``) and are masked out. The
        ``group`` query heads of one kv head ride SDPA's query-row axis, so K/V are never
        repeated per head.
        """
        num_seqs, num_heads, d = query.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        plan = self._decode_plan(meta, block_size, query.dtype, num_kv_heads)
        if isinstance(plan, CascadePlan):
            return cascade_decode(query, k_cache, v_cache, plan, scale)
        row = num_kv_heads * d
        shape = (num_seqs, meta.max_seq_len, num_kv_heads, d)
        k = k_cache.view(-1, row).index_select(0, plan.index).view(shape).transpose(1, 2)
        v = v_cache.view(-1, row).index_select(0, plan.index).view(shape).transpose(1, 2)
        q = query.view(num_seqs, num_kv_heads, group, d)
        k, v = k.to(query.dtype), v.to(query.dtype)  # [B, kvh, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
        return out.reshape(num_seqs, num_heads, d)


def _additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, L]`` bool (True = attend) -> ``[B, 1, 1, L]`` 0 / -inf in ``dtype``."""
    mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]


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

    "auto" picks, on CPU, the compiled-kernel backend when it can run (float32, the
    extension built) and torch otherwise; on CUDA flash-attn when it can run, else Triton.
    """
    from paged_engine.layers.attention_cpu import CpuAttentionBackend, cpu_backend_problem

    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            name = "cpu" if cpu_backend_problem(device, dtype) is None else "torch"
        elif _flash_attn_problem(device, block_size, dtype) is None:
            name = "flash-attn"
        else:
            name = "triton"
    if name == "torch":
        return TorchAttentionBackend(block_size=block_size, dtype=dtype)
    if name == "cpu":
        problem = cpu_backend_problem(device, dtype)
        if problem:
            raise ValueError(f"attention backend 'cpu' cannot run: {problem}")
        return CpuAttentionBackend(block_size=block_size, dtype=dtype)
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
        f"unknown attention backend {name!r}; choose one of 'auto', 'torch', 'cpu', 'triton', "
        "'flash-attn'"
    )


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    is_prefill: bool | None = None,
) -> AttentionMetadata:
    """One step's layout from plain lists: the model runner's, and tests'.

    Sequence ``i``'s new tokens are the last ``query_lens[i]`` of its ``seq_lens[i]``-token
    context; their slots come from its block table through ``engine.indexing.slot_mapping``
    (the arithmetic CrossHair checks). Empty ``block_tables`` (no cache yet: warm-up) give
    slot -1 everywhere and a ``[num_seqs, 0]`` table. ``is_prefill`` defaults to "some
    sequence has more than one new token".
    """
    if len(query_lens) != len(seq_lens) or (block_tables and len(block_tables) != len(seq_lens)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    slots: list[int] = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= seq_len, got {q_len}, {s_len}")
        if block_tables:
            slots.extend(slot_mapping(block_tables[i], block_size, s_len - q_len, s_len))
        else:
            slots.extend([-1] * q_len)
    width = max((len(row) for row in block_tables), default=0)
    # numpy builds a nested list's array ~3x faster than torch.tensor (~0.1 ms a step)
    tables = np.full((len(seq_lens), width), -1, dtype=np.int32)
    for i, row in enumerate(block_tables):
        tables[i, : len(row)] = row

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return AttentionMetadata(
        is_prefill=max(query_lens) > 1 if is_prefill is None else is_prefill,
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        query_start_loc=i32([0, *itertools.accumulate(query_lens)]),
        seq_start_loc=i32([0, *itertools.accumulate(seq_lens)]),
        seq_lens=i32(list(seq_lens)),
        block_tables=torch.from_numpy(tables).to(device, non_blocking=True),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_tables_cpu=tuple(map(tuple, block_tables)),
    )
