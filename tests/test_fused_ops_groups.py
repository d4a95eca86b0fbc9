"""qk_norm_rope's heads in groups (csrc/fused_ops_rope.h) against add_rms_norm's rows, at every
sum width the kernel has.

tests/test_fused_ops.py holds qk_norm_rope to torch bit for bit, but only at the width torch
sums in on this CPU (``torch_sum_lanes``: 16 with AVX-512, 8 with AVX2): a group's lane
chain at the other widths would go unchecked here. So this file runs both ops through their
C entry points at each width, 4, 8 and 16. With cos 1 and sin 0 the rotation changes no
bit, and what is left of qk_norm_rope is each head's RMSNorm times its weight, which
add_rms_norm computes for the same head taken as a row of its own, one row at a time and
in the same sum order. Every head must come out the same in both, whether qk_norm_rope
grouped it (heads of at least one vector) or not (shorter heads), with groups cut short by
the item count, and at every instruction-set level.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_engine.kernels.cpu_library import ISA_CODES
from paged_engine.kernels.fused_ops_cpu import isa_levels
from tests.test_fused_ops import BF16, EPS, F32, compiled_module

DTYPE_CODE = {F32: 0, BF16: 1}
WIDTHS = (4, 8, 16)


def qk_norm_only(
    qk: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, q_heads: int, lanes: int, isa: str
) -> None:
    """qk_norm_rope in place on ``qk`` ``[tokens, heads, d]`` with cos 1 and sin 0."""
    tokens, heads, d = qk.shape
    cos = torch.ones(max(tokens, 1), d, dtype=qk.dtype)
    sin = torch.zeros(max(tokens, 1), d, dtype=qk.dtype)
    compiled_module().qk_norm_rope(
        qk.data_ptr(), heads * d, tokens, q_heads, heads, wq.data_ptr(), wk.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), d, d, EPS, DTYPE_CODE[qk.dtype], lanes, 1,
        ISA_CODES[isa],
    )  # fmt: skip


def row_norm(x: torch.Tensor, w: torch.Tensor, lanes: int, isa: str) -> torch.Tensor:
    """add_rms_norm without a residual over the rows of ``x`` ``[rows, d]``."""
    rows, d = x.shape
    out = torch.empty_like(x)
    compiled_module().add_rms_norm(
        x.data_ptr(), d, 0, 0, out.data_ptr(), d, 0, d, w.data_ptr(), rows, d, EPS,
        DTYPE_CODE[x.dtype], lanes, 1, ISA_CODES[isa],
    )  # fmt: skip
    return out


def check(
    tokens: int, q_heads: int, k_heads: int, d: int, dtype: Any, lanes: int, isa: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads = q_heads + k_heads
    qk = (torch.randn(tokens, heads, d, generator=gen) * 3).to(dtype)
    wq = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    wk = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    want = torch.cat(
        (
            row_norm(qk[:, :q_heads].reshape(-1, d).contiguous(), wq, lanes, isa).view(
                tokens, q_heads, d
            ),
            row_norm(qk[:, q_heads:].reshape(-1, d).contiguous(), wk, lanes, isa).view(
                tokens, k_heads, d
            ),
        ),
        dim=1,
    )
    got = qk.clone()
    qk_norm_only(got, wq, wk, q_heads, lanes, isa)
    same = (got == want).all(dim=-1)
    assert bool(same.all()), (
        f"{int((~same).sum())} of {tokens * heads} heads differ from the row norm: "
        f"{tokens}x({q_heads}+{k_heads})x{d} {dtype} lanes={lanes} {isa}"
    )


@pytest.mark.parametrize("isa", isa_levels())
@pytest.mark.parametrize("lanes", WIDTHS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_grouped_heads_sum_in_the_row_norms_order(dtype: Any, lanes: int, isa: str) -> None:
    # 9 x 12 = 108 heads: six whole groups of 16 and one of 12; 64 and 128 are the real
    # head dims, 72 leaves elements past the last vector at every width, 6 is shorter than
    # one vector at every width (one by one).
    for d in (6, 64, 72, 128):
        check(9, 8, 4, d, dtype, lanes, isa, seed=d)


@given(
    tokens=st.integers(1, 7),
    q_heads=st.integers(1, 6),
    k_heads=st.integers(1, 3),
    d=st.sampled_from([2, 4, 8, 12, 16, 20, 32, 40, 64, 96, 128, 256, 512, 514]),
    dtype=st.sampled_from([F32, BF16]),
    lanes=st.sampled_from(WIDTHS),
    isa=st.sampled_from(isa_levels()),
    seed=st.integers(0, 2**16),
)
def test_any_shape_sums_in_the_row_norms_order(
    tokens, q_heads, k_heads, d, dtype, lanes, isa, seed
) -> None:
    # 512 is the longest head a group takes (GROUP_MAX_D), 514 takes the items one by one.
    check(tokens, q_heads, k_heads, d, dtype, lanes, isa, seed)
