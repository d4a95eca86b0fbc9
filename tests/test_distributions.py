"""What seeded sampling draws, as distributions: chi-square tests on fixed logits.

Every draw goes through the model runner's own path: ``ModelRunner._generator`` gives a
seeded request its generator for the position it is at, and ``ModelRunner.sampler`` draws.
The expected distribution of each case is computed here from the definitions, in float64
(temperature-scaled softmax; min_p drops tokens less likely than ``min_p`` times the most
likely; top-k keeps the ``k`` most likely; top-p keeps the smallest set of the most likely
survivors whose renormalised mass reaches ``top_p``: vLLM's order, see
``SamplingParams``), never from the sampler.

Three tests per case, each a Pearson chi-square at ``ALPHA`` with fixed seeds, so the
verdicts are deterministic:

* one seeded request over ``DRAWS`` successive positions: token frequencies match;
* ``DRAWS`` requests (seeds ``0 .. DRAWS-1``) at one position: frequencies match;
* successive steps are independent: the pairs (position ``p``, ``p + 1``) of ``DRAWS``
  requests follow the product of the exact distribution with itself.

Tokens the filters drop must never be drawn (an exact check, outside the statistics).
A request at position ``p`` is a ``Sequence`` whose ``num_tokens`` is ``p`` (all the
generator reads), batched with the others; ``test_the_batched_positions_are_one_request``
shows that is the draw a request growing step by step gets. The position-blind seed
mutant (every step reuses one draw) fails the first and third tests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SEED_MODULUS, SamplingParams
from paged_engine.worker.model_runner import ModelRunner

ALPHA = 1e-3
DRAWS = 2000
MIN_EXPECTED = 5.0
"""Cells expected fewer times than this are pooled (the chi-square approximation needs it)."""

LOGITS = (0.3, 2.0, -1.0, 1.1, 0.0, 1.5, -0.4, 0.8, -1.5, -3.0, 0.55, -2.2)
"""Vocabulary order differs from probability order, so the sorted filters must map back."""

CASES: dict[str, SamplingParams] = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.5": SamplingParams(temperature=0.5),
    "temperature 2": SamplingParams(temperature=2.0),
    "top_k 3": SamplingParams(top_k=3),
    "top_p 0.7": SamplingParams(top_p=0.7),
    "min_p 0.15": SamplingParams(min_p=0.15),
    "all four": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
}


# ---- the exact distributions ---------------------------------------------------------------


def exact(params: SamplingParams) -> list[float]:
    """The distribution the definitions give for ``LOGITS`` under ``params``."""
    vocab = range(len(LOGITS))
    scaled = [x / params.temperature for x in LOGITS]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    p = [w / sum(weights) for w in weights]
    by_prob = sorted(vocab, key=lambda i: -p[i])
    keep = set(by_prob[: params.top_k or len(LOGITS)])
    if params.min_p > 0:
        floor = params.min_p * max(p)
        assert all(abs(x - floor) > 1e-3 * floor for x in p), "a token sits on the min_p edge"
        keep &= {i for i in vocab if p[i] >= floor}
    if params.top_p < 1:
        mass = sum(p[i] for i in keep)
        nucleus, cumulative = set(), 0.0
        for i in sorted(keep, key=lambda i: -p[i]):
            if cumulative >= params.top_p:
                break
            nucleus.add(i)
            cumulative += p[i] / mass
        assert abs(cumulative - params.top_p) > 1e-3, "the nucleus sits on the top_p edge"
        keep = nucleus
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in vocab]


# ---- Pearson's chi-square --------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df), integer df >= 1: the closed forms of the
    regularised upper incomplete gamma Q(df/2, x/2) (checked against tables below)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    tail = math.erfc(math.sqrt(h))
    if h == 0:
        return tail
    return tail + sum(
        math.exp(-h + (i + 0.5) * math.log(h) - math.lgamma(i + 1.5)) for i in range(df // 2)
    )


def chi_square(observed: Counter[object], expected: dict[object, float], n: int) -> float:
    """The p-value of ``observed`` (``n`` draws) against probabilities ``expected`` (cells
    of probability 0 must be empty). Small cells are pooled, smallest first."""
    impossible = {k: c for k, c in observed.items() if expected.get(k, 0.0) == 0.0}
    assert not impossible, f"drew cells of probability 0: {impossible}"
    cells = sorted((p * n, observed.get(k, 0)) for k, p in expected.items() if p > 0)
    pooled: list[tuple[float, int]] = []
    rest = (0.0, 0)
    for e, o in cells:
        rest = (rest[0] + e, rest[1] + o)
        if rest[0] >= MIN_EXPECTED:
            pooled.append(rest)
            rest = (0.0, 0)
    if rest[0] > 0:  # too small on its own: into the smallest pooled cell
        e, o = pooled.pop(0)
        pooled.insert(0, (e + rest[0], o + rest[1]))
    if len(pooled) < 2:
        return 1.0  # one cell: nothing to test
    stat = sum((o - e) ** 2 / e for e, o in pooled)
    return chi2_sf(stat, len(pooled) - 1)


def assert_fits(
    observed: Counter[object], expected: dict[object, float], n: int, what: str
) -> None:
    p = chi_square(observed, expected, n)
    assert p > ALPHA, f"{what}: chi-square p = {p:.3g} <= {ALPHA} (observed {dict(observed)})"


# NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.4: upper critical values.
TABLE = [
    (1, 0.05, 3.841),
    (1, 0.001, 10.828),
    (2, 0.001, 13.816),
    (3, 0.05, 7.815),
    (4, 0.001, 18.467),
    (5, 0.001, 20.515),
    (10, 0.05, 18.307),
    (11, 0.001, 31.264),
    (30, 0.001, 59.703),
    (35, 0.001, 66.619),
]


@pytest.mark.parametrize(("df", "alpha", "critical"), TABLE)
def test_chi2_sf_matches_the_tables(df: int, alpha: float, critical: float) -> None:
    assert chi2_sf(critical, df) == pytest.approx(alpha, rel=2e-3)


def test_chi_square_rejects_what_it_should() -> None:
    fair = {0: 0.5, 1: 0.5}
    assert chi_square(Counter({0: 1000, 1: 1000}), fair, 2000) == 1.0
    assert chi_square(Counter({0: 1100, 1: 900}), fair, 2000) < ALPHA  # chi-square 20 on 1 df
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square(Counter({0: 5, 2: 1}), fair, 6)


# ---- drawing through the runner ------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        num_kvcache_blocks=8, max_model_len=64, device="cpu", dtype="float32", num_threads=None
    )
    return ModelRunner(tiny_model_dir, config)


def draw(
    runner: ModelRunner, params: SamplingParams, requests: Iterable[tuple[int, int]]
) -> list[int]:
    """One token for each (seed, position), batched in one sampler call."""
    seqs = []
    for seed, position in requests:
        seq = Sequence([1], SamplingParams(**{**_fields(params), "seed": seed}), block_size=16)
        seq.num_tokens = position  # all the generator reads of the sequence
        seqs.append(seq)
    logits = torch.tensor([LOGITS]).expand(len(seqs), -1)
    generators = [runner._generator(s) for s in seqs]
    tokens = runner.sampler(logits, [s.sampling_params for s in seqs], generators)
    assert all(t is not None for t in tokens)
    return [int(t) for t in tokens]  # type: ignore[arg-type]


def _fields(params: SamplingParams) -> dict[str, object]:
    return {k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "min_p")}


def check_one_request(runner: ModelRunner, name: str) -> None:
    params = CASES[name]
    tokens = draw(runner, params, [(1234, p) for p in range(1, DRAWS + 1)])
    expected = dict(enumerate(exact(params)))
    assert_fits(Counter(tokens), expected, DRAWS, f"{name}, one request over {DRAWS} steps")


def check_many_requests(runner: ModelRunner, name: str) -> None:
    params = CASES[name]
    tokens = draw(runner, params, [(seed, 17) for seed in range(DRAWS)])
    expected = dict(enumerate(exact(params)))
    assert_fits(Counter(tokens), expected, DRAWS, f"{name}, {DRAWS} requests at one step")


def check_successive_steps(runner: ModelRunner, name: str) -> None:
    params = CASES[name]
    first = draw(runner, params, [(seed, 40) for seed in range(DRAWS)])
    second = draw(runner, params, [(seed, 41) for seed in range(DRAWS)])
    p = exact(params)
    product = {(i, j): p[i] * p[j] for i in range(len(p)) for j in range(len(p))}
    pairs = Counter(zip(first, second, strict=True))
    assert_fits(pairs, product, DRAWS, f"{name}, pairs of successive steps")  # type: ignore[arg-type]


CHECKS: dict[str, Callable[[ModelRunner, str], None]] = {
    "one request": check_one_request,
    "many requests": check_many_requests,
    "successive steps": check_successive_steps,
}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", list(CASES))
def test_seeded_draws_follow_the_exact_distribution(
    runner: ModelRunner, name: str, check: str
) -> None:
    CHECKS[check](runner, name)


def test_the_batched_positions_are_one_request(runner: ModelRunner) -> None:
    """A request growing token by token (one sampler call per step, as the runner makes)
    draws what ``draw`` gives its seed at those positions."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, seed=1234)
    seq = Sequence([1, 2, 3], params, block_size=16)
    grown = []
    for _ in range(30):
        (token,) = runner.sampler(torch.tensor([LOGITS]), [params], [runner._generator(seq)])
        assert token is not None
        grown.append(token)
        seq.append_token(token)
    assert grown == draw(runner, params, [(1234, p) for p in range(3, 33)])
    assert len(set(grown)) > 2  # it really samples


# ---- the mutant: a seed that ignores the position ------------------------------------------


def position_blind(self: ModelRunner, seq: Sequence) -> torch.Generator | None:
    params = seq.sampling_params
    if params.greedy:
        return None
    if params.seed is None:
        return self.rng
    g = torch.Generator(device=self.device)
    return g.manual_seed(params.seed * 1_000_003 % SEED_MODULUS)


@pytest.mark.parametrize("check", ["one request", "successive steps"])
@pytest.mark.parametrize("name", ["temperature 1", "all four"])
def test_a_position_blind_seed_is_caught(
    monkeypatch: pytest.MonkeyPatch, runner: ModelRunner, name: str, check: str
) -> None:
    monkeypatch.setattr(ModelRunner, "_generator", position_blind)
    with pytest.raises(AssertionError, match="chi-square p = "):
        CHECKS[check](runner, name)
