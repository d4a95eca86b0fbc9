"""The two allocators under comparison, as factories the scheduling loop can inject.

``SpecSequence`` is the least the reference allocator needs and lacks the two things a
scheduler touches besides the allocator API (``append_token`` and ``is_prefill``);
``BenchSpecSequence`` adds exactly those, the way the engine's ``Sequence`` has them,
without changing anything the spec allocator reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_engine.engine.block_manager import BlockManager as EngineBlockManager
from paged_engine.engine.sequence import Sequence
from spec.block_manager import BlockManager as SpecBlockManager
from spec.sequence import SpecSequence

__all__ = ["ENGINE", "KITS", "SPEC", "BenchSpecSequence", "Kit"]


@dataclass(slots=True)
class BenchSpecSequence(SpecSequence):
    """A ``SpecSequence`` a scheduler can drive: it can grow and be marked prefilling."""

    is_prefill: bool = True

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass(frozen=True, slots=True)
class Kit:
    """An allocator factory and the sequence factory it works with, under a name.

    ``make_bm(num_blocks, block_size)`` and ``make_seq(token_ids, block_size)`` are what
    ``bench.sim`` injects; ``Any`` because the two allocators share a protocol, not a base.
    """

    name: str
    make_bm: Callable[[int, int], Any]
    make_seq: Callable[[list[int], int], Any]


def _engine_seq(token_ids: list[int], block_size: int) -> Sequence:
    return Sequence(token_ids, block_size=block_size)


ENGINE = Kit("engine", EngineBlockManager, _engine_seq)
SPEC = Kit("spec", SpecBlockManager, BenchSpecSequence)
KITS = {kit.name: kit for kit in (ENGINE, SPEC)}
