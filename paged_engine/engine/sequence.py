"""One request's state: its tokens, counters and block table.

Rule numbers refer to docs/design.md, "Allocator rules".
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, auto
from itertools import count
from typing import Any

from paged_engine.engine.indexing import last_block_num_tokens, num_blocks
from paged_engine.sampling_params import SamplingParams

_INT64_MAX = 2**63 - 1
_seq_ids = count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request moving through WAITING -> RUNNING -> FINISHED (and back on preemption).

    ``block_table[i]`` is the physical block holding logical block ``i``: the page table of
    the paged KV cache. ``num_cached_tokens`` tokens already have K/V in the cache;
    ``num_scheduled_tokens`` are computed in the current step (chunked prefill computes a
    long prompt over several steps).

    ``block_hashes`` caches the hash chain (R4) of the sequence's full blocks, so each is
    computed once per lifetime although ``can_allocate`` runs every step while the request
    waits, and again after a preemption. Full blocks never change, so it never goes stale.
    It belongs to the allocator that filled it (one hash function per sequence).
    ``block_bytes`` likewise caches the full blocks packed the way R4 hashes them (int64
    little-endian, one bytes object per block): the allocator's token check (R10) and
    its record of a registered block's tokens reuse them.

    ``cache_salt`` (R4s): a non-empty string mixed into the hash of block 0, so the
    sequence shares no block with one under another salt or none (tenant isolation);
    None for none. Read-only: the cached hashes depend on it.
    """

    __slots__ = (
        "_cache_salt",
        "block_bytes",
        "block_hashes",
        "block_size",
        "block_table",
        "is_prefill",
        "last_token",
        "num_cached_tokens",
        "num_prefix_hit_tokens",
        "num_prompt_tokens",
        "num_scheduled_tokens",
        "num_tokens",
        "sampling_params",
        "seq_id",
        "status",
        "token_ids",
    )

    def __init__(
        self,
        token_ids: Iterable[int],
        sampling_params: SamplingParams | None = None,
        *,
        block_size: int = 16,
        seq_id: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        if set(map(type, tokens)) != {int}:  # C-speed scan; bool and floats are refused
            bad = next(t for t in tokens if type(t) is not int)
            raise TypeError(f"token ids must be ints, got {bad!r}")
        if min(tokens) < 0 or max(tokens) > _INT64_MAX:
            bad = next(t for t in tokens if not 0 <= t <= _INT64_MAX)
            raise ValueError(f"token ids must be in [0, 2**63), got {bad}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if cache_salt == "":  # as vLLM: "" would read as "no salt", yet isolate like one
            raise ValueError("cache_salt must be a non-empty string")
        self._set_fields(tokens, sampling_params, block_size, seq_id, cache_salt)

    @classmethod
    def from_checked_tokens(
        cls,
        token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_size: int,
        cache_salt: str | None,
    ) -> Sequence:
        """A sequence over ``token_ids`` (taken, not copied) without ``__init__``'s checks.

        Why it exists: ``LLMEngine`` has already checked every token (ints in
        ``[0, vocab_size)``, ``inputs.parse_prompt``), the salt and the block size (the
        config's) before it builds a request's sequences; checking the tokens again cost
        about half of ``add_request`` (a 1,400-token prompt: ~75 of ~125 us, three C-speed
        scans). The caller guarantees what ``__init__`` would have checked, and that
        nothing else holds ``token_ids`` (the sequence appends to it).
        """
        seq = cls.__new__(cls)
        seq._set_fields(token_ids, sampling_params, block_size, None, cache_salt)
        return seq

    def _set_fields(
        self,
        tokens: list[int],
        sampling_params: SamplingParams | None,
        block_size: int,
        seq_id: int | None,
        cache_salt: str | None,
    ) -> None:
        self.seq_id: int = next(_seq_ids) if seq_id is None else seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = tokens
        self.last_token: int = tokens[-1]
        self.num_tokens: int = len(tokens)
        self.num_prompt_tokens: int = len(tokens)
        self.num_cached_tokens: int = 0
        self.num_scheduled_tokens: int = 0
        # Prompt tokens the prefix cache served at the first admission; None until then.
        self.num_prefix_hit_tokens: int | None = None
        self.is_prefill: bool = True
        self.block_table: list[int] = []
        self.block_size: int = block_size
        self.sampling_params: SamplingParams = sampling_params or SamplingParams()
        self.block_hashes: list[int] = []
        self.block_bytes: list[bytes] = []
        self._cache_salt = cache_salt

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"cached={self.num_cached_tokens}, table={self.block_table})"
        )

    @property
    def cache_salt(self) -> str | None:
        return self._cache_salt

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.num_tokens, self.block_size)

    @property
    def last_block_num_tokens(self) -> int:
        return last_block_num_tokens(self.num_tokens, self.block_size)

    def block(self, i: int) -> tuple[int, ...]:
        """Tokens of logical block ``i``."""
        bs = self.block_size
        return tuple(self.token_ids[i * bs : (i + 1) * bs])

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def __getstate__(self) -> tuple[Any, ...]:
        """The compact state a tensor-parallel worker receives each step (docs/design.md,
        "The step hand-off"): the counters and the block table, plus every token id while
        prefilling (the worker embeds the scheduled ones) but only ``last_token`` while
        decoding, so a decode step's hand-off does not grow with the sequence
        (tests/test_tp_handoff.py).

        Dropped on purpose: ``sampling_params``, because sampling happens on rank 0 only
        (the worker-side sequence gets default params; the one thing a worker's forward
        pass reads from them, which prompt rows become logits for ``prompt_logprobs``,
        travels beside the sequences in ``worker/handoff.StepMessage``); and
        ``cache_salt``, hashes and the prefix-hit count, because only the allocator reads
        them, and it runs on rank 0, never in a worker."""
        last: int | list[int] = self.token_ids if self.is_prefill else self.last_token
        return (
            self.seq_id,
            self.block_size,
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_scheduled_tokens,
            self.block_table,
            last,
        )

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (
            self.seq_id,
            self.block_size,
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_scheduled_tokens,
            self.block_table,
            last,
        ) = state
        self.is_prefill = isinstance(last, list)
        self.token_ids = last if self.is_prefill else []
        self.last_token = last[-1] if self.is_prefill else last
        self.status = SequenceStatus.RUNNING
        self.sampling_params = SamplingParams()
        self.num_prefix_hit_tokens = None
        self.block_hashes = []
        self.block_bytes = []
        self._cache_salt = None  # not carried (see __getstate__): workers never hash
