"""The spec's sequences: the least one must carry for the allocator (``SpecSequence``: its
tokens, table and counters), and what the scheduler adds (``SpecRequest``: its stop
parameters and its place in the queues)."""

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


@dataclass(slots=True, eq=False)  # identity: two sequences may hold equal fields
class SpecRequest(SpecSequence):
    """One sequence (a completion) as the scheduler sees it: the allocator's fields, its
    stop parameters (S9), and its place in the queues (S1)."""

    seq_id: str = field(default="", kw_only=True)
    max_tokens: int | None = field(default=16, kw_only=True)
    """None: up to ``max_model_len`` (S9)."""
    ignore_eos: bool = field(default=False, kw_only=True)
    stop_token_ids: tuple[int, ...] = field(default=(), kw_only=True)
    num_prompt_tokens: int = field(default=0, init=False)
    status: str = field(default="waiting", init=False)
    """"waiting", "running" or "finished" (S1)."""
    is_prefill: bool = field(default=True, init=False)
    """Its context is not all computed (S3): a prompt, or a recomputation (S7, S11)."""
    num_prefix_hit_tokens: int | None = field(default=None, init=False)
    """Tokens the prefix cache served at its first admission (S12); None until then."""

    def __post_init__(self) -> None:
        SpecSequence.__post_init__(self)
        self.num_prompt_tokens = len(self.token_ids)

    def __eq__(self, other: object) -> bool:  # SpecSequence's field-wise == would merge
        return self is other  # two siblings whose fields agree

    def __hash__(self) -> int:
        return id(self)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
