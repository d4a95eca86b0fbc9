"""Scatter one step's new K/V rows into the paged KV cache.

Every attention backend runs this before attending: the attention kernels read the whole
context, including this step's tokens, through the block table, so the new rows must already
sit in their slots. ``slot_mapping[i]`` is the flat slot (``block_id * block_size + offset``)
of token ``i``; -1 marks a token whose K/V must not be written (a padded row, or a token whose
block is shared and already filled by a prefix-cache hit).

The module also holds the checks the Triton attention launchers share that depend on the
kernel (dtype, device, interpreter: ``check_launchable``); the layout checks, plain torch,
are ``checks``'s. The readable reference is ``store_kv_ref``.
"""

# Triton kernels cannot carry Python annotations on their parameters (Triton reads
# annotations as specialisation hints), and triton.jit is untyped: exempt just those two checks.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from paged_engine.kernels.checks import check_store_layout
from paged_engine.kernels.decode_plan import next_power_of_2
from paged_engine.kernels.launch import KernelLaunch, run_launches

__all__ = [
    "INTERPRETER_DTYPES",
    "SUPPORTED_DTYPES",
    "check_dtype",
    "check_launchable",
    "check_runnable",
    "check_store_kv",
    "kernel_is_interpreted",
    "store_kv",
    "store_kv_launches",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
"""Cache/activation dtypes the kernels accept on a GPU."""

INTERPRETER_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.float32)
"""Dtypes that compute correctly under ``TRITON_INTERPRET=1`` (its bfloat16 maths is broken)."""


def kernel_is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was built for Triton's CPU interpreter.

    Triton decides at decoration time, i.e. when the kernel module is first imported, from
    ``TRITON_INTERPRET``; setting the variable later changes nothing. Checking the kernel
    object itself is therefore the only reliable way to know what a launch will do.
    """
    return isinstance(kernel, InterpretedFunction)


def check_runnable(kernel: object, what: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless ``kernel`` can run on the tensors' (shared) device.

    A compiled kernel needs CUDA tensors; an interpreted one runs anywhere (slowly).
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{what}: all tensors must be on one device, got {names}")
    device = next(iter(devices))
    if device.type != "cuda" and not kernel_is_interpreted(kernel):
        raise ValueError(
            f"{what}: tensors are on {device} but the Triton kernel was compiled for a GPU; "
            "on a machine without CUDA set TRITON_INTERPRET=1 before importing "
            "paged_engine.kernels modules"
        )


def check_dtype(kernel: object, what: str, dtype: torch.dtype) -> None:
    """Raise ValueError for dtypes the kernels (or the interpreter running them) cannot do."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{what}: dtype {dtype} is not supported; use float16, bfloat16, float32")
    if kernel_is_interpreted(kernel) and dtype not in INTERPRETER_DTYPES:
        raise ValueError(
            f"{what}: dtype {dtype} is unsupported under TRITON_INTERPRET=1 (the interpreter's "
            "bfloat16 arithmetic is broken); use float16 or float32 there"
        )


def check_launchable(
    kernel: object,
    what: str,
    query: torch.Tensor,
    out: torch.Tensor | None,
    *tensors: torch.Tensor,
) -> None:
    """An attention launcher's last checks: ``out`` (if given) must be shaped and typed like
    ``query``, and ``kernel`` must handle the dtype and run where all the tensors are."""
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(
                f"{what}: out must be {tuple(query.shape)} {query.dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if out.stride(2) != 1:
            raise ValueError(f"{what}: out needs unit stride on its last dim, got {out.stride()}")
    check_dtype(kernel, what, query.dtype)
    check_runnable(kernel, what, query, *tensors, *([out] if out is not None else []))


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_sm,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: it moves all heads of that token's K and V row, so a slot is
    # read once and the writes to the cache are contiguous (heads and dims are adjacent).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token * stride_sm).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A skipped token (slot -1) writes zero heads: masking instead of returning early keeps
    # the kernel branch-free, and a skipped token costs one scalar load.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    v = tl.load(value_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    # The cache is contiguous (checked): a slot is NUM_KV_HEADS * HEAD_DIM elements, a known
    # multiple, and the slot is int64, so pools past 2**31 elements do not wrap around.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask)
    tl.store(v_cache_ptr + dst, v, mask)


def check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``store_kv``'s argument checks (see there); raises ValueError naming the problem."""
    what = "store_kv"
    check_store_layout(what, key, value, k_cache, v_cache, slot_mapping)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    check_dtype(_store_kv_kernel, what, k_cache.dtype)
    check_runnable(_store_kv_kernel, what, key, value, k_cache, v_cache, slot_mapping)


def store_kv_launches(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[KernelLaunch, ...]:
    """The launch that performs ``store_kv`` on checked arguments (none for no tokens)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return ()
    args = (
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        slot_mapping.stride(0),
    )
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "BLOCK_H": next_power_of_2(num_kv_heads),
        "BLOCK_D": next_power_of_2(head_dim),
    }
    return (KernelLaunch(_store_kv_kernel, (num_tokens,), args, constexprs, 4, 1),)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[N, num_kv_heads, head_dim]`` into their cache slots.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV projection) as long as
    the last dimension is contiguous; the caches must be contiguous
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. Slots equal to -1 are skipped. Slot
    values are not range-checked (that would need a device sync every step): a slot outside
    ``[0, num_blocks * block_size)`` is undefined behaviour, exactly as in vLLM.
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    run_launches(store_kv_launches(key, value, k_cache, v_cache, slot_mapping))
