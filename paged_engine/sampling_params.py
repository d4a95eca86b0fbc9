"""Per-request sampling settings, validated when built so a bad request never reaches a step."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy decoding, as in vLLM (``_SAMPLING_EPS = 1e-5``):
dividing logits by a temperature that small overflows to ``inf``, and its distribution
is the argmax one anyway."""

SEED_MODULUS = 2**64
"""Seeds are reduced modulo this (the range of ``torch.Generator.manual_seed``), so any
int is a seed and seeds congruent modulo ``2**64`` sample the same tokens."""


def _finite_float(name: str, x: object) -> float:
    """``x`` as a finite float: TypeError for a non-number, ValueError for one that is not
    finite or is an int beyond the float range."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"{name} must be a number, got {x!r}")
    try:
        value = float(x)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return value


def _int(name: str, x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {x!r}")
    return x


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature`` below ``GREEDY_BELOW`` (1e-5, vLLM's threshold; 0 in particular) is
    greedy decoding (argmax, first index on ties), which exact oracles need; it is stored
    as a float. ``top_k`` of None, 0 or -1 (vLLM's spellings) keeps every token and is
    stored as None; a ``top_k`` larger than the vocabulary keeps every token too.
    ``top_p == 1`` disables nucleus sampling. ``seed`` (any int, reduced modulo
    ``SEED_MODULUS``) makes one request's samples reproducible whatever else is batched
    with it: seeds ``s`` and ``s + 2**64`` sample the same tokens.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _finite_float("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", t)
        if self.top_k is not None:
            k = _int("top_k", self.top_k)
            if k < -1:
                raise ValueError(f"top_k must be None, 0 or -1 (disabled) or >= 1, got {k!r}")
            if k <= 0:
                object.__setattr__(self, "top_k", None)
        p = _finite_float("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_p", p)
        if _int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if isinstance(stops, str | bytes) or not hasattr(stops, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
        stops = tuple(stops)
        for s in stops:
            if _int("each of stop_token_ids", s) < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {s!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None:
            _int("seed", self.seed)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature < GREEDY_BELOW`` (the sampler never divides by
        such a temperature)."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a mapping, naming any key that is not a sampling parameter."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**values)
