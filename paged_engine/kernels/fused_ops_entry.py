"""The fused CPU kernels' C entry points (``csrc/fused_ops.c``), over tensors already checked.

Each entry point reads raw addresses, strides and sizes, in one positional argument list;
these functions spell those lists once, for the two callers that check tensors their own
way: ``fused_ops_cpu``'s launchers (any caller, every argument refused with a ValueError
when wrong) and ``fused_ops_layers``' calls (a layer's contiguous tensors, one pass of
checks). Nothing here checks anything: a wrong tensor here is a wrong read or write there.
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["DTYPES", "PARALLEL_MIN_ELEMENTS", "run_add_rms_norm", "run_qk_norm_rope"]
__all__ += ["run_silu_and_mul", "tokens_overlap"]

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes the kernels take, with the code the C entry points read."""
PARALLEL_MIN_ELEMENTS = 1 << 16
"""Below this many elements a call runs on one thread (torch's own parallel grain is 32K):
a choice, not a tuned figure. Above it, ``torch.get_num_threads()`` threads where the
library is built with OpenMP (each row whole on one thread: the bits do not change)."""


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


def run_add_rms_norm(
    module: ModuleType,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
    eps: float,
    lanes: int,
    level: int,
) -> None:
    """The kernel over checked tensors: ``x`` and ``residual`` ``[rows, n]`` at any row
    stride, ``out`` and ``res_out`` new and contiguous, of ``x``'s shape."""
    rows, n = x.shape
    if rows:
        module.add_rms_norm(
            x.data_ptr(),
            x.stride(0),
            0 if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            out.data_ptr(),
            n,
            0 if res_out is None else res_out.data_ptr(),
            n,
            weight.data_ptr(),
            rows,
            n,
            eps,
            DTYPES[x.dtype],
            lanes,
            _threads(rows * n),
            level,
        )


def tokens_overlap(qk: torch.Tensor) -> bool:
    """Whether two tokens of ``qk`` ``[tokens, heads, head_dim]`` (heads contiguous) share
    memory (an expanded view): split over threads, the kernel would then write one memory
    from two. Both callers refuse it, the launcher with a ValueError."""
    tokens, heads, d = qk.shape
    return tokens > 1 and qk.stride(0) < heads * d


def run_qk_norm_rope(
    module: ModuleType,
    qk: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    num_q_heads: int,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    lanes: int,
    level: int,
) -> None:
    """The kernel over checked tensors (``qk_norm_rope_cpu_``'s), in place."""
    tokens, heads, d = qk.shape
    if tokens and heads:
        module.qk_norm_rope(
            qk.data_ptr(),
            qk.stride(0),
            tokens,
            num_q_heads,
            heads,
            0 if q_weight is None else q_weight.data_ptr(),
            0 if k_weight is None else k_weight.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            cos.stride(0),
            d,
            eps,
            DTYPES[qk.dtype],
            lanes,
            _threads(tokens * heads * d),
            level,
        )


def run_silu_and_mul(module: ModuleType, x: torch.Tensor, out: torch.Tensor, level: int) -> None:
    """The kernel over checked tensors: ``x`` ``[rows, 2d]`` at any row stride, ``out``
    ``[rows, d]`` new and contiguous."""
    rows, d = out.shape
    if rows and d:
        module.silu_and_mul(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            d,
            rows,
            d,
            DTYPES[x.dtype],
            _threads(rows * 2 * d),
            level,
        )
