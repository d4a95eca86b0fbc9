"""Per-request sampling settings, validated when built so a bad request never reaches a step."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature == 0`` is greedy decoding (argmax), which exact oracles need; ``top_k`` of
    None (or -1, vLLM's spelling) keeps every token; ``top_p == 1`` disables nucleus
    sampling. ``seed`` makes one request's samples reproducible whatever else is batched
    with it.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None:
            if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
                raise ValueError(f"top_k must be None, -1 (disabled) or >= 1, got {self.top_k!r}")
            if self.top_k == -1:
                object.__setattr__(self, "top_k", None)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if isinstance(stops, str | bytes) or not hasattr(stops, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
        stops = tuple(stops)
        for s in stops:
            if not _is_int(s) or s < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {s!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a mapping, naming any key that is not a sampling parameter."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**values)
