"""Shared-prefix ("cascade") decode attention, the torch backend's fast decode path.

Why it exists: with prefix caching, many sequences of a decode batch begin with the *same
physical blocks* (a system prompt, few-shot examples: the blocks the prefix cache handed
out). Plain paged decode gathers those blocks once per sequence, in every layer, every
step, and runs one matrix-vector product per sequence over them. Cascade attention splits
the context of each sequence that shares a prefix in two:

* the **shared prefix**, attended once per group: every query of the group against a
  single copy of the prefix K/V (one matrix-matrix product instead of ``m`` thin ones);
* the **rest**, the sequence's own blocks, gathered per sequence as before, now short;

and merges the two partial softmaxes exactly through their log-sum-exps,
``out = out_p * exp(lse_p - lse) + out_s * exp(lse_s - lse)`` with
``lse = logaddexp(lse_p, lse_s)``. The maths is softmax attention over the whole context;
only the summation order changes (float rounding).

What it costs: the plan (below) is built once per step, on host lists of a few dozen ints
per group and a handful of small tensor ops; each layer then runs about 25 tensor ops
instead of 3. That pays when the gather it saves is large, so a group is used only when it
saves at least ``min_saved_tokens`` gathered positions (see ``find_shared_prefixes``).

Grouping is deliberately simple: sequences are grouped by their first block, and a group
shares the longest block-table prefix common to all its members. Prompts that agree on
their first block but diverge later (the same instructions, then different few-shot
examples) therefore share just their common part; a trie would split them better.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CascadePlan", "SharedPrefix", "cascade_decode", "find_shared_prefixes", "make_plan"]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Batch rows ``seqs`` (two or more) whose block tables all begin with ``blocks``.

    Every shared block lies wholly before the first new token of each member, so it holds
    K/V that this step only reads.
    """

    seqs: tuple[int, ...]
    blocks: tuple[int, ...]


