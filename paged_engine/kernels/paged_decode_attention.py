"""Decode attention over the paged KV cache, host side: one new query token per sequence.

``paged_decode_attention`` checks its arguments, plans the launch (``decode_plan``: tiles
and split-K partitions from static shapes only) and runs the kernels of
``decode_kernels`` (whose docstring says how they are shaped). A caller that launches the
same shapes many times (the Triton backend, once per layer) checks and plans once per step
with ``plan_paged_decode`` and only packs ``decode_launches`` for each layer.
"""

from __future__ import annotations

import functools

import torch

from paged_engine.kernels.checks import check_int_vector, check_query_and_tables
from paged_engine.kernels.decode_kernels import decode_kernel, decode_merge_kernel
from paged_engine.kernels.decode_plan import (
    LOG2E,
    DecodePlan,
    choose_num_splits,
    decode_launch_plan,
)
from paged_engine.kernels.launch import KernelLaunch, run_launches
from paged_engine.kernels.store_kv import check_launchable, kernel_is_interpreted

__all__ = [
    "DecodePlan",
    "choose_num_splits",
    "decode_launch_plan",
    "decode_launches",
    "is_interpreted",
    "paged_decode_attention",
    "plan_paged_decode",
    "sm_count",
]


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (1 off-GPU, where occupancy is moot)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> DecodePlan:
    """Check a decode launch's arguments and plan it (see ``paged_decode_attention``).

    The plan depends on shapes, dtypes and the device only, so it holds for every launch
    with arguments shaped like these.
    """
    what = "paged_decode_attention"
    batch, num_heads, num_kv_heads, head_dim, block_size = check_query_and_tables(
        what, query, k_cache, v_cache, block_tables, one_query_per_sequence=True
    )
    check_int_vector(what, "seq_lens", seq_lens, batch, torch.int32)
    check_launchable(decode_kernel, what, query, out, k_cache, v_cache, block_tables, seq_lens)
    return decode_launch_plan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        table_width=block_tables.shape[1],
        dtype=query.dtype,
        sm_count=sm_count(query.device),
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        block_n=block_n,
    )


def decode_launches(
    plan: DecodePlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> tuple[KernelLaunch, ...]:
    """The launches that compute ``plan`` into ``out``; nothing is checked here (the plan
    was made from checked arguments of these shapes). Allocates the split-K partials."""
    if plan.batch == 0 or plan.num_heads == 0:
        return ()
    f32, dev = torch.float32, query.device
    shape = (plan.batch, plan.num_heads, plan.num_splits)
    if plan.split:
        part_acc = torch.empty(*shape, plan.head_dim, dtype=f32, device=dev)
        part_m = torch.empty(shape, dtype=f32, device=dev)
        part_l = torch.empty(shape, dtype=f32, device=dev)
    else:
        part_acc = part_m = part_l = out  # never touched by the kernel
    main = KernelLaunch(
        kernel=decode_kernel,
        grid=(plan.batch, plan.num_kv_heads, plan.num_splits),
        args=(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            part_acc,
            part_m,
            part_l,
            scale * LOG2E,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            plan.table_width,
            plan.partition,
            plan.num_splits,
        ),
        constexprs=plan.constexprs(),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if not plan.split:
        return (main,)
    merge = KernelLaunch(
        kernel=decode_merge_kernel,
        grid=(plan.batch, plan.num_heads),
        args=(part_acc, part_m, part_l, out, out.stride(0), out.stride(1), plan.num_splits),
        constexprs=plan.merge_constexprs(),
        num_warps=4,
        num_stages=1,
    )
    return (main, merge)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[B, H, D]``.

    ``query`` ``[B, H, D]`` (last dim contiguous), caches as written by ``store_kv``,
    ``block_tables`` ``[B, max_blocks]`` int32 padded with -1, ``seq_lens`` ``[B]`` int32
    (context length including the new token, already stored). Query head ``h`` reads KV head
    ``h // (H // KVH)``. A zero-length context yields zeros. ``head_dim`` may be any value in
    [16, 256]; the cache block size may be any positive integer.

    Keyword-only tuning knobs: ``max_seq_len`` (a host-known bound on ``seq_lens`` that
    shortens the split plan; default: the block table's capacity, which is what CUDA-graph
    capture needs), ``num_splits`` (override the split-K heuristic) and ``block_n`` (tokens
    per K/V tile, a power of two >= 16). ``seq_lens`` must not exceed ``max_seq_len``: the
    split plan covers only that many tokens. Block ids and lengths are not checked on the
    device (a sync per step); a -1 entry inside a context is undefined behaviour.

    Every call checks its arguments and plans; a caller that launches the same shapes many
    times (the Triton backend, once per layer) plans once with ``plan_paged_decode`` and
    calls ``decode_launches`` for each launch (bench/test_launch_bench.py measures both).
    """
    plan = plan_paged_decode(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        max_seq_len=max_seq_len,
        num_splits=num_splits,
        block_n=block_n,
    )
    if out is None:
        out = torch.empty_like(query)
    run_launches(decode_launches(plan, query, k_cache, v_cache, block_tables, seq_lens, scale, out))
    return out


def is_interpreted() -> bool:
    """Whether this module's kernels run under Triton's CPU interpreter."""
    return kernel_is_interpreted(decode_kernel)
