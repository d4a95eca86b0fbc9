"""Random samples of a file's mutants, and the score they estimate (scripts/mutation.py).

A whole file's mutants can take hours; ``--sample N --seed S`` runs N mutants drawn
uniformly, without replacement, from those of each file not yet run. mutants/sample.json
records, per file, the population drawn from (the file's not-yet-run mutants at the first
draw) and every name drawn, so the report can tell a sample from a complete run and from an
interrupted one (mutmut runs the fastest-looking mutants first, so an interrupted run is not
a random sample and its score says nothing about the rest).

The estimate is stratified: mutants decided before the first draw are counted exactly, and
the population's share of caught mutants is estimated from the drawn ones that are decided,
with a Wilson 95% interval (it stays inside [0, 1] and keeps its coverage at small samples
and at scores near 100%, where the normal approximation does not).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

CAUGHT = frozenset({"killed", "killed later", "timeout"})
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(caught: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for ``caught`` successes in ``n`` draws."""
    if n <= 0 or not 0 <= caught <= n:
        raise ValueError(f"need 0 <= caught <= n and n > 0, got caught={caught}, n={n}")
    p = caught / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(slots=True)
class FileSample:
    """One file's draws: the population (names not run at the first draw) and those drawn."""

    population: list[str]
    drawn: list[str]


@dataclass(slots=True, frozen=True)
class Estimate:
    """A sampled file's estimated score and its 95% interval, all in [0, 1]."""

    score: float
    low: float
    high: float
    drawn_decided: int
    drawn: int
    population: int


def read_samples(path: Path) -> dict[str, FileSample]:
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {f: FileSample(list(s["population"]), list(s["drawn"])) for f, s in raw.items()}


def write_samples(path: Path, samples: dict[str, FileSample]) -> None:
    """Written whole to a temporary file and renamed, so a reader never sees half."""
    raw = {f: {"population": s.population, "drawn": s.drawn} for f, s in sorted(samples.items())}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw, indent=1))
    tmp.replace(path)


def draw(
    samples: dict[str, FileSample], not_run: dict[str, list[str]], n: int, seed: int
) -> list[str]:
    """Draw up to ``n`` more of each file's population (``not_run``'s names, for a file not
    sampled before) that are neither drawn nor decided yet; updates ``samples`` and returns
    the new names. Uniform over the population: earlier draws plus these are a uniform
    sample without replacement of it (a later draw with the same seed picks other names)."""
    if n < 1:
        raise ValueError(f"the sample size must be at least 1, got {n}")
    picked: list[str] = []
    for path in sorted(not_run):
        sample = samples.setdefault(path, FileSample(sorted(not_run[path]), []))
        waiting = set(not_run[path])
        drawn = set(sample.drawn)
        pool = [m for m in sample.population if m in waiting and m not in drawn]
        rng = random.Random(f"{seed}:{path}:{len(sample.drawn)}")
        new = rng.sample(pool, min(n, len(pool)))
        sample.drawn.extend(new)
        picked.extend(new)
    return picked


def estimate(verdicts: dict[str, str], sample: FileSample) -> Estimate | None:
    """The file's estimated score from its verdicts (name -> verdict); None while no drawn
    mutant is decided. Names outside the population are counted exactly; the population
    contributes its size times the drawn mutants' caught share."""
    population = set(sample.population)
    outside = [v for m, v in verdicts.items() if m not in population and v != "not run"]
    drawn = [verdicts[m] for m in sample.drawn if m in verdicts]
    decided = [v for v in drawn if v != "not run"]
    if not decided:
        return None
    caught = sum(v in CAUGHT for v in decided)
    low, high = wilson(caught, len(decided))
    known = sum(v in CAUGHT for v in outside)
    size = len(outside) + len(population)

    def scaled(share: float) -> float:
        return (known + share * len(population)) / size

    return Estimate(
        scaled(caught / len(decided)),
        scaled(low),
        scaled(high),
        len(decided),
        len(drawn),
        len(population),
    )