def find_shared_prefixes(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    min_saved_tokens: int,
) -> tuple[SharedPrefix, ...]:
    """The groups worth attending as a cascade, in order of their first member.

    A group of ``m`` sequences sharing ``n`` blocks saves ``(m - 1) * n * block_size``
    gathered positions per layer; groups saving fewer than ``min_saved_tokens`` are left to
    the plain path. Pure host arithmetic: no tensor is touched.
    """
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(block_tables):
        if table and (seq_lens[i] - query_lens[i]) // block_size:
            by_first.setdefault(table[0], []).append(i)
    groups: list[SharedPrefix] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        # Blocks wholly before every member's first new token.
        limit = min((seq_lens[i] - query_lens[i]) // block_size for i in members)
        rows = [list(block_tables[i][:limit]) for i in members]
        # The longest prefix common to all rows is the one common to the smallest and the
        # largest in lexicographic order (C-speed comparisons, one short Python walk).
        low, high = min(rows), max(rows)
        pairs = enumerate(zip(low, high, strict=False))
        shared = next((j for j, (a, b) in pairs if a != b), len(low))
        if shared and (len(members) - 1) * shared * block_size >= min_saved_tokens:
            groups.append(SharedPrefix(tuple(members), tuple(low[:shared])))
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """One decode step's index tensors for ``cascade_decode``, shared by every layer.

    Gathers read *head rows* of the cache viewed as ``[num_slots * num_kv_heads, head_dim]``
    (row ``slot * num_kv_heads + h``), so K/V arrive as ``[batch * kv_heads, length, d]``,
    contiguous, ready for batched matmuls. Padded positions read a slot of the same
    sequence (or group) that is always written, and are masked: a never-written slot (the
    pool is uninitialised memory, NaN included) is never read.
    """

    rest_index: torch.Tensor
    """``[B * kvh * R]``: head rows of each sequence's positions past its shared prefix."""
    rest_mask: torch.Tensor
    """``[B * kvh, 1, R]`` additive: 0 for real positions, -inf for padding."""
    rest_len: int
    prefix_index: torch.Tensor
    """``[G * kvh * P]``: head rows of each group's shared prefix."""
    prefix_mask: torch.Tensor
    """``[G * kvh, 1, P]`` additive, as ``rest_mask``."""
    prefix_len: int
    member_index: torch.Tensor
    """``[G * M]``: batch row of member ``j`` of group ``g`` at ``g * M + j``; groups with
    fewer than ``M`` members repeat their first (computed, never used)."""
    max_members: int
    member_rows: torch.Tensor
    """``[T]``: the batch rows of all real members."""
    member_slots: torch.Tensor
    """``[T]``: the same members' rows in the ``[G * M]`` layout."""


def make_plan(
    groups: tuple[SharedPrefix, ...],
    block_tables: torch.Tensor,
    host_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    num_kv_heads: int,
) -> CascadePlan:
    """Index tensors for a decode step (one new token per sequence) with these groups.

    Built with numpy on the host (a few microseconds an op where torch takes several times
    that on arrays this small), then moved to ``block_tables``' device once.
    """
    device = block_tables.device
    if device.type == "cpu":
        tables = block_tables.numpy().astype(np.int64)  # rows padded with -1
    else:  # from the host copy: no device sync
        tables = np.full((len(seq_lens), max(map(len, host_tables))), -1, dtype=np.int64)
        for row, table in zip(tables, host_tables, strict=True):
            row[: len(table)] = table
    heads = np.arange(num_kv_heads)[:, None]
    skip = np.zeros(len(seq_lens), dtype=np.int64)  # shared-prefix tokens of each sequence
    for g in groups:
        skip[list(g.seqs)] = len(g.blocks) * block_size

    # The rest: positions skip_i + j for j < seq_len_i - skip_i (never empty: the newest
    # token is past every shared block); padding reads position skip_i.
    rest = np.asarray(seq_lens, dtype=np.int64) - skip
    rest_len = int(rest.max())
    cols = np.arange(rest_len)
    valid = cols < rest[:, None]
    pos = skip[:, None] + np.where(valid, cols, 0)
    slots = np.take_along_axis(tables, pos // block_size, axis=1) * block_size + pos % block_size
    rest_index = (slots[:, None, :] * num_kv_heads + heads).ravel()

    # The shared prefixes, padded to the longest; padding reads the group's first slot.
    width = max(len(g.blocks) for g in groups)
    blocks = np.array([[*g.blocks] + [g.blocks[0]] * (width - len(g.blocks)) for g in groups])
    prefix_len = width * block_size
    p_slots = (blocks[:, :, None] * block_size + np.arange(block_size)).reshape(len(groups), -1)
    shared = np.array([len(g.blocks) * block_size for g in groups])
    p_valid = np.arange(prefix_len) < shared[:, None]
    prefix_index = (p_slots[:, None, :] * num_kv_heads + heads).ravel()

    max_members = max(len(g.seqs) for g in groups)
    member_index = [
        i for g in groups for i in (*g.seqs, *[g.seqs[0]] * (max_members - len(g.seqs)))
    ]
    rows = [i for g in groups for i in g.seqs]
    flat = [n * max_members + j for n, g in enumerate(groups) for j in range(len(g.seqs))]

    def put(a: np.ndarray | list[int]) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

    return CascadePlan(
        rest_index=put(rest_index),
        rest_mask=_additive(valid, num_kv_heads).to(device),
        rest_len=rest_len,
        prefix_index=put(prefix_index),
        prefix_mask=_additive(p_valid, num_kv_heads).to(device),
        prefix_len=prefix_len,
        member_index=put(member_index),
        max_members=max_members,
        member_rows=put(rows),
        member_slots=put(flat),
    )


def _additive(valid: np.ndarray, num_kv_heads: int) -> torch.Tensor:
    """``[N, L]`` bool -> ``[N * kvh, 1, L]`` float32 0 / -inf (the fused kernel takes a
    float32 mask with any query dtype; the fallback computes in float32)."""
    mask = np.where(valid, np.float32(0), np.float32("-inf"))
    return torch.from_numpy(np.repeat(mask, num_kv_heads, axis=0)[:, None, :])


_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""torch's fused CPU attention kernel, which also returns the log-sum-exp (the public
``scaled_dot_product_attention`` drops it). An internal op: ``_partial`` falls back to plain
tensor ops where it is missing or the tensors are not on the CPU."""


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[N, n, d]`` over ``k``/``v`` ``[N, L, d]`` with an
    additive ``mask`` ``[N, 1, L]``: the output and the float32 log-sum-exp ``[N, n, 1]``."""
    if _FUSED is not None and q.device.type == "cpu":
        out, lse = _FUSED(q[None], k[None], v[None], 0.0, False, attn_mask=mask[None], scale=scale)
        return out[0], lse[0].float().unsqueeze(-1)
    # In float32, like the fused kernel's accumulators: half-precision scores, exp and sums
    # would be several times less accurate than the plain path this replaces.
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.baddbmm(mask.float(), qf, kf.transpose(1, 2), alpha=scale)
    top = scores.amax(dim=-1, keepdim=True)  # finite: every row has a real position
    weights = scores.sub_(top).exp_()  # the one exp pass (logsumexp would add another)
    total = weights.sum(dim=-1, keepdim=True)
    return torch.bmm(weights, vf).div_(total).to(q.dtype), total.log_().add_(top)


def cascade_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CascadePlan,
    scale: float,
) -> torch.Tensor:
    """Decode attention, ``query`` ``[B, H, d]`` (one token per sequence) → ``[B, H, d]``.

    The ``group`` query heads of a kv head ride the matmuls' row axis, so K/V are never
    repeated per query head.
    """
    num_seqs, num_heads, d = query.shape
    kvh = k_cache.shape[2]
    group = num_heads // kvh
    k_rows, v_rows = k_cache.view(-1, d), v_cache.view(-1, d)
    dtype = query.dtype

    q = query.reshape(num_seqs * kvh, group, d)  # a copy when query is a slice of qkv
    shape = (num_seqs * kvh, plan.rest_len, d)
    k = k_rows.index_select(0, plan.rest_index).view(shape).to(dtype)
    v = v_rows.index_select(0, plan.rest_index).view(shape).to(dtype)
    out, lse = _partial(q, k, v, plan.rest_mask, scale)  # [B * kvh, group, d | 1]

    num_groups = plan.prefix_index.numel() // (kvh * plan.prefix_len)
    m = plan.max_members
    shape = (num_groups * kvh, plan.prefix_len, d)
    kp = k_rows.index_select(0, plan.prefix_index).view(shape).to(dtype)
    vp = v_rows.index_select(0, plan.prefix_index).view(shape).to(dtype)
    qp = q.view(num_seqs, kvh, group, d).index_select(0, plan.member_index)
    qp = qp.view(num_groups, m, kvh, group, d).transpose(1, 2).reshape(-1, m * group, d)
    out_p, lse_p = _partial(qp, kp, vp, plan.prefix_mask, scale)  # [G * kvh, m * group, .]

    # Back to one row per member: [G * kvh, m * group, x] -> [G * m, kvh, group, x].
    def per_member(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(num_groups, kvh, m, group, -1).transpose(1, 2)
        return t.reshape(num_groups * m, kvh, group, -1).index_select(0, plan.member_slots)

    out_p, lse_p = per_member(out_p), per_member(lse_p)
    # reshape, not view: the fused kernel's output layout is its own business.
    out = out.reshape(num_seqs, kvh, group, d)
    lse = lse.reshape(num_seqs, kvh, group, 1)
    out_s, lse_s = out.index_select(0, plan.member_rows), lse.index_select(0, plan.member_rows)
    total = torch.logaddexp(lse_p, lse_s)
    merged = out_p * torch.exp(lse_p - total) + out_s * torch.exp(lse_s - total)
    out.index_copy_(0, plan.member_rows, merged.to(out.dtype))
    return out.reshape(num_seqs, num_heads, d)
