"""The allocator under observation, for spec/crosshair_targets.py's scenarios.

``Watch`` wraps a reference pool: each call the scenarios make goes through it, with the
allocator's method contracts and R12 restated as checks that record a broken rule by name
instead of raising, and every allocator call is wrapped by ``plain`` so that CrossHair
does not enforce the callee's own contracts (crosshair_targets' docstring says why).
``split`` turns a symbolic size into a plain int by case-splitting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar, cast

from spec.block_manager import BlockManager, simple_block_hash
from spec.sequence import SpecSequence

__all__ = ["Watch", "plain", "split", "watch"]

P = ParamSpec("P")
R = TypeVar("R")

_no_enforce: Callable[[Callable[..., object]], Callable[..., object]] | None
try:
    from crosshair.condition_parser import NoEnforce

    _no_enforce = NoEnforce
except ImportError:  # without CrossHair nothing enforces contracts anyway
    _no_enforce = None


def plain(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with its contracts left unenforced by CrossHair (see the module docstring)."""
    return fn if _no_enforce is None else cast(Callable[P, R], _no_enforce(fn))


@dataclass(slots=True)
class Watch:
    """A pool under observation: every call goes through here and records the rules it
    broke, by name, once each."""

    bm: BlockManager
    broken: list[str] = field(default_factory=list)

    def expect(self, ok: bool, rule: str) -> None:
        if not ok and rule not in self.broken:
            self.broken.append(rule)

    def invariants(self, seqs: list[SpecSequence]) -> None:
        """R12, with the holders of every block."""
        try:
            plain(self.bm.check_invariants)(seqs)
        except AssertionError:
            self.expect(False, "R12 invariants")

    def admit(self, seq: SpecSequence) -> int | None:
        """can_allocate, then allocate with its answer (the scheduler's admission)."""
        hits = plain(self.bm.can_allocate)(seq)
        if hits is None:
            return None
        self.expect(0 <= hits < seq.num_blocks, "R5 can_allocate range")
        plain(self.bm.allocate)(seq, hits)
        self.expect(len(seq.block_table) == seq.num_blocks, "R6 allocate table")
        self.expect(seq.num_cached_tokens == hits * self.bm.block_size, "R6 cached tokens")
        return hits

    def compute(self, seq: SpecSequence, num_tokens: int) -> None:
        """A step computed ``num_tokens`` tokens of ``seq``: register (R8), advance."""
        seq.num_scheduled_tokens = num_tokens
        cached = seq.num_cached_tokens
        plain(self.bm.hash_blocks)(seq)
        self.expect(seq.num_cached_tokens == cached, "R8 hash_blocks counters")
        seq.num_cached_tokens += num_tokens
        seq.num_scheduled_tokens = 0

    def release(self, seq: SpecSequence) -> None:
        """deallocate: table cleared, nothing cached, and the blocks it was the last
        holder of appended to the free queue's tail, last block first (R3; block ids are
        part of the contract, FIFO reuse is deterministic)."""
        freed = [b for b in reversed(seq.block_table) if self.bm.ref_counts[b] == 1]
        queue = list(self.bm.free_queue)
        plain(self.bm.deallocate)(seq)
        self.expect(seq.block_table == [] and seq.num_cached_tokens == 0, "R3 deallocate")
        self.expect(self.bm.free_queue == queue + freed, "R3 free queue order")

    def pool_restored(self) -> None:
        """R3 once every sequence is released: every block free, every ref count zero."""
        bm = self.bm
        restored = sorted(bm.free_queue) == list(range(bm.num_blocks)) and not any(bm.ref_counts)
        self.expect(restored, "R3 pool restored")


def split(value: int, lo: int, hi: int) -> int:
    """``value`` (``lo <= value <= hi``) as a plain int, by trying each candidate: CrossHair
    forks once per value and runs the rest of the path on concrete sizes, about three
    times as many paths per second as on symbolic ones. Outside the bounds (a ``pre:``
    line and a split that disagree) it raises, which CrossHair reports as an error."""
    for candidate in range(lo, hi + 1):
        if value == candidate:
            return candidate
    raise ValueError(f"{value} is outside [{lo}, {hi}]")


def watch(make: type[BlockManager], num_blocks: int, block_size: int) -> Watch:
    return Watch(plain(make)(num_blocks, block_size, hash_fn=simple_block_hash))
