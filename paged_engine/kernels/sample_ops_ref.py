"""The readable reference of the sampler's per-row pass (``csrc/sample_ops.c``): each row's
argmax and whether it is all finite, in torch ops. The sampler runs it wherever the
compiled pass does not take the logits (another device, another dtype, no library)."""

from __future__ import annotations

import torch


def argmax_finite_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, ok)`` for ``logits`` ``[rows, vocab]``: ``tokens[i]`` the first index of
    row ``i``'s largest value (int64), ``ok[i]`` whether every value in the row is finite
    (bool). Where ``ok[i]`` is False, ``tokens[i]`` means nothing."""
    return logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1)
