"""Launcher for the compiled CPU store (``csrc/store_kv_cpu.c``): one step's new K/V rows
into their pool slots, one row copy each.

Why: the torch backend's store, ``index_copy_``, copies element by element on the CPU, and
a prefill step stores hundreds of rows per layer (bench/test_store_kv_bench.py measures
both side by side).

The C code copies raw bytes, so everything it could misread is checked here first: shapes,
dtypes, devices and strides, once per step and argument layout (``check_store_kv_cpu``
returns a ``StoreLaunch``, ``run_store_kv_cpu`` runs one, as the decode launcher splits
them); and in C, before any row is written, every slot against the pool's size, so a bad
slot mapping raises and leaves the pool as it was. A negative slot is skipped, as
``store_kv_ref`` (the readable reference) skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_engine.kernels.checks import check_store_layout
from paged_engine.kernels.cpu_library import load_decode_module

__all__ = ["StoreLaunch", "check_store_kv_cpu", "run_store_kv_cpu", "store_kv_cpu"]

_COMPILED, _PROBLEM = load_decode_module()
"""The compiled module (``_cpu_kernels``, which holds the store too), or None and why."""


@dataclass(frozen=True, slots=True)
class StoreLaunch:
    """What the C store needs besides the tensors' addresses, derived by the checks."""

    row_bytes: int
    """One token's K (or V) row: kv_heads x head_dim elements, contiguous in the pool."""
    key_stride: int
    """Bytes from one key row to the next (the qkv projection's row, for a view of it)."""
    value_stride: int
    num_slots: int
    """The pool's slots, num_blocks x block_size: every slot must be below it."""


def check_store_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> StoreLaunch:
    """Everything ``run_store_kv_cpu`` relies on, checked; ValueError naming the problem
    (RuntimeError when the compiled library is missing). ``key``/``value`` ``[N, kv_heads,
    head_dim]`` with each token's heads contiguous, caches ``[num_blocks, block_size,
    kv_heads, head_dim]`` contiguous, all of one dtype, on the CPU; ``slot_mapping`` ``[N]``
    int64, contiguous."""
    what = "store_kv_cpu"
    if _COMPILED is None:
        raise RuntimeError(f"{what}: {_PROBLEM}")
    num_blocks, block_size, num_kv_heads, head_dim = check_store_layout(
        what, key, value, k_cache, v_cache, slot_mapping
    )
    names = ("key", "value", "k_cache", "v_cache", "slot_mapping")
    for name, t in zip(names, (key, value, k_cache, v_cache, slot_mapping), strict=True):
        if t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be on the CPU, got {t.device}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"{what}: slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"{what}: slot_mapping must be contiguous, got {slot_mapping.stride()}")
    itemsize = k_cache.element_size()
    row = num_kv_heads * head_dim
    strides = []
    for name, t in (("key", key), ("value", value)):
        if t.is_neg() or t.is_conj():
            raise ValueError(f"{what}: {name} is a lazy negated or conjugated view; resolve it")
        if num_kv_heads > 1 and t.stride(1) != head_dim:
            raise ValueError(
                f"{what}: {name}'s heads must be contiguous within a token (stride "
                f"{head_dim} on dim 1), got strides {t.stride()}"
            )
        if t.shape[0] > 1 and t.stride(0) < row:
            raise ValueError(f"{what}: {name}'s token rows overlap, strides {t.stride()}")
        strides.append((t.stride(0) if t.shape[0] > 1 else row) * itemsize)
    return StoreLaunch(row * itemsize, strides[0], strides[1], num_blocks * block_size)


def run_store_kv_cpu(
    launch: StoreLaunch,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> int:
    """Copy every row whose slot is not negative into both caches, in place; returns the
    rows stored. ``launch`` must come from ``check_store_kv_cpu`` on arguments of this
    layout; a slot past the pool raises ValueError (from C) before anything is written."""
    assert _COMPILED is not None  # a StoreLaunch exists only where the module does
    stored: int = _COMPILED.module.store_kv(
        key.data_ptr(),
        launch.key_stride,
        value.data_ptr(),
        launch.value_stride,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        launch.row_bytes,
        launch.num_slots,
    )
    return stored


def store_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> int:
    """Check, then store (``check_store_kv_cpu``, ``run_store_kv_cpu``)."""
    launch = check_store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)
    return run_store_kv_cpu(launch, key, value, k_cache, v_cache, slot_mapping)
