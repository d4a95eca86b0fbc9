"""The engine machine: random add / step / abort interleavings, checked after every step.

Two engines run in lockstep on the same requests: one over the engine's allocator, one
over the spec allocator ("spec in the loop"); they must schedule identically and hold
identical block tables. Each uses the fake model of tests/fake_model.py, which really
writes and reads its paged cache, so every finished request must equal what the model
produces for it alone (chunking, prefix hits and preemption never change results).

The fault rule makes a drawn step raise (an exception or KeyboardInterrupt) at a drawn
point: in the model (before any cache write, after some of them, after all of them), in
the allocator while the step's results are applied, or while an output is detokenised.
Both engines must raise the same, stay consistent (the invariants below) and go on to
produce the same outputs as if the fault had not happened.
``make_machine(scheduler_cls, engine_cls)`` lets the same machine hunt scheduler and
engine mutants. Every loop is bounded: an engine that stops making progress fails a
check instead of hanging.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged_engine.config import EngineConfig
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.llm_engine import LLMEngine, RequestOutput
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from spec.block_manager import BlockManager as SpecBlockManager
from tests.fake_model import FakeModelRunner, FakeTokenizer, Fault, reference_generate

VOCAB = 5  # small, so generated continuations also repeat and share blocks
DRAIN_STEPS = 5_000
"""Teardown's bound on steps to drain: past it the engine has stopped making progress, and
a check fails instead of the test hanging."""


MAX_MODEL_CALLS = 20_000
"""``CheckedRunner``'s default bound on steps per engine (the step guard); tests that know
their step count pass a tighter one."""


class CheckedRunner(FakeModelRunner):
    """The fake model, checking the scheduler's batch before it computes anything: within
    ``max_num_seqs`` and the token budget, every sequence computing at least one token,
    none past its end, and every token to compute inside its block table (R7), whose ids
    lie in the pool. It also bounds the steps (a step guard): an engine that stops making
    progress fails here, with a message, instead of hanging the test."""

    def __init__(self, config: EngineConfig, vocab_size: int, max_calls: int) -> None:
        assert config.num_kvcache_blocks is not None
        super().__init__(config.num_kvcache_blocks, config.kvcache_block_size, vocab_size)
        self.config = config
        self.max_calls = max_calls

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        cfg = self.config
        assert self.calls < self.max_calls, (
            f"step guard: the model ran {self.calls} steps and the engine has not drained"
        )
        assert 1 <= len(seqs) <= cfg.max_num_seqs, f"a batch of {len(seqs)}"
        assert sum(s.num_scheduled_tokens for s in seqs) <= cfg.max_num_batched_tokens
        for seq in seqs:
            end = seq.num_cached_tokens + seq.num_scheduled_tokens
            assert seq.num_scheduled_tokens >= 1 and end <= seq.num_tokens, f"scheduled {seq}"
            assert len(seq.block_table) >= num_blocks(end, self.block_size), f"no slot: {seq}"
            assert all(0 <= b < (cfg.num_kvcache_blocks or 0) for b in seq.block_table)
        return super().run(seqs, is_prefill)


def build_engine(
    config: EngineConfig,
    spec: bool,
    scheduler_cls: type[Scheduler] = Scheduler,
    eos: int = 0,
    tokenizer: FakeTokenizer | None = None,
    engine_cls: type[LLMEngine] = LLMEngine,
    max_steps: int = MAX_MODEL_CALLS,
) -> LLMEngine:
    """An engine on the fake model (checked, with a step guard: ``CheckedRunner``), over
    the engine's allocator or the spec's (``spec``)."""
    pool = config.num_kvcache_blocks
    assert pool is not None
    bm: Any = (
        SpecBlockManager(pool, config.kvcache_block_size)
        if spec
        else BlockManager(
            pool, config.kvcache_block_size, enable_prefix_caching=config.enable_prefix_caching
        )
    )
    runner = CheckedRunner(config, VOCAB, max_steps)
    return engine_cls(
        runner,
        config,
        vocab_size=VOCAB,
        eos_token_id=eos,
        tokenizer=tokenizer,
        block_manager=bm,
        scheduler_cls=scheduler_cls,
    )


_request_ids = itertools.count()


def add(engine: LLMEngine, prompt: Any, params: Any = None) -> str:
    """``engine.add_request`` under a fresh request id, which it returns."""
    rid = f"r{next(_request_ids)}"
    engine.add_request(rid, prompt, params)
    return rid


def _without_times(out: RequestOutput) -> object:
    """An output without its wall-clock times (the two engines run at different times)."""
    return (out.request_id, out.outputs, out.finished, out.num_cached_tokens)


def faulty_hash_blocks(bm: Any, fault: Fault) -> Any:
    """``bm.hash_blocks`` with an opportunity for ``fault`` before each call."""
    real = type(bm).hash_blocks

    def hash_blocks(seq: Any) -> None:
        fault.tick("hash_blocks")
        real(bm, seq)

    return hash_blocks


def table_blocks_expected(seq: Any) -> int:
    """Blocks a running sequence holds between steps: its whole prompt while prefilling
    (allocate takes them all), every computed token's block while decoding (R7 adds the
    newest token's block only when that token is scheduled)."""
    return num_blocks(seq.num_tokens - (0 if seq.is_prefill else 1), seq.block_size)


