"""Deterministic request traces for the allocator benchmarks: waves sharing long prefixes.

The shape exercises what distinguishes a prefix-caching allocator from a plain one:

* A *library* of ``library_size`` prefixes (think system prompts or few-shot blocks) of
  512-2048 tokens each. Every wave draws a few of them, and every request of the wave
  starts with one of those, so requests of a wave share the prefix's full blocks.
* A wave arrives only when the previous one has drained (no request waiting or running;
  ``bench.sim`` enforces this). Every block of a wave is therefore released before the
  next wave, with its hash still registered (lazy eviction, R3). When a later wave draws
  a prefix again, its blocks are *revived* from the free queue (R6), which is the
  operation nano-vllm does in O(pool) and the engine in O(1). Draining also makes each
  wave a clean unit: the figures do not depend on arrival timing.
* Per-request random suffixes (16-256 tokens) make every prompt distinct after the
  prefix, and per-request output scripts (32-256 tokens) stand in for sampling: the fake
  model "samples" the script's next token, so a run is fully deterministic.

Tokens are drawn uniformly from ``[0, vocab_size)``; with 32,000 symbols two random
16-token blocks never coincide, so every prefix-cache hit comes from a shared prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Trace", "TraceConfig", "TraceRequest", "Wave", "make_trace", "trace_summary"]


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Parameters of a trace; ranges are inclusive ``(low, high)`` drawn uniformly.

    The defaults are the benchmark's trace: 16-64 requests a wave over 1-4 of 8 library
    prefixes, so a wave has several requests per prefix (sharing in use) and a prefix
    recurs every few waves (revival after release).
    """

    num_waves: int = 8
    requests_per_wave: tuple[int, int] = (16, 64)
    library_size: int = 8
    prefixes_per_wave: tuple[int, int] = (1, 4)
    prefix_len: tuple[int, int] = (512, 2048)
    suffix_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (32, 256)
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        ranges = {
            "requests_per_wave": self.requests_per_wave,
            "prefixes_per_wave": self.prefixes_per_wave,
            "prefix_len": self.prefix_len,
            "suffix_len": self.suffix_len,
            "output_len": self.output_len,
        }
        for name, (low, high) in ranges.items():
            if not 0 <= low <= high:
                raise ValueError(f"{name} must satisfy 0 <= low <= high, got {(low, high)}")
        if self.output_len[0] < 1:
            raise ValueError("every request must produce at least one token")
        if self.prefix_len[0] + self.suffix_len[0] < 1:
            raise ValueError("every prompt needs at least one token")
        if self.prefixes_per_wave[1] > self.library_size:
            raise ValueError("a wave cannot draw more prefixes than the library holds")
        if self.num_waves < 0 or self.vocab_size < 1:
            raise ValueError("num_waves must be >= 0 and vocab_size >= 1")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: its prompt, and the tokens the fake model will "sample", in order.

    ``prefix_id`` names the library prefix the prompt starts with (for summaries only).
    """

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    prefix_id: int


Wave = tuple[TraceRequest, ...]
Trace = tuple[Wave, ...]


def _tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def make_trace(config: TraceConfig) -> Trace:
    """The trace ``config`` describes; the same config always gives the same trace.

    Draw order is fixed (library first, then wave by wave), so a trace with fewer waves
    is a prefix of one with more: shortening a run never changes the waves it keeps.
    """
    rng = random.Random(config.seed)
    library = [
        _tokens(rng, rng.randint(*config.prefix_len), config.vocab_size)
        for _ in range(config.library_size)
    ]
    waves: list[Wave] = []
    for _ in range(config.num_waves):
        chosen = rng.sample(range(config.library_size), rng.randint(*config.prefixes_per_wave))
        wave = []
        for _ in range(rng.randint(*config.requests_per_wave)):
            pid = rng.choice(chosen)
            suffix = _tokens(rng, rng.randint(*config.suffix_len), config.vocab_size)
            output = _tokens(rng, rng.randint(*config.output_len), config.vocab_size)
            wave.append(TraceRequest(library[pid] + suffix, output, pid))
        waves.append(tuple(wave))
    return tuple(waves)


def trace_summary(trace: Trace) -> dict[str, int]:
    """Sizes worth printing beside a benchmark figure."""
    requests = [r for wave in trace for r in wave]
    revisits = 0
    seen: set[int] = set()
    for wave in trace:
        used = {r.prefix_id for r in wave}
        revisits += len(used & seen)
        seen |= used
    return {
        "waves": len(trace),
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(len(r.output) for r in requests),
        "prefix_revisits": revisits,
    }
