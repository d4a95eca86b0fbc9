"""What the scheduler's parts share: the allocator they drive and the state they change.

``Scheduler`` (scheduler.py) is built from one base class per kind of step:
``PrefillAdmission`` (admission.py) and ``DecodeWithPreemption`` (preemption.py). Both
derive from ``SchedulerState``, which declares the state once: the allocator and the
limits, the queues (S1), the current step's in-flight records (docs/design.md, "Atomic
steps"), the errors and the counters (S12). Rule numbers refer to docs/design.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import Protocol

from paged_engine.engine.hashing import BlockHasher, salt_block
from paged_engine.engine.sequence import Sequence

BlockKey = tuple[int, object]
"""A full block as the prefix cache tells blocks apart: its chained hash and its tokens."""
Chain = tuple[
    Callable[[Sequence, int], Sequence_[int]], Callable[[Sequence, int], Sequence_[object]]
]
"""The chained hashes, and the tokens, of a sequence's first ``n`` (full) blocks."""


class Allocator(Protocol):
    """What the scheduler needs from a block manager (the spec's and the engine's)."""

    @property
    def num_free_blocks(self) -> int: ...

    def can_allocate(self, seq: Sequence) -> int | None: ...
    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None: ...
    def can_append(self, seq: Sequence) -> bool: ...
    def may_append(self, seq: Sequence) -> None: ...
    def hash_blocks(self, seq: Sequence) -> None: ...
    def deallocate(self, seq: Sequence) -> None: ...


def allocator_chain(block_manager: Allocator) -> Chain:
    """The allocator's own hash chain (R4, R4s) and block tokens, which key the deferral
    of prefix-aware admission (S5).

    The engine's allocator caches both on the sequence (``block_hashes``, ``block_bytes``):
    ``can_allocate`` computed them for every block but the last, and ``hash_blocks`` needs
    the rest after the step, so the deferral adds no hashing. Another allocator (the spec,
    in tests) exposes its block hash as ``hash_fn``; its chain is recomputed from block 0.
    """
    if isinstance(block_manager, BlockHasher):
        return block_manager.hash_chain, block_manager.packed_blocks
    hash_fn: Callable[[tuple[int, ...], int | None], int] | None = getattr(
        block_manager, "hash_fn", None
    )
    if hash_fn is None:
        raise TypeError(
            f"prefix-aware admission needs the allocator's hash chain: "
            f"{type(block_manager).__name__} has no hash_fn (pass prefix_aware=False)"
        )

    def hashes(seq: Sequence, n: int) -> list[int]:
        salt = seq.cache_salt
        h = None if salt is None else hash_fn(tuple(salt_block(salt)), None)
        chain = []
        for i in range(n):
            h = hash_fn(seq.block(i), h)
            chain.append(h)
        return chain

    return hashes, lambda seq, n: [seq.block(i) for i in range(n)]


@dataclass(slots=True)
class SchedulerStats:
    """Counters over the scheduler's lifetime (S12; the engine reports them per run)."""

    prefill_tokens: int = 0
    """Prompt (and recomputed) tokens computed by prefill steps."""
    decode_tokens: int = 0
    output_tokens: int = 0
    """Tokens sampled and appended (a prefill's first token and every decode token)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache at each request's first admission."""
    prompt_tokens: int = 0
    preemptions: int = 0
    peak_blocks_in_use: int = 0
    steps: int = 0
    failed_steps: int = 0
    """Steps that raised and were recovered (their sequences preempted)."""


class SchedulerState:
    """The state every part of the scheduler reads and changes, declared once."""

    def __init__(
        self,
        block_manager: Allocator,
        *,
        num_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        prefix_aware: bool = True,
        mixed_steps: bool = False,
    ) -> None:
        """``eos_token_ids``: every id that ends a request (unless it ignores EOS);
        ``prefix_aware``: defer a request whose next block an earlier request computes in
        the same step (S5, see admission.py); pass False without prefix caching;
        ``mixed_steps``: each step decodes, then prefills in what is left (S2m)."""
        self.block_manager = block_manager
        self.prefix_aware = prefix_aware
        self.mixed_steps = mixed_steps
        self._hash_chain = allocator_chain(block_manager) if prefix_aware else None
        """How the allocator keys blocks (S5); None without prefix-aware admission."""
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        """S1: sequences without blocks, in arrival order; preempted and recovered ones
        go back to the front."""
        self.running: deque[Sequence] = deque()
        """S1: every sequence that holds blocks, in admission order (a partly prefilled
        one included, so that it can be preempted like any other holder of blocks)."""
        self.finished: list[Sequence] = []
        """Finished sequences whose outputs the engine has not delivered yet."""
        self.errors: dict[int, str] = {}
        """Why each sequence finished with "error" (its sample failed), by seq_id."""
        self.stats = SchedulerStats()
        self._in_flight: dict[Sequence, int] = {}
        """The sequences the current step has touched and not committed, with their token
        counts before the step, in the order the step took them: what ``recover()``
        undoes (S11)."""