def make_machine(
    scheduler_cls: type[Scheduler] = Scheduler, engine_cls: type[LLMEngine] = LLMEngine
) -> type[RuleBasedStateMachine]:
    class EngineMachine(RuleBasedStateMachine):
        @initialize(
            block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
            max_model_len=st.integers(4, 48),
            extra_blocks=st.one_of(st.just(0), st.integers(0, 24)),
            max_num_seqs=st.integers(1, 6),
            max_num_batched_tokens=st.one_of(st.integers(1, 8), st.integers(1, 96)),
            eos=st.integers(0, VOCAB - 1),
            mixed_steps=st.booleans(),
        )
        def setup(
            self,
            block_size: int,
            max_model_len: int,
            extra_blocks: int,
            max_num_seqs: int,
            max_num_batched_tokens: int,
            eos: int,
            mixed_steps: bool,
        ) -> None:
            # Down to the smallest legal pool: one max_model_len sequence.
            pool = num_blocks(max_model_len, block_size) + extra_blocks
            self.config = EngineConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                kvcache_block_size=block_size,
                num_kvcache_blocks=pool,
                mixed_steps=mixed_steps,
            )
            self.engines = [
                build_engine(self.config, spec, scheduler_cls, eos, FakeTokenizer(), engine_cls)
                for spec in (False, True)
            ]
            self.eos = eos
            self.prompts: list[list[int]] = []
            self.live: list[str] = []
            """Request ids, the same in both engines."""
            self.expected: dict[str, tuple[list[int], str]] = {}
            self.streamed: dict[str, int] = {}
            """Tokens each live request has reported so far (outputs are cumulative)."""
            self.next_id = 0
            self.seq_names: list[dict[int, str]] = [{}, {}]
            """Each engine's sequence ids, named by request id."""

        @property
        def engine(self) -> LLMEngine:
            return self.engines[0]

        @precondition(lambda self: len(self.live) < 10)
        @rule(data=st.data())
        def add_request(self, data: st.DataObject) -> None:
            limit = self.config.max_model_len - 1
            prompt: list[int] = []
            if self.prompts and data.draw(st.integers(0, 3), label="share"):
                base = data.draw(st.sampled_from(self.prompts), label="base")
                prompt = base[: data.draw(st.integers(0, len(base)), label="cut")]
            prompt += data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=limit), label="tail")
            prompt = prompt[:limit] or [1]
            self.prompts.append(prompt)
            room = self.config.max_model_len - len(prompt)
            params = SamplingParams(
                temperature=0,
                # None: up to max_model_len (S9), where its stop is the only one.
                max_tokens=data.draw(st.one_of(st.none(), st.integers(1, room))),
                ignore_eos=data.draw(st.booleans(), label="ignore_eos"),
                stop_token_ids=tuple(data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=1))),
            )
            rid = str(self.next_id)
            self.next_id += 1
            for e, names in zip(self.engines, self.seq_names, strict=True):
                e.add_request(rid, prompt, params)
                names[e._requests[rid].completions[0].seq.seq_id] = rid
            self.live.append(rid)
            self.streamed[rid] = 0
            self.expected[rid] = reference_generate(
                prompt,
                replace(params, max_tokens=params.max_tokens or room),  # the oracle needs one
                vocab_size=VOCAB,
                eos_token_id=self.eos,
                max_model_len=self.config.max_model_len,
            )

        @precondition(lambda self: self.engine.has_unfinished_requests())
        @rule(steps=st.integers(1, 4))
        def step(self, steps: int) -> None:
            for _ in range(steps):
                if not self.engine.has_unfinished_requests():
                    return
                self._step_both()

        @precondition(lambda self: self.engine.has_unfinished_requests())
        @rule(
            where=st.sampled_from(["model", "hash_blocks", "decode"]),
            at=st.one_of(st.integers(0, 2), st.integers(0, 12)),
            error=st.sampled_from([RuntimeError, KeyboardInterrupt]),
        )
        def faulty_step(self, where: str, at: int, error: type[BaseException]) -> None:
            faults = []
            for e in self.engines:
                if where == "model":
                    fault = e.model_runner.fault  # type: ignore[attr-defined]
                elif where == "decode":
                    fault = e.tokenizer.fault  # type: ignore[union-attr]
                else:
                    fault = Fault()
                    e.block_manager.hash_blocks = faulty_hash_blocks(e.block_manager, fault)  # type: ignore[method-assign]
                fault.arm(at, error)
                faults.append(fault)
            try:
                self._step_both(faults)
                event(f"fault in {where}: {'raised' if faults[0].fired else 'not reached'}")
            finally:
                for e, fault in zip(self.engines, faults, strict=True):
                    fault.disarm()
                    vars(e.block_manager).pop("hash_blocks", None)

        def _step_both(self, faults: list[Fault] | None = None) -> None:
            outs: list[list[RequestOutput]] = []
            raised: list[BaseException | None] = []
            runners = [e.model_runner for e in self.engines]
            calls = [r.calls for r in runners]  # type: ignore[attr-defined]
            for i, e in enumerate(self.engines):
                fired = faults[i].fired if faults else 0
                try:
                    outs.append(e.step())
                    raised.append(None)
                except (RuntimeError, KeyboardInterrupt) as exc:
                    if not faults or faults[i].fired == fired:
                        # Not the injected fault. A step that raises must still leave
                        # the engine consistent (atomic steps): check that first, so a
                        # broken state is reported as the check it breaks.
                        self.consistent()
                        raise
                    outs.append([])
                    raised.append(exc)
            assert [type(r) for r in raised] == [type(raised[0])] * 2, "only one engine failed"
            ran = [r.calls - c for r, c in zip(runners, calls, strict=True)]  # type: ignore[attr-defined]
            assert ran[0] == ran[1], "only one engine ran its model"
            if ran[0]:
                self._compare_batches([r.batches[-1] for r in runners])  # type: ignore[attr-defined]
            assert [_without_times(o) for o in outs[0]] == [_without_times(o) for o in outs[1]], (
                "the engines reported differently"
            )
            for out in outs[0]:
                self._check_output(out)

        def _request_of(self, engine: LLMEngine, seq_id: int) -> str:
            return next(
                rid for rid, r in engine._requests.items() if r.completions[0].seq.seq_id == seq_id
            )

        def _compare_batches(self, batches: list[Any]) -> None:
            named = [
                [(names[sid], n) for sid, n in b[1]]
                for names, b in zip(self.seq_names, batches, strict=True)
            ]
            assert batches[0][0] == batches[1][0]
            assert named[0] == named[1], "schedules differ"
            batch = batches[0][1]
            assert len(batch) <= self.config.max_num_seqs
            assert sum(n for _, n in batch) <= self.config.max_num_batched_tokens
            assert all(n >= 1 for _, n in batch)

        def _check_output(self, out: RequestOutput) -> None:
            rid = out.request_id
            assert rid in self.live, f"an output for {rid}, which is not live"
            (completion,) = out.outputs
            tokens, reason = self.expected[rid]
            got = completion.token_ids
            # Streaming: cumulative, never shrinking, always a prefix of the oracle's.
            assert got == tokens[: len(got)], (out, tokens)
            assert len(got) >= self.streamed[rid], "an output went backwards"
            self.streamed[rid] = len(got)
            # The token that stopped it (EOS or a stop token) has no text (vLLM's rule).
            shown = got[:-1] if completion.finish_reason == "stop" else got
            assert completion.text == "".join(f"<{t}>" for t in shown), (completion, out)
            assert out.finished == (completion.finish_reason is not None)
            if out.finished:  # exactly once: the request then leaves the engine
                assert got == tokens and completion.finish_reason == reason, (out, tokens)
                self.live.remove(rid)
                del self.expected[rid], self.streamed[rid]

        @precondition(lambda self: bool(self.live))
        @rule(data=st.data())
        def abort_request(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(self.live), label="abort")
            assert self.engines[0].abort_request(rid) and self.engines[1].abort_request(rid)
            assert not self.engines[0].abort_request(rid), "aborted twice"
            self.live.remove(rid)
            del self.expected[rid], self.streamed[rid]

        @invariant()
        def consistent(self) -> None:
            for engine in self.engines:
                sched = engine.scheduler
                waiting, running = list(sched.waiting), list(sched.running)
                assert sorted(engine._requests) == sorted(self.live)
                queued = [s.seq_id for s in waiting + running + sched.finished]
                # Every unfinished request sits in exactly one queue (so abort finds it),
                # or has finished and waits to be reported.
                awaiting_output = [
                    c.seq.seq_id
                    for r in engine._requests.values()
                    for c in r.completions
                    if c.finish_reason is not None
                ]
                # Text is made from committed tokens only (after postprocess; a failed
                # step's tokens are dropped before detokenize_pending sees them), so no
                # detokenizer is ever ahead of its sequence, faults included.
                for r in engine._requests.values():
                    for c in r.completions:
                        if c.detokenizer is not None:
                            assert c.detokenizer.num_tokens <= c.seq.num_completion_tokens, (
                                f"the detokenizer of {c.seq} is ahead of its tokens"
                            )
                live = [r.completions[0].seq.seq_id for r in engine._requests.values()]
                assert sorted(queued + awaiting_output) == sorted(live), (
                    queued,
                    awaiting_output,
                    live,
                )
                assert all(not s.block_table for s in waiting + sched.finished)
                assert not sched._in_flight, "a step left sequences in flight"
                for s in running:
                    assert len(s.block_table) == table_blocks_expected(s), f"table of {s}"
                    if not s.is_prefill:
                        assert s.num_cached_tokens == s.num_tokens - 1, f"counters of {s}"
                # R12 with the live tables: no block is held by a sequence in no queue.
                engine.block_manager.check_invariants(running)  # type: ignore[attr-defined]
            tables = [[s.block_table for s in e.scheduler.running] for e in self.engines]
            assert tables[0] == tables[1], "spec and engine allocators diverged"
            bm = self.engines[0].block_manager
            bs = self.config.kvcache_block_size
            for seq in self.engines[0].scheduler.running:  # R8: computed full blocks registered
                for b in seq.block_table[: seq.num_cached_tokens // bs]:
                    assert bm.block_hashes[b] is not None, f"block {b} of {seq} not registered"  # type: ignore[attr-defined]

        def teardown(self) -> None:
            # Hypothesis runs teardown in a ``finally``: after a failed rule, draining
            # would replace that rule's error (a crash, say) with one of its own.
            if not hasattr(self, "engines") or sys.exc_info()[1] is not None:
                return
            for _ in range(DRAIN_STEPS):
                if not self.engine.has_unfinished_requests():
                    break
                self._step_both()
                self.consistent()
            else:
                raise AssertionError(f"the engines did not drain in {DRAIN_STEPS} steps")
            for engine in self.engines:
                state = engine.block_manager.snapshot()  # type: ignore[attr-defined]
                assert sorted(state.free_queue) == list(range(self.config.num_kvcache_blocks or 0))
                assert set(state.ref_counts) == {0}
            assert not self.expected, "some accepted requests never finished"

    return EngineMachine
