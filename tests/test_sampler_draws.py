"""The sampler's draws when rows share a generator: unseeded requests all draw from the
engine's one generator (``ModelRunner.rng``), so they draw in one call, in row order, and
must get exactly the tokens one call per row gave; a seeded request's generator draws alone;
and a failure in a group's call costs only the row that fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from paged_engine import SamplingParams
from paged_engine.engine.outputs import FailedSample
from paged_engine.layers import sampler as sampler_module
from paged_engine.layers.sampler import Sampler
from tests.sampling_draws import draw_rows

VOCAB = 300
ROWS = 6
PARAMS = [SamplingParams(temperature=1.0)] * ROWS


def logits() -> torch.Tensor:
    # uniform rows: any change of a row's noise changes its argmax
    return torch.zeros(ROWS, VOCAB)


def generators(shared: torch.Generator) -> list[torch.Generator | None]:
    # rows 0, 2, 3 and 5 share one generator (the engine's, for unseeded requests); row 1
    # has its own (a seeded request's); row 4 has none: it draws from torch's global one,
    # seeded here for each call
    torch.manual_seed(11)
    return [shared, torch.Generator().manual_seed(7), shared, shared, None, shared]


@pytest.fixture(autouse=True)
def _global_rng() -> Iterator[None]:
    with torch.random.fork_rng():
        yield


def one_call_per_row(shared_seed: int) -> tuple[list[int], torch.Tensor]:
    """The shared generator's rows drawn one call each, in row order, written out here
    (the exponential race over a uniform row), and the generator's state after them."""
    ref = torch.Generator().manual_seed(shared_seed)
    tokens = []
    for _ in range(4):
        noise = torch.empty(1, VOCAB).exponential_(generator=ref)
        tokens.append(int((1.0 / noise.clamp_min(1e-10)).argmax()))
    return tokens, ref.get_state()


def test_rows_sharing_a_generator_get_the_tokens_of_one_call_per_row() -> None:
    shared = torch.Generator().manual_seed(3)
    got = draw_rows(logits(), PARAMS, generators(shared)).tolist()
    want, state = one_call_per_row(3)
    assert [got[0], got[2], got[3], got[5]] == want
    assert torch.equal(shared.get_state(), state), "the generator advanced by another amount"


def test_rows_sharing_a_generator_draw_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, torch.Generator | None]] = []
    real = sampler_module._draw

    def counted(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        calls.append((probs.shape[0], generator))
        return real(probs, generator)

    monkeypatch.setattr(sampler_module, "_draw", counted)
    shared = torch.Generator().manual_seed(3)
    gens = generators(shared)
    draw_rows(logits(), PARAMS, gens)
    assert sorted((n, id(g)) for n, g in calls) == sorted(
        [(4, id(shared)), (1, id(gens[1])), (1, id(None))]
    )


def test_a_group_call_that_raises_is_redone_row_by_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = torch.Generator().manual_seed(3)
    clean = draw_rows(logits(), PARAMS, generators(shared)).tolist()
    real = sampler_module._draw

    def no_groups(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if probs.shape[0] > 1:
            raise RuntimeError("injected group fault")
        return real(probs, generator)

    monkeypatch.setattr(sampler_module, "_draw", no_groups)
    shared = torch.Generator().manual_seed(3)
    assert Sampler()(logits(), PARAMS, generators(shared)) == clean


def test_a_row_that_raises_in_a_group_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = logits()
    rows[3, 0] = 1.0  # marks row 3, the third of the shared generator's rows
    shared = torch.Generator().manual_seed(3)
    clean = Sampler()(rows, PARAMS, generators(shared))
    real = sampler_module._draw

    def faulty(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        if bool((probs[:, 0] > probs[:, 1]).any()):
            raise RuntimeError("injected draw fault")
        return real(probs, generator)

    monkeypatch.setattr(sampler_module, "_draw", faulty)
    shared = torch.Generator().manual_seed(3)
    got = Sampler()(rows, PARAMS, generators(shared))
    assert isinstance(got[3], FailedSample) and "injected draw fault" in got[3].reason
    # drawn before the failing row, or from generators of their own: the clean tokens
    assert [got[0], got[1], got[2], got[4]] == [clean[0], clean[1], clean[2], clean[4]]
    assert all(isinstance(t, int) for i, t in enumerate(got) if i != 3)
