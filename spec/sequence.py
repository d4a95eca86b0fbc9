"""The least a sequence must carry for the allocator: its tokens, table and counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.hashing import check_cache_salt
from spec.indexing import num_blocks


@dataclass(slots=True)
class SpecSequence:
    """A sequence as the reference allocator sees it (no statuses, no sampling).

    ``cache_salt`` (R4s, keyword only) keeps its blocks apart from every sequence with
    another salt or none; it is fixed for the sequence's lifetime.
    """

    token_ids: list[int]
    block_size: int
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_scheduled_tokens: int = 0
    cache_salt: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return num_blocks(len(self.token_ids), self.block_size)

    def block(self, i: int) -> tuple[int, ...]:
        """Tokens of logical block ``i``."""
        return tuple(self.token_ids[i * self.block_size : (i + 1) * self.block_size])
