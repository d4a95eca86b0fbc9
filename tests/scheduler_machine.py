"""The scheduler lockstep machine: the spec's policy against the engine's, step by step.

``spec.scheduler.Scheduler`` on the spec allocator and spec sequences, and the engine's
``Scheduler`` on the engine's allocator and ``Sequence``s, get the same requests and the
same model results (``model_result``: a hash of the sequence's context and completion
index, a failed sample at a drawn position; the engine's ``FailedSample`` reaches the spec
as its own ``SpecFailedSample``, through ``spec_result``). After every step the machine
compares:

* what ``schedule`` returned (or raised): the batch (sequences by name, tokens each),
  prefill or decode;
* what ``postprocess`` finished, or what ``recover`` preempted after a fault;
* the queues in order (so every preemption: who, and where it went), each sequence's
  tokens, counters, table, status and first-admission prefix hits, the errors, the
  statistics field by field (the spec's record is its own: a field either side lacks is
  named, as is each value that differs), and the allocators' snapshots (R11, field by
  field too) and invariants (R12);
* each delivered sequence's finish reason and stop reason, and its tokens against the
  model run alone (``reference``);
* inside each step, at every call the engine's scheduler makes to its allocator
  (``CheckedBlockManager``): R12 with the live tables, and that decode growth is asked
  only for decoding sequences (S6). A scheduler that breaks either is caught in the
  step that does it, by that check, before the allocator's own refusal or a stall can
  surface as a crash.

Rules add requests (shared prefixes, cache salts, ``n`` completions, ``max_tokens=None``,
stop tokens, EOS sets), step, fault a step (at a drawn allocator call or the model, with
an exception or KeyboardInterrupt), finish a sequence by a text stop (``finish_now``) and
abort; each run draws prefix caching on or off and the block hash (xxh64, sha256, or a
colliding one, so R10's token check decides the deferral too). Every loop is bounded: a
scheduler that stops making progress fails a check instead of hanging.
``make_machine(scheduler_cls)`` hunts the mutants of tests/scheduler_mutants.py.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import xxhash
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from spec.block_manager import BlockManager as SpecBlockManager
from spec.hashing import sha256_block_hash, xxh64_block_hash
from spec.scheduler import Scheduler as SpecScheduler
from spec.scheduler import SpecRequest
from tests.fake_model import Fault
from tests.lockstep import CheckedBlockManager, ContractBreach, assert_same_record, spec_result

VOCAB = 3
"""Prompt tokens: so few that blocks repeat, and prefix hits and deferrals are common."""
MODEL_VOCAB = 8
"""The model's tokens: more, so that EOS and stop tokens do not end every sequence at once."""
SALTS = (None, None, "a")
ALLOCATOR_CALLS = ("can_allocate", "allocate", "can_append", "may_append", "hash_blocks")
DRAIN_STEPS = 3_000
"""Teardown's bound on steps to drain: past it the scheduler has stopped making progress,
and a check fails instead of the test hanging."""
SEQ_STATE = attrgetter(
    "token_ids", "num_tokens", "last_token", "num_cached_tokens", "num_scheduled_tokens",
    "block_table", "is_prefill", "num_prefix_hit_tokens",
)  # fmt: skip
"""What the machine compares of each sequence (both sides have these attributes)."""


def colliding_hash(token_ids: Any, prefix: int | None) -> int:
    """Eight hash values: R10's token check decides every lookup, and the deferral."""
    return xxh64_block_hash(tuple(token_ids), prefix) % 8


SPEC_HASHES = {"xxh64": xxh64_block_hash, "sha256": sha256_block_hash, "colliding": colliding_hash}


class SpecPlainBlockManager(SpecBlockManager):
    """The spec allocator as the engine's ``enable_prefix_caching=False`` leaves it: no
    lookup (R5 finds nothing) and no registration (R8 records nothing)."""

    def _lookup(self, seq: Any) -> list[int]:
        if seq.block_size != self.block_size:
            raise ValueError("block size mismatch")
        return []

    def hash_blocks(self, seq: Any) -> None:
        return None


def model_result(index: int, tokens: list[int], fail_at: int | None, num_prompt: int) -> Any:
    """The model: completion ``index``'s next token after ``tokens``, or a failed sample
    when it would be its ``fail_at``-th token. Recomputing a context gives the same."""
    if fail_at is not None and len(tokens) - num_prompt == fail_at:
        return FailedSample(f"no finite logits at {fail_at}")
    return xxhash.xxh64_intdigest(repr((index, tokens)).encode()) % MODEL_VOCAB


