"""Spec and engine allocators driven by the same operations, compared after every one.

Both the Hypothesis machine (tests/test_allocator_machine.py) and the small-scope
exhaustive check (tests/test_small_scope.py) drive allocators through this class, so the
two layers of verification share one definition of "the same behaviour" (R11):

* every call returns the same value, or both raise the same exception type;
* a call that raises leaves both allocators and the sequence exactly as they were;
* every live sequence has the same block table and ``num_cached_tokens`` on both sides;
* snapshots are equal field by field (``assert_same_record``: the spec's record is its
  own, so the field names are compared too), and R12's invariants hold on both with the
  live sequences.

``CheckedBlockManager`` is the engine's allocator checking, at every call a scheduler
makes, what the scheduler must keep between calls (the scheduler machine uses it).

The engine's ``hash_algorithm`` is matched on the spec side by the same hash written as
a plain ``hash_fn`` (``SPEC_HASHES``); sequences may carry a cache salt (R4s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_engine.engine.block_manager import BlockManager, HashFn
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.sequence import Sequence
from spec.block_manager import BlockManager as SpecBlockManager
from spec.hashing import sha256_block_hash, xxh64_block_hash
from spec.records import SpecFailedSample
from spec.sequence import SpecSequence

EngineFactory = Callable[..., BlockManager]
SPEC_HASHES = {"xxh64": xxh64_block_hash, "sha256": sha256_block_hash}


@dataclass(slots=True)
class Pair:
    """One request as each side sees it."""

    spec: SpecSequence
    engine: Sequence

    @property
    def allocated(self) -> bool:
        return bool(self.spec.block_table)

    @property
    def prefilling(self) -> bool:
        """Allocated with prompt (or recompute) tokens still to compute."""
        return self.allocated and self.spec.num_cached_tokens < len(self.spec)

    @property
    def decoding(self) -> bool:
        """Allocated, all but the newest (sampled, not yet computed) token cached."""
        return self.allocated and self.spec.num_cached_tokens == len(self.spec) - 1 > 0


# ---- the spec's records against the engine's ----------------------------------------------


def record_fields(record: Any) -> dict[str, Any]:
    """A dataclass record's fields by name, values as they are (no copies)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def assert_same_record(spec: Any, engine: Any, what: str) -> None:
    """The spec's record (snapshot, statistics) and the engine's hold the same fields, by
    name, with equal values. The spec's records are its own (spec/records.py), so a field
    one side has and the other lacks is named, and so is every field whose values differ."""
    ours, theirs = record_fields(spec), record_fields(engine)
    only_engine = [n for n in theirs if n not in ours]
    only_spec = [n for n in ours if n not in theirs]
    assert not only_engine and not only_spec, (
        f"{what}: fields of the engine's {type(engine).__name__} missing from the spec's "
        f"{type(spec).__name__}: {only_engine}; of the spec's missing from the engine's: "
        f"{only_spec}"
    )
    differ = [f"{n}: spec {v!r}, engine {theirs[n]!r}" for n, v in ours.items() if theirs[n] != v]
    assert not differ, f"{what} differ: " + "; ".join(differ)


def spec_result(result: Any) -> Any:
    """A model runner's result for one sequence, as the spec scheduler takes it: the
    engine's ``FailedSample`` becomes the spec's ``SpecFailedSample`` (same reason); a
    token or None passes as it is. Anything else is the caller's mistake: TypeError."""
    if isinstance(result, FailedSample):
        return SpecFailedSample(result.reason)
    if result is None or (isinstance(result, int) and not isinstance(result, bool)):
        return result
    raise TypeError(f"spec_result: {result!r} is not a token, None or a FailedSample")


# ---- the engine's allocator, checked at every call a scheduler makes -----------------------


class ContractBreach(AssertionError):
    """A check of ``CheckedBlockManager`` failed inside the caller's call: a catch by the
    machine's own check (the scheduler broke the allocator's contract), not a crash."""


