"""Prefill attention over the paged KV cache, host side: many new tokens per sequence, causal.

``paged_prefill_attention`` checks its arguments, plans the launch (``prefill_plan``) and
runs the kernel of ``prefill_kernels`` (whose docstring says what it computes and how it is
shaped). A caller that launches the same shapes many times (the Triton backend, once per
layer) checks and plans once per step with ``plan_paged_prefill`` and only packs
``prefill_launches`` for each layer.
"""

from __future__ import annotations

import torch

from paged_engine.kernels.checks import check_int_vector, check_query_and_tables
from paged_engine.kernels.decode_plan import LOG2E
from paged_engine.kernels.launch import KernelLaunch, run_launches
from paged_engine.kernels.prefill_kernels import prefill_kernel
from paged_engine.kernels.prefill_plan import PrefillPlan, prefill_launch_plan
from paged_engine.kernels.store_kv import check_launchable

__all__ = [
    "PrefillPlan",
    "paged_prefill_attention",
    "plan_paged_prefill",
    "prefill_launch_plan",
    "prefill_launches",
]


def plan_paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> PrefillPlan:
    """Check a prefill launch's arguments and plan it (see ``paged_prefill_attention``)."""
    what = "paged_prefill_attention"
    batch, num_heads, num_kv_heads, head_dim, block_size = check_query_and_tables(
        what, query, k_cache, v_cache, block_tables, one_query_per_sequence=False
    )
    check_int_vector(what, "query_start_loc", query_start_loc, batch + 1, torch.int32)
    check_int_vector(what, "seq_lens", seq_lens, batch, torch.int32)
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{what}: max_query_len must be a non-negative int, got {max_query_len!r}")
    tensors = [k_cache, v_cache, block_tables, query_start_loc, seq_lens]
    check_launchable(prefill_kernel, what, query, out, *tensors)
    return prefill_launch_plan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        max_query_len=max_query_len,
        dtype=query.dtype,
        block_m=block_m,
        block_n=block_n,
    )


def prefill_launches(
    plan: PrefillPlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> tuple[KernelLaunch, ...]:
    """The launch that computes ``plan`` into ``out``; nothing is checked here."""
    if plan.batch == 0 or plan.max_query_len == 0 or query.shape[0] == 0 or plan.num_heads == 0:
        return ()
    args = (
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        block_tables.shape[1],
    )
    return (
        KernelLaunch(
            kernel=prefill_kernel,
            grid=plan.grid,
            args=args,
            constexprs=plan.constexprs(),
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        ),
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context; ``[N, H, D]``.

    ``query`` ``[N, H, D]`` packs the batch's new tokens (sequence ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]``); they are the last ``q_len_i`` tokens of a
    ``seq_lens[i]``-token context already stored in the cache. ``block_tables`` ``[B,
    max_blocks]`` int32 padded with -1; ``query_start_loc`` ``[B + 1]`` and ``seq_lens``
    ``[B]`` int32; ``max_query_len`` a host-side bound on ``q_len`` that sizes the grid (tokens
    beyond it are not computed). Query head ``h`` reads KV head ``h // (H // KVH)``. The
    cache block size may be any positive integer.

    Keyword-only tuning knobs: ``block_m`` (new tokens per tile; the tile has ``block_m *
    next_pow2(H // KVH)`` rows, which must be >= 16) and ``block_n`` (keys per tile, a power of
    two >= 16). Lengths and block ids are not checked on the device (a sync per step):
    ``q_len > seq_len`` or -1 entries inside a context are undefined behaviour.
    """
    plan = plan_paged_prefill(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        max_query_len,
        out,
        block_m=block_m,
        block_n=block_n,
    )
    if out is None:
        out = torch.empty_like(query)
    run_launches(
        prefill_launches(
            plan, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out
        )
    )
    return out
