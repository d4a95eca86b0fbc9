"""``dense.causal_bias``: the additive causal mask of a prefill over a cached prefix.

Its values are held to hand-worked ones, and SDPA with it on the CPU to the same bits as
with the boolean mask it replaced (the torch backend's state machine checks the results against
naive attention: tests/test_attention_machine.py)."""

from __future__ import annotations

import pytest
import torch

from paged_engine.layers.attention.dense import causal_bias, sdpa

INF = float("-inf")
CPU = torch.device("cpu")


def test_new_rows_see_the_prefix_and_themselves_and_nothing_later() -> None:
    # 2 new tokens at positions 2 and 3 of a 4-token context
    expected = torch.tensor([[0.0, 0.0, 0.0, INF], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(causal_bias(2, 4, torch.float32, CPU), expected)
    # no cached prefix: the lower triangle
    square = torch.tensor([[0.0, INF, INF], [0.0, 0.0, INF], [0.0, 0.0, 0.0]])
    assert torch.equal(causal_bias(3, 3, torch.float32, CPU), square)
    one = causal_bias(1, 5, torch.bfloat16, CPU)
    assert one.dtype == torch.bfloat16 and torch.equal(one, torch.zeros(1, 5, dtype=one.dtype))


def test_more_new_tokens_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="3 new tokens do not fit a context of 2"):
        causal_bias(3, 2, torch.float32, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "context"), [(1, 1), (1, 9), (3, 3), (5, 17), (16, 70)])
def test_sdpa_gives_the_boolean_masks_bits(rows: int, context: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + context)
    q = torch.randn(1, 4, rows, 16, generator=gen).to(dtype)
    k, v = torch.randn(2, 1, 2, context, 16, generator=gen).to(dtype)
    seen = torch.arange(rows)[:, None] + (context - rows)
    boolean = torch.arange(context)[None, :] <= seen
    with_bool = sdpa(q, k, v, 0.25, boolean)
    with_bias = sdpa(q, k, v, 0.25, causal_bias(rows, context, dtype, CPU))
    assert torch.equal(with_bias, with_bool)