class CheckedBlockManager(BlockManager):
    """The engine's allocator, checking before each call the scheduler makes what the
    scheduler must keep between calls: R12 with every live sequence's table (so a table
    changed behind the allocator's back shows at the next call, inside the step that
    did it) and, for decode growth (R7), that the sequence is decoding: its context
    computed but for its newest token (S6). ``live`` returns the live sequences."""

    def __init__(self, *args: Any, live: Callable[[], list[Sequence]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live = live

    def _check(self, call: str, seq: Sequence, growth: bool = False) -> None:
        try:
            self.check_invariants(self.live())
        except AssertionError as broken:
            raise ContractBreach(
                f"before {call}({seq}): R12 with the live tables: {broken}"
            ) from broken
        if growth and seq.num_cached_tokens != seq.num_tokens - 1:
            raise ContractBreach(
                f"{call}({seq}): decode growth of a sequence that is not decoding "
                f"({seq.num_cached_tokens} of {seq.num_tokens} tokens computed)"
            )

    def can_allocate(self, seq: Sequence) -> int | None:
        self._check("can_allocate", seq)
        return super().can_allocate(seq)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        self._check("allocate", seq)
        super().allocate(seq, num_cached_blocks)

    def can_append(self, seq: Sequence) -> bool:
        self._check("can_append", seq, growth=True)
        return super().can_append(seq)

    def may_append(self, seq: Sequence) -> None:
        self._check("may_append", seq, growth=True)
        super().may_append(seq)

    def hash_blocks(self, seq: Sequence) -> None:
        self._check("hash_blocks", seq)
        super().hash_blocks(seq)

    def deallocate(self, seq: Sequence) -> None:
        self._check("deallocate", seq)
        super().deallocate(seq)


_SLOTS: dict[type, tuple[str, ...]] = {}


def _copy_containers(obj: Any) -> Any:
    """A copy of ``obj`` whose list/dict attributes are copied too (one level deep: the
    allocators' lists hold ints and tuples, so that is a full copy). Much faster than
    ``copy.deepcopy``, where the exhaustive search would otherwise spend its time."""
    new = object.__new__(type(obj))
    if hasattr(obj, "__dict__"):
        attrs = obj.__dict__.copy()
        for name, value in attrs.items():
            if isinstance(value, list | dict):
                attrs[name] = value.copy()
        new.__dict__.update(attrs)
        return new
    names = _SLOTS.get(type(obj))
    if names is None:
        names = _SLOTS[type(obj)] = tuple(
            n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())
        )
    for name in names:
        value = getattr(obj, name)
        object.__setattr__(new, name, value.copy() if isinstance(value, list) else value)
    return new


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """What a call did: its value, or the type of the misuse error it raised."""
    try:
        return ("returned", fn())
    except (ValueError, RuntimeError) as e:
        return ("raised", type(e))


def _seq_state(s: SpecSequence | Sequence) -> tuple[Any, ...]:
    return (list(s.token_ids), list(s.block_table), s.num_cached_tokens, s.num_scheduled_tokens)


class Lockstep:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        engine_factory: EngineFactory = BlockManager,
        hash_fn: HashFn | None = None,
        hash_algorithm: str = "xxh64",
    ) -> None:
        self.block_size = block_size
        spec_hash = hash_fn or SPEC_HASHES[hash_algorithm]
        self.spec = SpecBlockManager(num_blocks, block_size, hash_fn=spec_hash)
        self.engine = engine_factory(
            num_blocks, block_size, hash_fn=hash_fn, hash_algorithm=hash_algorithm
        )
        self.pairs: list[Pair] = []
        self.check()

    def clone(self) -> Lockstep:
        new = object.__new__(Lockstep)
        new.block_size = self.block_size
        new.spec = _copy_containers(self.spec)
        new.engine = _copy_containers(self.engine)
        new.pairs = [Pair(_copy_containers(p.spec), _copy_containers(p.engine)) for p in self.pairs]
        return new

    # ---- comparing ---------------------------------------------------------------------

    def both(self, pair: Pair | None, op: Callable[[Any, Any], Any]) -> Any:
        """Run ``op(allocator, seq)`` on each side; return the common value or None if both
        raised. A raising call must leave everything as it was."""
        sides = [
            (self.spec, pair.spec if pair else None),
            (self.engine, pair.engine if pair else None),
        ]
        before = [(bm.snapshot(), _seq_state(s) if s else None) for bm, s in sides]
        outs = [_outcome(lambda bm=bm, s=s: op(bm, s)) for bm, s in sides]
        assert outs[0] == outs[1], f"spec {outs[0]} != engine {outs[1]}"
        if outs[0][0] == "raised":
            after = [(bm.snapshot(), _seq_state(s) if s else None) for bm, s in sides]
            assert after == before, "a refused call changed the allocator or the sequence"
            return None
        return outs[0][1]

    def check(self) -> None:
        assert_same_record(self.spec.snapshot(), self.engine.snapshot(), "snapshots")
        assert self.spec.num_free_blocks == self.engine.num_free_blocks
        for p in self.pairs:
            assert p.spec.block_table == p.engine.block_table, (p.spec, p.engine)
            assert p.spec.num_cached_tokens == p.engine.num_cached_tokens
            assert list(p.spec.token_ids) == p.engine.token_ids
        self.spec.check_invariants([p.spec for p in self.pairs])
        self.engine.check_invariants([p.engine for p in self.pairs])

    # ---- operations (each mirrors a scheduler action) ------------------------------------

    def add(self, tokens: list[int], cache_salt: str | None = None) -> Pair:
        pair = Pair(
            SpecSequence(list(tokens), self.block_size, cache_salt=cache_salt),
            Sequence(tokens, block_size=self.block_size, cache_salt=cache_salt),
        )
        self.pairs.append(pair)
        return pair

    def admit(self, pair: Pair) -> int | None:
        """can_allocate, then allocate with its answer (the scheduler's admission)."""
        hits = self.both(pair, lambda bm, s: bm.can_allocate(s))
        if hits is not None:
            self.both(pair, lambda bm, s: bm.allocate(s, hits))
        return hits

    def compute(self, pair: Pair, num_tokens: int) -> None:
        """A step computed ``num_tokens`` tokens of the sequence: register, advance."""
        for s in (pair.spec, pair.engine):
            s.num_scheduled_tokens = num_tokens
        self.both(pair, lambda bm, s: bm.hash_blocks(s))
        for s in (pair.spec, pair.engine):
            s.num_cached_tokens += num_tokens

    def append_token(self, pair: Pair, token: int) -> None:
        pair.spec.token_ids.append(token)
        pair.engine.append_token(token)

    def prefill(self, pair: Pair, chunk: int, next_token: int) -> None:
        """One prefill chunk; a chunk that completes the prompt samples ``next_token``."""
        self.compute(pair, chunk)
        if pair.spec.num_cached_tokens == len(pair.spec):
            self.append_token(pair, next_token)

    def decode(self, pair: Pair, next_token: int) -> bool:
        """can_append, may_append, compute the newest token, sample the next one."""
        if not self.both(pair, lambda bm, s: bm.can_append(s)):
            return False
        self.both(pair, lambda bm, s: bm.may_append(s))
        self.compute(pair, 1)
        self.append_token(pair, next_token)
        return True

    def release(self, pair: Pair, finished: bool) -> None:
        """Finish (drop the request) or preempt (keep it waiting, tokens and all)."""
        self.both(pair, lambda bm, s: bm.deallocate(s))
        if finished:
            self.pairs.remove(pair)

    def reset_prefix_cache(self) -> bool:
        """R13 on both sides: the same answer and snapshot; True forgets every registration
        and keeps the free queue's order, False changes nothing."""
        before = self.spec.snapshot()
        reset = self.both(None, lambda bm, s: bm.reset_prefix_cache())
        after = self.spec.snapshot()
        assert_same_record(after, self.engine.snapshot(), "snapshots after the reset")
        if not reset:
            assert after == before, "a refused reset changed the allocator"
        else:
            assert after.free_queue == before.free_queue, "the reset reordered the free queue"
            assert after.hash_to_block == (), "the reset kept hash map entries"
            assert set(after.block_hashes) == {None} and set(after.block_tokens) == {()}
        return bool(reset)

    # ---- misuse: both must refuse the same way and change nothing ------------------------

    def allocate_wrong(self, pair: Pair, delta: int) -> None:
        hits = self.both(pair, lambda bm, s: bm.can_allocate(s)) or 0
        self.both(pair, lambda bm, s: bm.allocate(s, hits + delta))

    def force_may_append(self, pair: Pair) -> None:
        self.both(pair, lambda bm, s: bm.may_append(s))

    def force_deallocate(self, pair: Pair) -> None:
        self.both(pair, lambda bm, s: bm.deallocate(s))

    def hash_beyond(self, pair: Pair, extra: int) -> None:
        """hash_blocks with counters that run ``extra`` tokens past the sequence."""
        for s in (pair.spec, pair.engine):
            s.num_scheduled_tokens = len(pair.spec) - s.num_cached_tokens + extra
        self.both(pair, lambda bm, s: bm.hash_blocks(s))
        for s in (pair.spec, pair.engine):
            s.num_scheduled_tokens = 0
