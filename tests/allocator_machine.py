"""The lockstep state machine: spec and engine allocators under random scheduler traffic.

Prompts are built from runs over a 2-3 token alphabet and from prefixes of earlier prompts,
so identical blocks, prefix hits, revivals from the free queue, hash-map overwrites and
evictions happen constantly. Each new sequence draws a cache salt (R4s) from
``SALTS``, so salted and unsalted copies of one prompt meet, and each run draws the hash
algorithm. Prefix-cache resets (R13) come both refused and granted. ``make_machine``
parameterises the engine side, so the same machine runs the real allocator and every
mutant in tests/allocator_mutants.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_engine.engine.block_manager import BlockManager, HashFn
from tests.lockstep import EngineFactory, Lockstep, Pair

BLOCK_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 256)
SALTS = (None, "a", "b")
HASH_ALGORITHMS = ("xxh64", "sha256")


def make_machine(
    engine_factory: EngineFactory = BlockManager,
    hash_fn: HashFn | None = None,
    block_sizes: SequenceABC[int] = BLOCK_SIZES,
    max_pool: int = 64,
    misuse: bool = True,
    hash_algorithms: SequenceABC[str] = HASH_ALGORITHMS,
    salts: SequenceABC[str | None] = SALTS,
) -> type[RuleBasedStateMachine]:
    """A machine class for ``engine_factory``; ``misuse=False`` drops the refused-call rule
    (so a mutant can only be caught through ordinary scheduler traffic). An injected
    ``hash_fn`` replaces the hash algorithm, so it runs alone."""
    if hash_fn is not None:
        hash_algorithms = ("xxh64",)

    class AllocatorMachine(RuleBasedStateMachine):
        ls: Lockstep

        @initialize(
            block_size=st.sampled_from(block_sizes),
            pool=st.one_of(st.integers(1, 8), st.integers(1, max_pool)),
            alphabet=st.integers(2, 3),
            algorithm=st.sampled_from(hash_algorithms),
        )
        def setup(self, block_size: int, pool: int, alphabet: int, algorithm: str) -> None:
            self.ls = Lockstep(pool, block_size, engine_factory, hash_fn, algorithm)
            self.alphabet = alphabet
            self.pool = pool
            self.prompts: list[list[int]] = []

        def _pick(self, data: st.DataObject, pred: str) -> Pair:
            cands = [p for p in self.ls.pairs if getattr(p, pred)]
            return data.draw(st.sampled_from(cands), label=pred)

        def _has(self, pred: str) -> bool:
            return any(getattr(p, pred) for p in self.ls.pairs)

        def _token(self) -> st.SearchStrategy[int]:
            return st.integers(0, self.alphabet - 1)

        @precondition(lambda self: len(self.ls.pairs) < 8)
        @rule(data=st.data())
        def add_sequence(self, data: st.DataObject) -> None:
            bs = self.ls.block_size
            prompt: list[int] = []
            if self.prompts and data.draw(st.integers(0, 3), label="share") > 0:
                base = data.draw(st.sampled_from(self.prompts), label="base")
                cut = st.one_of(st.just(len(base)), st.integers(0, len(base)))
                prompt = base[: data.draw(cut, label="cut")]
            runs = data.draw(
                st.lists(st.tuples(self._token(), st.integers(1, bs + 1)), max_size=4),
                label="runs",
            )
            for token, length in runs:
                prompt.extend([token] * length)
            # A prompt longer than the pool can never be admitted: keep most of them shorter.
            prompt = prompt[: self.pool * bs - data.draw(st.integers(0, bs), label="spare")]
            if not prompt:
                prompt = [data.draw(self._token())]
            self.prompts.append(prompt)
            self.ls.add(prompt, data.draw(st.sampled_from(salts), label="salt"))

        @precondition(lambda self: any(not p.allocated for p in self.ls.pairs))
        @rule(data=st.data())
        def admit(self, data: st.DataObject) -> None:
            pair = data.draw(st.sampled_from([p for p in self.ls.pairs if not p.allocated]))
            self.ls.admit(pair)

        @precondition(lambda self: self._has("prefilling"))
        @rule(data=st.data())
        def prefill_chunk(self, data: st.DataObject) -> None:
            pair = self._pick(data, "prefilling")
            left = len(pair.spec) - pair.spec.num_cached_tokens
            chunk = data.draw(st.one_of(st.just(left), st.integers(1, left)), label="chunk")
            self.ls.prefill(pair, chunk, data.draw(self._token()))

        @precondition(lambda self: self._has("decoding"))
        @rule(data=st.data())
        def decode(self, data: st.DataObject) -> None:
            pair = self._pick(data, "decoding")
            self.ls.decode(pair, data.draw(self._token()))

        @precondition(lambda self: self._has("allocated"))
        @rule(data=st.data(), finished=st.booleans())
        def release(self, data: st.DataObject, finished: bool) -> None:
            self.ls.release(self._pick(data, "allocated"), finished)

        @precondition(lambda self: self._has("decoding"))
        @rule(data=st.data(), steps=st.integers(1, 8))
        def decode_batch(self, data: st.DataObject, steps: int) -> None:
            """Scheduler-style decode steps over every decoding sequence."""
            for _ in range(steps):
                for pair in [p for p in self.ls.pairs if p.decoding]:
                    self.ls.decode(pair, data.draw(self._token()))

        @precondition(lambda self: bool(self.ls.spec.hash_to_block))  # something to forget
        @rule(data=st.data(), drain=st.booleans(), look_up=st.booleans())
        def reset_prefix_cache(self, data: st.DataObject, drain: bool, look_up: bool) -> None:
            """R13. vLLM resets when idle, so half the time every sequence is preempted
            first; otherwise it is refused while any holds blocks. A waiting request may
            have been looked up just before and not admitted (the token budget ran out):
            the scheduler's next step admits it, and must not reuse that lookup."""
            if drain:
                for pair in [p for p in self.ls.pairs if p.allocated]:
                    self.ls.release(pair, finished=False)
            waiting = [p for p in self.ls.pairs if not p.allocated]
            pair = data.draw(st.sampled_from(waiting), label="looked up") if waiting else None
            if look_up and pair is not None:
                self.ls.both(pair, lambda bm, s: bm.can_allocate(s))
            self.ls.reset_prefix_cache()
            if look_up and pair is not None:
                self.ls.admit(pair)

        # Misuse: both sides must refuse alike and change nothing. One rule for all kinds,
        # so that misuse stays a minority of the steps.
        @precondition(lambda self: misuse and bool(self.ls.pairs))
        @rule(
            data=st.data(),
            kind=st.sampled_from(["allocate", "may_append", "deallocate", "hash_blocks"]),
            delta=st.sampled_from([-1, 1, 2]),
        )
        def misuse(self, data: st.DataObject, kind: str, delta: int) -> None:
            pair = data.draw(st.sampled_from(self.ls.pairs))
            if kind == "allocate":
                self.ls.allocate_wrong(pair, delta)
            elif kind == "may_append":
                self.ls.force_may_append(pair)
            elif kind == "deallocate" and not pair.allocated:
                self.ls.force_deallocate(pair)
            elif kind == "hash_blocks":
                self.ls.hash_beyond(pair, abs(delta))

        @invariant()
        def agree(self) -> None:
            self.ls.check()

    return AllocatorMachine
