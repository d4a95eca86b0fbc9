"""One draw per row straight from the sampler's parts: ``probabilities``, then ``_draws``.

The draw tests need the noise alone, without ``Sampler.__call__``'s greedy rows, processors,
masks and finiteness check; the product has no such entry point, so it lives here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_engine.layers.sampler import _draws, probabilities
from paged_engine.sampling_params import SamplingParams


def draw_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of ``logits`` ``[R, V]`` drawn under ``params`` (a NaN row draws
    garbage, never fails; a draw that raises propagates)."""
    return _draws(probabilities(logits, params), generators, list(range(len(params))), {})