@dataclass(slots=True, eq=False)
class Twin:
    """One sequence as each side holds it."""

    name: str
    index: int
    spec: SpecRequest
    engine: Sequence
    fail_at: int | None


def reference(twin: Twin, eos: tuple[int, ...], max_model_len: int) -> tuple[list[int], str]:
    """What the sequence generates with the model run alone (no scheduler)."""
    s = twin.spec
    tokens = list(s.token_ids[: s.num_prompt_tokens])
    while True:
        r = model_result(twin.index, tokens, twin.fail_at, s.num_prompt_tokens)
        if isinstance(r, FailedSample):
            return tokens, "error"
        tokens.append(r)
        if (not s.ignore_eos and r in eos) or r in s.stop_token_ids:
            return tokens, "stop"
        out = len(tokens) - s.num_prompt_tokens
        if (s.max_tokens is not None and out >= s.max_tokens) or len(tokens) >= max_model_len:
            return tokens, "length"


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return ("returned", fn())
    except (Exception, KeyboardInterrupt) as exc:  # compared, so an engine crash is a difference
        return ("raised", exc)


def make_machine(scheduler_cls: type[Scheduler] = Scheduler) -> type[RuleBasedStateMachine]:
    class SchedulerMachine(RuleBasedStateMachine):
        @initialize(
            block_size=st.sampled_from([1, 2, 3, 4, 8]),
            max_model_len=st.integers(4, 40),
            extra_blocks=st.one_of(st.just(0), st.integers(0, 16)),
            max_num_seqs=st.integers(1, 6),
            max_num_batched_tokens=st.one_of(st.integers(1, 8), st.integers(1, 64)),
            eos=st.lists(st.integers(0, MODEL_VOCAB - 1), max_size=2, unique=True),
            prefix_caching=st.booleans(),
            hash_name=st.sampled_from(["xxh64", "sha256", "colliding"]),
            chunk_results=st.sampled_from([None, 0]),
            mixed_steps=st.booleans(),
        )
        def setup(
            self,
            block_size: int,
            max_model_len: int,
            extra_blocks: int,
            max_num_seqs: int,
            max_num_batched_tokens: int,
            eos: list[int],
            prefix_caching: bool,
            hash_name: str,
            chunk_results: int | None,
            mixed_steps: bool,
        ) -> None:
            pool = num_blocks(max_model_len, block_size) + extra_blocks  # down to the least
            self.pool, self.block_size, self.max_model_len = pool, block_size, max_model_len
            self.eos = tuple(eos)
            self.chunk_results = chunk_results
            """What the model returns for a chunk that samples nothing (None, or a token)."""
            spec_cls = SpecBlockManager if prefix_caching else SpecPlainBlockManager
            self.spec_bm = spec_cls(pool, block_size, hash_fn=SPEC_HASHES[hash_name])
            self.engine_bm = CheckedBlockManager(
                pool,
                block_size,
                enable_prefix_caching=prefix_caching,
                hash_fn=colliding_hash if hash_name == "colliding" else None,
                hash_algorithm="sha256" if hash_name == "sha256" else "xxh64",
                live=lambda: [t.engine for t in self.twins],
            )
            limits = dict(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                prefix_aware=prefix_caching,
                mixed_steps=mixed_steps,
            )
            self.spec = SpecScheduler(self.spec_bm, eos_token_ids=self.eos, **limits)  # type: ignore[arg-type]
            self.engine = scheduler_cls(
                self.engine_bm, num_blocks=pool, eos_token_ids=self.eos, **limits
            )
            self.twins: list[Twin] = []
            """Live sequences: queued, or finished and not delivered yet."""
            self.of_spec: dict[SpecRequest, Twin] = {}
            self.of_engine: dict[Sequence, Twin] = {}
            self.prompts: list[list[int]] = []
            self.names = itertools.count()
            self.engine_names: dict[int, str] = {}

        # ---- rules -------------------------------------------------------------------

        @precondition(lambda self: len(self.twins) < 10)
        @rule(
            base=st.integers(0, 3),
            cut=st.one_of(st.none(), st.integers(0, 40)),
            tail=st.one_of(*(st.lists(st.integers(0, VOCAB - 1), max_size=n) for n in (3, 40))),
            max_tokens=st.one_of(st.none(), st.integers(1, 40)),
            ignore_eos=st.booleans(),
            stop_token_ids=st.lists(st.integers(0, MODEL_VOCAB - 1), max_size=1),
            salt=st.sampled_from(SALTS),
            fail_at=st.lists(st.integers(0, 15), min_size=1, max_size=2),
        )
        def add_request(
            self,
            base: int,
            cut: int | None,
            tail: list[int],
            max_tokens: int | None,
            ignore_eos: bool,
            stop_token_ids: list[int],
            salt: str | None,
            fail_at: list[int],
        ) -> None:
            """A request of ``len(fail_at)`` completions: a prefix of an earlier prompt
            (three times in four: the base, and the cut, are folded into range) and a tail,
            cut to fit; ``max_tokens`` cut to fit too."""
            limit = self.max_model_len - 1
            prompt: list[int] = []
            if self.prompts and base:  # an earlier prompt, whole (cut None) or cut
                earlier = self.prompts[(base * 7919 + (cut or 0)) % len(self.prompts)]
                prompt = earlier if cut is None else earlier[: cut % (len(earlier) + 1)]
            prompt = (prompt + tail)[:limit] or [1]
            self.prompts.append(prompt)
            room = self.max_model_len - len(prompt)
            params = SamplingParams(
                temperature=0,
                max_tokens=None if max_tokens is None else min(max_tokens, room),
                ignore_eos=ignore_eos,
                stop_token_ids=tuple(stop_token_ids),
            )
            request = next(self.names)
            for i, fail in enumerate(fail_at):
                name = f"r{request}.{i}"
                twin = Twin(
                    name,
                    i,
                    SpecRequest(
                        list(prompt),
                        self.block_size,
                        seq_id=name,
                        max_tokens=params.max_tokens,
                        ignore_eos=params.ignore_eos,
                        stop_token_ids=params.stop_token_ids,
                        cache_salt=salt,
                    ),
                    Sequence(prompt, params, block_size=self.block_size, cache_salt=salt),
                    fail if fail < 3 else None,  # 3 in 16 samples fail, at a drawn token
                )
                self.twins.append(twin)
                self.of_spec[twin.spec] = twin
                self.of_engine[twin.engine] = twin
                self.engine_names[twin.engine.seq_id] = name
                self.spec.add(twin.spec)
                self.engine.add(twin.engine)

        @precondition(lambda self: not self.spec.is_finished())
        @rule(steps=st.integers(1, 8), deliver=st.booleans())
        def step(self, steps: int, deliver: bool) -> None:
            for _ in range(steps):
                if self.spec.is_finished():
                    break
                self._step()
                if deliver:
                    self._deliver()

        @precondition(lambda self: not self.spec.is_finished())
        @rule(
            at=st.one_of(st.integers(0, 3), st.integers(0, 24)),
            error=st.sampled_from([RuntimeError, KeyboardInterrupt]),
        )
        def faulty_step(self, at: int, error: type[BaseException]) -> None:
            """A step that raises at its ``at``-th opportunity: an allocator call, or the
            model between ``schedule`` and ``postprocess``."""
            faults = [Fault(), Fault()]
            for bm, fault in zip((self.spec_bm, self.engine_bm), faults, strict=True):
                fault.arm(at, error)
                for name in ALLOCATOR_CALLS:
                    setattr(bm, name, _ticking(fault, getattr(bm, name), name))
            try:
                self._step(faults)
                event("fault raised" if faults[0].fired else "fault not reached")
            finally:
                for bm in (self.spec_bm, self.engine_bm):
                    for name in ALLOCATOR_CALLS:
                        vars(bm).pop(name)
            self._deliver()

        @precondition(lambda self: bool(self.twins))
        @rule(data=st.data(), text_stop=st.booleans())
        def end_early(self, data: st.DataObject, text_stop: bool) -> None:
            """A stop string matched after the last step (the text layer's ``finish_now``),
            or an abort (waiting, running, or finished and not delivered)."""
            decoding = [t for t in self._running() if not t.spec.is_prefill]
            if text_stop and decoding:
                twin = data.draw(st.sampled_from(decoding), label="text stop")
                self.spec.finish_now(twin.spec)
                self.engine.finish_now(twin.engine)
                tokens, _ = reference(twin, self.eos, self.max_model_len)
                assert twin.spec.token_ids == tokens[: len(twin.spec)], "tokens off the model's"
            else:
                twin = data.draw(st.sampled_from(self.twins), label="abort")
                got = (self.spec.abort(twin.spec), self.engine.abort(twin.engine))
                assert got == (True, True), f"abort of a live sequence returned {got}"
                again = (self.spec.abort(twin.spec), self.engine.abort(twin.engine))
                assert again == (False, False), f"a second abort returned {again}"
            self._check_gone(twin)
            self._forget(twin)

        # ---- one step on both sides --------------------------------------------------

        def _names(self, seqs: Any) -> list[str]:
            return [self._twin(s).name for s in seqs]

        def _twin(self, seq: Any) -> Twin:
            return self.of_spec[seq] if isinstance(seq, SpecRequest) else self.of_engine[seq]

        def _step(self, faults: list[Fault] | None = None) -> None:
            sides = (self.spec, self.engine)
            scheduled = [_outcome(s.schedule) for s in sides]
            self._compare_outcomes(scheduled, faults, "schedule")
            if scheduled[0][0] == "raised":
                self.agree()
                return
            batches = [
                (self._names(b), [s.num_scheduled_tokens for s in b], p)
                for b, p in (value for _, value in scheduled)
            ]
            assert batches[0] == batches[1], (
                f"batches differ: spec {batches[0]}, engine {batches[1]}"
            )
            self._check_batch(*batches[0])
            self._same_state()
            batch, _ = scheduled[0][1]
            results = [self._result(s) for s in batch]  # the engine's, in the engine's types
            fed = ([spec_result(r) for r in results], results)

            def finish(side: int) -> Any:
                if faults:
                    faults[side].tick("the model")
                sched = sides[side]
                done = sched.postprocess(scheduled[side][1][0], fed[side])
                return self._names(done)

            done = [_outcome(lambda i=i: finish(i)) for i in (0, 1)]
            self._compare_outcomes(done, faults, "postprocess")
            if done[0][0] == "raised":
                undone = [self._names(s.recover()) for s in sides]
                assert undone[0] == undone[1], f"recover preempted differently: {undone}"
            self.agree()

        def _compare_outcomes(
            self, outs: list[tuple[str, Any]], faults: list[Fault] | None, where: str
        ) -> None:
            """Both returned, or both raised the injected fault at the same call. The spec
            raises nothing else on valid traffic (if it does, that surfaces as is); an
            engine that raises anything else differs from the spec, unless what it raised
            is a check of the machine's own (``ContractBreach``): that is reported as is."""
            for kind, value in outs:
                if kind == "raised" and isinstance(value, ContractBreach):
                    raise value
            for side, (kind, value) in enumerate(outs):
                injected = faults is not None and faults[side].fired and "injected" in str(value)
                if kind == "raised" and not injected:
                    if side == 0:
                        raise value
                    raise AssertionError(
                        f"the engine's {where} raised {value!r}; the spec's: {outs[0]}"
                    ) from value
            if outs[0][0] == outs[1][0] == "raised":
                a, b = outs[0][1], outs[1][1]
                assert (type(a), str(a)) == (type(b), str(b)), f"{where}: {a!r} != {b!r}"
            else:
                assert outs[0][0] == outs[1][0], f"{where}: spec {outs[0]}, engine {outs[1]}"

        def _check_batch(self, names: list[str], counts: list[int], is_prefill: bool) -> None:
            """The limits every batch keeps (S3, S4, S6)."""
            assert names, "an empty batch"
            assert len(names) == len(set(names)) <= self.spec.max_num_seqs
            assert sum(counts) <= self.spec.max_num_batched_tokens
            assert all(n >= 1 for n in counts)
            assert is_prefill or set(counts) == {1}

        def _result(self, seq: SpecRequest) -> Any:
            twin = self.of_spec[seq]
            end = seq.num_cached_tokens + seq.num_scheduled_tokens
            if end < len(seq):  # a chunk that samples nothing
                return self.chunk_results
            return model_result(
                twin.index, list(seq.token_ids), twin.fail_at, seq.num_prompt_tokens
            )

        def _deliver(self) -> None:
            """What the engine's output processor does after a step: read each finished
            sequence's reasons, forget its error, drop it from ``finished``."""
            got = []
            for sched in (self.spec, self.engine):
                got.append(
                    [
                        (self._twin(s).name, sched.finish_reason(s), sched.stop_reason(s))
                        for s in sched.finished
                    ]
                )
                for s in sched.finished:
                    sched.errors.pop(s.seq_id, None)
                sched.finished.clear()
            assert got[0] == got[1], f"finished differently: spec {got[0]}, engine {got[1]}"
            for name, reason, _ in got[0]:
                twin = next(t for t in self.twins if t.name == name)
                tokens, expected = reference(twin, self.eos, self.max_model_len)
                assert (twin.spec.token_ids, reason) == (tokens, expected), (
                    f"{name} finished off the model: {twin.spec.token_ids} {reason}, "
                    f"model alone: {tokens} {expected}"
                )
                self._forget(twin)

        def _check_gone(self, twin: Twin) -> None:
            """Finished, holding no blocks, in no queue, its error forgotten (abort)."""
            for sched, seq in ((self.spec, twin.spec), (self.engine, twin.engine)):
                assert not seq.block_table, f"{twin.name} kept its blocks"
                assert all(seq not in q for q in (sched.waiting, sched.running, sched.finished))
            assert (twin.spec.status, twin.engine.status.name) == ("finished", "FINISHED")

        def _forget(self, twin: Twin) -> None:
            self.twins.remove(twin)

        def _running(self) -> list[Twin]:
            return [self.of_spec[s] for s in self.spec.running]

        # ---- the comparison ----------------------------------------------------------

        @invariant()
        def agree(self) -> None:
            """Between steps: the two sides hold the same state, nothing in flight."""
            assert not self.spec.in_flight and not self.engine._in_flight, "left in flight"
            self._same_state()
            for side in (self.spec.running, self.engine.running):  # S2m's premise, both sides
                kinds = [s.is_prefill for s in side]
                assert kinds == sorted(kinds), f"a decoding sequence after a chunk: {kinds}"

        def _same_state(self) -> None:
            spec, engine = self.spec, self.engine
            flying = [
                [(self._twin(s).name, n) for s, n in spec.in_flight],
                [(self._twin(s).name, n) for s, n in engine._in_flight.items()],
            ]
            assert flying[0] == flying[1], f"in flight: spec {flying[0]}, engine {flying[1]}"
            for q in ("waiting", "running", "finished"):
                a, b = self._names(getattr(spec, q)), self._names(getattr(engine, q))
                assert a == b, f"{q}: spec {a}, engine {b}"
            queued = self._names(spec.waiting + spec.running + spec.finished)
            assert sorted(queued) == sorted(t.name for t in self.twins), "lost or extra"
            for t in self.twins:
                got, want = SEQ_STATE(t.engine), SEQ_STATE(t.spec)
                assert got == want, f"{t.name}: engine {got}, spec {want}"
                assert t.engine.status.name.lower() == t.spec.status, f"{t.name}: status"
            errors = [
                dict(spec.errors),
                {self.engine_names[k]: v for k, v in engine.errors.items()},
            ]
            assert errors[0] == errors[1], f"errors: {errors}"
            assert_same_record(spec.stats, engine.stats, "statistics")
            assert_same_record(self.spec_bm.snapshot(), self.engine_bm.snapshot(), "snapshots")
            self.spec_bm.check_invariants(list(spec.running))
            self.engine_bm.check_invariants(engine.running)
            assert all(not s.block_table for s in spec.waiting + spec.finished)

        def teardown(self) -> None:
            # Hypothesis runs teardown in a ``finally``: after a failed rule, draining
            # would replace that rule's error (a crash, say) with one of its own.
            if not hasattr(self, "spec") or sys.exc_info()[1] is not None:
                return
            for _ in range(DRAIN_STEPS):
                if self.spec.is_finished() and self.engine.is_finished():
                    break
                self._step()
                self._deliver()
            else:
                raise AssertionError(
                    f"not drained in {DRAIN_STEPS} steps: {len(self.spec.waiting)} waiting, "
                    f"{len(self.spec.running)} running"
                )
            self._deliver()
            assert self.spec_bm.num_free_blocks == self.engine_bm.num_free_blocks == self.pool

    return SchedulerMachine


def _ticking(fault: Fault, call: Any, name: str) -> Any:
    def ticking(*args: Any) -> Any:
        fault.tick(name)
        return call(*args)

    return ticking
