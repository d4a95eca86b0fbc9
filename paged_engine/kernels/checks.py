"""Argument checks shared by every kernel launcher (Triton and the compiled CPU kernel).

Plain torch, no Triton: the CPU kernel's launcher must import without it. The cache layout
they enforce is the one ``store_kv`` writes: ``[num_blocks, block_size, kv_heads, head_dim]``,
contiguous, K and V alike.
"""

from __future__ import annotations

import torch


def check_kv_caches(what: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """Validate a K/V cache pair; return ``(num_blocks, block_size, num_kv_heads, head_dim)``.

    The kernels index the caches with one set of strides, so both must have the same shape,
    dtype and (contiguous) layout.
    """
    if k_cache.dim() != 4:
        raise ValueError(
            f"{what}: k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{what}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if k_cache.shape[2] < 1:
        raise ValueError(f"{what}: the caches have no KV heads, shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{what}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous, got strides {cache.stride()}")
    return tuple(k_cache.shape)


def check_store_layout(
    what: str,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, ...]:
    """A store's rows against its caches (``check_kv_caches``' shape, returned): ``key`` and
    ``value`` ``[N, kv_heads, head_dim]`` of the cache's dtype, unit stride on the last dim,
    and a 1-D ``slot_mapping`` of ``N`` slots. Its dtype is each launcher's to check."""
    shape = check_kv_caches(what, k_cache, v_cache)
    num_kv_heads, head_dim = shape[2], shape[3]
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{what}: {name} must be [N, {num_kv_heads}, {head_dim}] to match the cache, "
                f"got {tuple(t.shape)}"
            )
        if t.stride(2) != 1 and head_dim > 1:
            raise ValueError(
                f"{what}: {name} must have unit stride on its last dim, got strides {t.stride()}"
            )
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{what}: {name} dtype {t.dtype} != cache dtype {k_cache.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"{what}: value shape {tuple(value.shape)} != key {tuple(key.shape)}")
    num_tokens = key.shape[0]
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"{what}: slot_mapping must have shape [{num_tokens}], got {tuple(slot_mapping.shape)}"
        )
    return shape


def check_int_vector(
    what: str, name: str, t: torch.Tensor, length: int, dtype: torch.dtype
) -> None:
    """Validate a contiguous 1-D metadata tensor of ``length`` elements of ``dtype``."""
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{what}: {name} must have shape [{length}], got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{what}: {name} must be {dtype}, got {t.dtype}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{what}: {name} must be contiguous, got stride {t.stride(0)}")


def check_query_and_tables(
    what: str,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    one_query_per_sequence: bool,
) -> tuple[int, int, int, int, int]:
    """Validate an attention launcher's query, caches and block table against each other.

    Returns ``(batch, num_heads, num_kv_heads, head_dim, block_size)``. With
    ``one_query_per_sequence`` (decode) the query is ``[B, H, D]`` and the table needs one row
    per query row; otherwise (prefill) the query packs ``N`` tokens and the table's rows are
    the batch.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_caches(what, k_cache, v_cache)
    if query.dim() != 3:
        rows = "B" if one_query_per_sequence else "N"
        raise ValueError(f"{what}: query must be [{rows}, H, D], got shape {tuple(query.shape)}")
    num_rows, num_heads, q_dim = query.shape
    if q_dim != head_dim:
        raise ValueError(f"{what}: query head_dim {q_dim} != cache head_dim {head_dim}")
    if not 16 <= head_dim <= 256:
        raise ValueError(f"{what}: head_dim must be in [16, 256], got {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{what}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if query.stride(2) != 1:
        raise ValueError(f"{what}: query needs unit stride on its last dim, got {query.stride()}")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"{what}: query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if block_tables.dim() != 2 or (one_query_per_sequence and block_tables.shape[0] != num_rows):
        batch = num_rows if one_query_per_sequence else "B"
        raise ValueError(
            f"{what}: block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"{what}: block_tables must be int32, got {block_tables.dtype}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(
            f"{what}: block_tables rows must be contiguous, got {block_tables.stride()}"
        )
    return block_tables.shape[0], num_heads, num_kv_heads, head_dim, block_size
