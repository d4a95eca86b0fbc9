"""Tests that kill mutants mutmut (tox -e mutation) found alive in ``Sampler.__call__``'s
grammar-mask path and its row-by-row retry (layers/sampler.py), names under
``paged_engine.layers.``.

mutmut's selection has no structured-output test (tests/test_structured_outputs.py runs the
engine, some of it in other processes), so the mask's own rules are written here: a masked
row samples only what its bitmask allows, a row whose model logits are not all finite is
None whatever its mask, and a masked row whose mask allows nothing is None (the grammar
layer marks such a row failed; the sampler must never give it a token). Expected values are
written out by hand from those rules, never computed by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from paged_engine.engine.outputs import FailedSample
from paged_engine.layers import sampler as sampler_module
from paged_engine.layers.sampler import Sampler
from paged_engine.sampling_params import SamplingParams
from tests.outcomes import outcome

GREEDY = SamplingParams(temperature=0.0)


def _batch() -> tuple[torch.Tensor, tuple[torch.Tensor, list[int]]]:
    """Three greedy rows over 8 tokens; rows 0 and 2 masked. Row 0's own argmax is token 5,
    its mask allows only token 2 (bit 2: 4); row 1 is unmasked, argmax 3; row 2's mask
    allows nothing."""
    logits = torch.zeros(3, 8)
    logits[0, 5], logits[0, 2] = 3.0, 1.0
    logits[1, 3] = 2.0
    logits[2, 6] = 4.0
    return logits, (torch.tensor([[4], [0]], dtype=torch.int32), [0, 2])


# --------------------------------------------------------------------------------------------
# A masked row whose mask allows nothing gets None, and only that row. Kills
# sampler.xǁSamplerǁ__call____mutmut_50 (``masked.amax(dim=None)``: one maximum over every
# masked row, so row 0's allowed token made row 2 look alive) and _53 (``>= -inf``: every
# masked row alive). Either gives row 2 the argmax of an all -inf row, token 0.
# --------------------------------------------------------------------------------------------


def test_a_masked_row_that_allows_nothing_gets_none_and_only_it() -> None:
    logits, mask = _batch()
    assert Sampler()(logits, [GREEDY] * 3, [None] * 3, token_mask=mask) == [2, 3, None]


# --------------------------------------------------------------------------------------------
# A row whose model logits are not all finite is None even where its mask hides the bad
# value. Kills sampler.xǁSamplerǁ__call____mutmut_49 (``ok[at] | ...``: the mask's verdict
# overrode the finiteness check, and row 0 got its allowed token 1).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_masked_row_that_is_not_finite_gets_none_even_where_the_mask_hides_it(
    bad: float,
) -> None:
    logits = torch.zeros(2, 8)
    logits[0, 0], logits[0, 1] = bad, 1.0  # token 0 is disallowed by the mask below
    logits[1, 4] = 1.0
    mask = (torch.tensor([[2]], dtype=torch.int32), [0])  # bit 1: only token 1
    assert Sampler()(logits, [GREEDY] * 2, [None] * 2, token_mask=mask) == [None, 4]


# --------------------------------------------------------------------------------------------
# The masked rows' index follows the logits, not torch's default device. Kills
# sampler.xǁSamplerǁ__call____mutmut_43 (``_index(token_mask[1], None)``: under a meta
# default device a meta index into CPU logits raises).
# --------------------------------------------------------------------------------------------


def test_the_mask_path_ignores_torchs_default_device() -> None:
    logits, mask = _batch()
    with torch.device("meta"):
        tokens = outcome(lambda: Sampler()(logits, [GREEDY] * 3, [None] * 3, token_mask=mask))
    assert tokens == [2, 3, None]


# --------------------------------------------------------------------------------------------
# A mask of no rows changes nothing (the API allows it; the grammar layer passes None
# instead). Kills sampler.x__index__mutmut_2 (``dtype=None``) and _5 (``dtype`` dropped): an
# empty list becomes a float32 tensor, which cannot index.
# --------------------------------------------------------------------------------------------


def test_a_mask_of_no_rows_changes_nothing() -> None:
    logits, _ = _batch()
    empty = (torch.zeros(0, 1, dtype=torch.int32), [])
    assert outcome(lambda: Sampler()(logits, [GREEDY] * 3, [None] * 3, token_mask=empty)) == [
        5,
        3,
        6,
    ]


# --------------------------------------------------------------------------------------------
# When the batch's probabilities raise, each row is redone alone, picked out of the sampled
# rows with an index on the logits' device. Kills sampler.xǁSamplerǁ__call____mutmut_136
# (``rows_of``'s index built with ``device=None``: under a meta default device the healthy
# rows' retries raise too, and they fail with the broken one).
# --------------------------------------------------------------------------------------------


def test_the_row_by_row_retry_ignores_torchs_default_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # top_k=1 leaves each drawn row one token: its largest logit. top_k=7 marks the row
    # whose probabilities the patch below makes raise.
    logits = torch.zeros(3, 50)
    logits[0, 11], logits[1, 22], logits[2, 33] = 5.0, 5.0, 5.0
    params = [SamplingParams(top_k=1), SamplingParams(top_k=7), SamplingParams(top_k=1)]
    real = sampler_module.probabilities

    def faulty(rows: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        if any(p.top_k == 7 for p in ps):
            raise RuntimeError("injected fault")
        return real(rows, ps)

    monkeypatch.setattr(sampler_module, "probabilities", faulty)
    with torch.device("meta"):
        tokens = outcome(lambda: Sampler()(logits, params, [None] * 3))
    assert isinstance(tokens, list) and len(tokens) == 3
    assert [tokens[0], tokens[2]] == [11, 33]
    assert isinstance(tokens[1], FailedSample) and "injected fault" in tokens[1].reason
