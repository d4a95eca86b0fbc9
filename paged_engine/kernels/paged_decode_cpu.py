"""Launcher for the compiled CPU paged-decode kernel (``csrc/paged_decode_cpu.c``).

The kernel reads raw addresses, so everything it could misread is checked here first:
shapes, dtypes (float32 only), devices (CPU only), strides; and in C, before any read,
every block id a context touches (an exception, never a stray read). The readable
reference is ``paged_decode_attention.paged_decode_attention_ref`` (same maths, plain torch);
the tests hold the two together.

The extension is optional (``setup.py``): ``cpu_kernels_problem()`` says why it is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from paged_engine.kernels.checks import check_int_vector, check_query_and_tables

__all__ = [
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "cpu_kernels_problem",
    "geometry_problem",
    "paged_decode_attention_cpu",
]

MAX_GROUP = 16
"""Most query heads per KV head the kernel takes (its per-head state lives on the stack)."""
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
"""The head dims the launchers' shared checks accept (``checks.check_query_and_tables``)."""


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module("paged_engine._cpu_kernels"), None
    except ImportError as exc:
        return None, (
            f"the compiled CPU kernels are not built ({exc}); reinstall paged_engine on a "
            "machine with a C compiler"
        )


_MODULE, _PROBLEM = _load()


def cpu_kernels_problem() -> str | None:
    """Why the compiled CPU kernels cannot be used, or None when they can."""
    return _PROBLEM


def geometry_problem(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> str | None:
    """Why the kernel cannot take this head layout and dtype, or None when it can: the
    launcher raises it, the "cpu" backend routes such steps to torch instead."""
    if dtype != torch.float32:
        return f"only float32 is supported, got {dtype}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per KV head, got {num_heads // num_kv_heads}"
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}"
    return None


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context; returns ``[B, H, D]``.

    Arguments as ``paged_decode_attention`` (the Triton launcher): ``query`` ``[B, H, D]``
    with a unit last stride, caches as ``store_kv`` writes them, ``block_tables``
    ``[B, max_blocks]`` int32 (-1 padding past each context), ``seq_lens`` ``[B]`` int32, the
    context length including the new token. All float32 and on the CPU. A zero-length
    context gives zeros.
    """
    what = "paged_decode_attention_cpu"
    if _MODULE is None:
        raise RuntimeError(f"{what}: {_PROBLEM}")
    batch, num_heads, num_kv_heads, head_dim, block_size = check_query_and_tables(
        what, query, k_cache, v_cache, block_tables, one_query_per_sequence=True
    )
    check_int_vector(what, "seq_lens", seq_lens, batch, torch.int32)
    if not block_tables.is_contiguous():
        raise ValueError(f"{what}: block_tables must be contiguous, got {block_tables.stride()}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(
            f"{what}: out must be {tuple(query.shape)} {query.dtype} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    tensors = (query, k_cache, v_cache, block_tables, seq_lens, out)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{what}: every tensor must be on the CPU")
    if any(t.is_neg() or t.is_conj() for t in tensors):
        # Lazy negation/conjugation views: the kernel would read the raw, unnegated data.
        raise ValueError(f"{what}: resolve negated or conjugated views first (.resolve_neg())")
    problem = geometry_problem(num_heads, num_kv_heads, head_dim, query.dtype)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    if batch == 0:
        return out
    _MODULE.paged_decode_f32(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        k_cache.shape[0],
        scale,
    )
    return out
