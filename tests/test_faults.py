"""A failed step changes nothing that matters: faults in the model, the allocator and the
tokenizer, through ``step()`` and ``generate()``, on the fake model (every fault position of
a small run) and on the real tiny Qwen3. The state machine version is the fault rule of
tests/engine_machine.py; this file pins down the user-visible contract."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM
from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.outputs import FailedSample
from paged_engine.engine.scheduler import Scheduler
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, CheckedRunner, add, build_engine
from tests.fake_model import FakeModelRunner, FakeTokenizer, reference_generate

CONFIG = EngineConfig(
    max_num_batched_tokens=6,  # prompts are chunked
    max_num_seqs=3,
    max_model_len=24,
    kvcache_block_size=2,  # decode steps often start a block (may_append allocates)
    num_kvcache_blocks=14,  # tight: preemptions happen
)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [1, 2, 3, 4, 2], [3, 3, 3, 3, 3, 3, 3, 3, 1], [4, 1]]
PARAMS = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


def expected_tokens(prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    tokens, _ = reference_generate(
        prompt, params, vocab_size=VOCAB, eos_token_id=None, max_model_len=CONFIG.max_model_len
    )
    return tokens


def assert_idle_and_whole(engine: LLMEngine) -> None:
    """Nothing queued, every block free, R12 holds, nothing half done."""
    assert not engine.has_unfinished_requests()
    assert not engine._requests, "requests left in the engine's table"
    sched = engine.scheduler
    assert not sched.waiting and not sched.running and not sched.finished
    assert not sched._in_flight
    bm: Any = engine.block_manager
    assert bm.num_free_blocks == engine.num_blocks
    bm.check_invariants([])


def count_model_calls(engine_cls: type[LLMEngine] = LLMEngine) -> int:
    engine = build_engine(CONFIG, spec=False, engine_cls=engine_cls)
    engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    return engine.model_runner.calls  # type: ignore[attr-defined, no-any-return]


def check_generate_recovers(
    engine_cls: type[LLMEngine], error: type[BaseException], call: int, spec: bool = False
) -> None:
    """``generate`` raising at model call ``call`` (after some K/V writes of that step)
    leaves the engine idle with every block free, hands back the outputs that finished,
    and the next ``generate`` is exactly right."""
    engine = build_engine(CONFIG, spec=spec, engine_cls=engine_cls)
    runner: Any = engine.model_runner
    # Opportunities per call: one before each K/V write and one after the last; a fault
    # at the second one of call ``call`` fires after one write of that step (or, for a
    # step with no write... there is none: every step computes at least one token).
    runner.fault.arm(_opportunities_before_call(call) + 1, error)
    with pytest.raises(error, match="injected fault") as info:
        engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert runner.fault.fired == 1
    assert_idle_and_whole(engine)
    partial = info.value.partial_outputs  # type: ignore[attr-defined]
    for out in partial:  # finished before the fault: complete and correct
        assert list(out.outputs[0].token_ids) == expected_tokens(list(out.prompt_token_ids))
    outs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected_tokens(p) for p in PROMPTS]
    assert_idle_and_whole(engine)


_WRITES_PER_CALL: list[int] = []


def _opportunities_before_call(call: int) -> int:
    """Fault opportunities of the calls before ``call`` in a clean run (writes + 1 each)."""
    if not _WRITES_PER_CALL:
        engine = build_engine(CONFIG, spec=False)
        engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        runner: Any = engine.model_runner
        _WRITES_PER_CALL.extend(sum(n for _, n in batch) for _, batch in runner.batches)
    return sum(n + 1 for n in _WRITES_PER_CALL[:call])


NUM_CALLS = count_model_calls()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("call", range(NUM_CALLS))
def test_generate_recovers_from_a_fault_at_every_model_call(
    call: int, error: type[BaseException]
) -> None:
    check_generate_recovers(LLMEngine, error, call)


def test_generate_recovers_with_the_spec_allocator_in_the_loop() -> None:
    for call in range(0, NUM_CALLS, 3):
        check_generate_recovers(LLMEngine, RuntimeError, call, spec=True)


class GenerateKeepsRequestsOnError(LLMEngine):
    """Mutant: ``generate`` re-raises without aborting the requests it added."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        abort = self.abort_request
        self.abort_request = lambda request_id: False  # type: ignore[method-assign, assignment, return-value]
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.abort_request = abort  # type: ignore[method-assign]


def test_the_generate_check_catches_a_generate_that_does_not_abort() -> None:
    with pytest.raises(AssertionError):
        check_generate_recovers(GenerateKeepsRequestsOnError, RuntimeError, NUM_CALLS // 2)


def test_the_fault_positions_cover_decode_growth_and_prefill_chunks() -> None:
    """The positions above include what the issue reproduced: a decode step in which
    ``may_append`` gave a sequence a new block, and a chunked prefill step."""
    engine = build_engine(CONFIG, spec=False)
    grew, chunked = [], []
    runner: Any = engine.model_runner
    run = runner.run

    def spy(seqs: list[Any], is_prefill: bool) -> list[int]:
        bs = CONFIG.kvcache_block_size
        grew.append(not is_prefill and any((len(s) - 1) % bs == 0 for s in seqs))
        chunked.append(
            is_prefill and any(s.num_cached_tokens + s.num_scheduled_tokens < len(s) for s in seqs)
        )
        return run(seqs, is_prefill)  # type: ignore[no-any-return]

    runner.run = spy
    engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert any(grew) and any(chunked)
    assert engine.last_run_stats is not None and engine.last_run_stats.preemptions > 0


# ---- step() -------------------------------------------------------------------------------


def test_step_on_an_idle_engine_returns_nothing_and_changes_no_counter() -> None:
    engine = build_engine(CONFIG, spec=False)
    before = (engine.scheduler.stats, engine.block_manager.snapshot())  # type: ignore[attr-defined]
    stats_before = repr(before[0])
    assert engine.step() == []
    assert repr(engine.scheduler.stats) == stats_before
    assert engine.block_manager.snapshot() == before[1]  # type: ignore[attr-defined]
    assert engine.model_runner.calls == 0  # type: ignore[attr-defined]


def test_a_retried_step_produces_the_tokens_of_a_run_without_the_fault() -> None:
    engine = build_engine(CONFIG, spec=False)
    ids = [add(engine, p, PARAMS) for p in PROMPTS]
    runner: Any = engine.model_runner
    outs: dict[int, list[int]] = {}
    failures = 0
    while engine.has_unfinished_requests():
        runner.fault.arm(1, KeyboardInterrupt)  # every other step fails after one write
        try:
            for out in engine.step():
                outs[out.request_id] = list(out.outputs[0].token_ids)
        except KeyboardInterrupt:
            failures += 1
            engine.block_manager.check_invariants(engine.scheduler.running)  # type: ignore[attr-defined]
        runner.fault.disarm()
        for out in engine.step():
            outs[out.request_id] = list(out.outputs[0].token_ids)
    assert failures > 3
    assert engine.scheduler.stats.failed_steps == failures
    assert [outs[i] for i in ids] == [expected_tokens(p) for p in PROMPTS]


def test_a_failed_detokenisation_loses_no_finished_request() -> None:
    tokenizer = FakeTokenizer()
    wide = replace(CONFIG, max_num_batched_tokens=64)
    engine = build_engine(wide, spec=False, tokenizer=tokenizer)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = [add(engine, p, params) for p in PROMPTS[1:]]  # no shared prefix: one step
    tokenizer.fault.arm(1, ValueError)  # the second output's decode raises
    with pytest.raises(ValueError, match="injected"):
        engine.step()
    assert engine.has_unfinished_requests()
    outs = engine.step()  # delivered now, all of them, the model not run again
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert engine.model_runner.calls == 1  # type: ignore[attr-defined]
    for out in outs:
        assert out.outputs[0].text == "".join(
            f"<{t}>" for t in expected_tokens(list(out.prompt_token_ids), params)
        )
    assert_idle_and_whole(engine)


def test_a_finished_but_undelivered_request_can_be_aborted() -> None:
    tokenizer = FakeTokenizer()
    wide = replace(CONFIG, max_num_batched_tokens=64)
    engine = build_engine(wide, spec=False, tokenizer=tokenizer)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    a = add(engine, PROMPTS[1], params)
    b = add(engine, PROMPTS[2], params)
    tokenizer.fault.arm(0, ValueError)
    with pytest.raises(ValueError):
        engine.step()
    assert engine.abort_request(a)
    assert not engine.abort_request(a)
    assert [o.request_id for o in engine.step()] == [b]
    assert_idle_and_whole(engine)


class NonFiniteFor(FakeModelRunner):
    """Returns ``FailedSample`` for the sequences whose first prompt token is ``poison``."""

    def __init__(self, poison: int, *args: Any) -> None:
        super().__init__(*args)
        self.poison = poison

    def run(self, seqs: list[Any], is_prefill: bool) -> list[Any]:
        out: list[Any] = super().run(seqs, is_prefill)
        return [
            FailedSample("logits are not finite") if s.token_ids[0] == self.poison else t
            for s, t in zip(seqs, out, strict=True)
        ]


def test_a_failed_sample_finishes_only_its_request_with_error() -> None:
    runner = NonFiniteFor(4, CONFIG.num_kvcache_blocks, CONFIG.kvcache_block_size, VOCAB)
    engine = LLMEngine(runner, CONFIG, vocab_size=VOCAB)
    outs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        if prompt[0] == 4:
            assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
            assert out.outputs[0].stop_reason == "logits are not finite"
        else:
            assert list(out.outputs[0].token_ids) == expected_tokens(prompt)
            assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
    assert_idle_and_whole(engine)


# ---- the real model ------------------------------------------------------------------------


def _faulty_forward(llm: LLM, fail_at: Callable[[int], bool]) -> list[int]:
    """Make the model's last decoder layer raise at the steps ``fail_at`` picks (the
    earlier layers have written this step's K/V by then); returns the call log."""
    layer = llm.model_runner.model.model.layers[-1]
    forward = layer.forward
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(calls))
        if fail_at(len(calls) - 1):
            raise KeyboardInterrupt("injected fault in the model")
        return forward(*args, **kwargs)

    layer.forward = wrapped  # type: ignore[method-assign]
    return calls


def test_llm_generate_after_a_fault_at_every_model_call_is_exact(tiny_model_dir: Path) -> None:
    llm = LLM(
        tiny_model_dir,
        num_kvcache_blocks=10,  # three requests need 13 blocks: preemption
        kvcache_block_size=4,
        max_num_batched_tokens=8,  # chunked prefill
        max_model_len=24,
    )
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6], [5, 6, 7, 8, 9, 10, 11, 12, 14], [20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.last_run_stats is not None and llm.last_run_stats.preemptions > 0
    fail_at: list[int | None] = [None]
    calls = _faulty_forward(llm, lambda i: i == fail_at[0])
    llm.generate(prompts, params, use_tqdm=False)
    num_calls = len(calls)
    assert num_calls >= 8
    pool = llm.engine.num_blocks
    for k in range(num_calls):
        calls.clear()
        fail_at[0] = k
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.block_manager.num_free_blocks == pool
        llm.engine.block_manager.check_invariants([])  # type: ignore[attr-defined]
        calls.clear()
        fail_at[0] = None
        assert [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ] == clean


# ---- issue 28: a fault anywhere in a step --------------------------------------------------


class TailInterrupted(Scheduler):
    """A KeyboardInterrupt in ``schedule()``'s tail, once the batch is chosen (a Ctrl-C
    there once left the step in flight for good)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed = True

    def _note_blocks_in_use(self) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt("Ctrl-C in schedule's tail")
        super()._note_blocks_in_use()


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return outs
        for out in engine.step():
            outs[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError("the engine did not drain")


def test_a_keyboard_interrupt_in_schedules_tail_leaves_the_engine_serving() -> None:
    engine = build_engine(CONFIG, spec=False, scheduler_cls=TailInterrupted)
    ids = [add(engine, p, PARAMS) for p in PROMPTS]
    with pytest.raises(KeyboardInterrupt, match="schedule's tail"):
        engine.step()
    sched = engine.scheduler
    assert not sched._in_flight, "the interrupted step is still in flight"
    assert sched.stats.failed_steps == 1 and sched.stats.steps == 0
    engine.block_manager.check_invariants(sched.running)  # type: ignore[attr-defined]
    assert engine.abort_request(ids[-1])
    engine.block_manager.check_invariants(sched.running)  # type: ignore[attr-defined]
    outs = _drain(engine)
    assert [outs[i] for i in ids[:-1]] == [expected_tokens(p) for p in PROMPTS[:-1]]
    assert_idle_and_whole(engine)


class RecoveryInterrupted(TailInterrupted):
    """``TailInterrupted``, then more Ctrl-Cs as recovery starts, twice (in ``schedule()``'s
    own handler, then in the step's): the step is left in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.interrupts = 2

    def recover(self) -> list[Any]:
        if self.interrupts and self._in_flight:
            self.interrupts -= 1
            raise KeyboardInterrupt("Ctrl-C during recovery")
        return super().recover()


def test_after_an_interrupted_recovery_abort_and_the_next_step_recover_first() -> None:
    engine = build_engine(CONFIG, spec=False, scheduler_cls=RecoveryInterrupted)
    ids = [add(engine, p, PARAMS) for p in PROMPTS]
    with pytest.raises(KeyboardInterrupt, match="during recovery"):
        engine.step()
    sched = engine.scheduler
    assert sched._in_flight, "the test's premise: the step is left in flight"
    assert engine.abort_request(ids[0])
    assert not sched._in_flight
    assert all(s.block_table == [] for s in sched.waiting)
    engine.block_manager.check_invariants(sched.running)  # type: ignore[attr-defined]
    outs = _drain(engine)
    assert [outs[i] for i in ids[1:]] == [expected_tokens(p) for p in PROMPTS[1:]]
    assert_idle_and_whole(engine)


class FailInStops(Scheduler):
    """Raises in the stop check of ``fail_seq`` at its ``fail_at``-th token (after the
    sequences before it in the batch have committed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_seq: Any = None
        self.fail_at = 1

    def _stops(self, seq: Any, token: int) -> bool:
        if seq is self.fail_seq and seq.num_completion_tokens == self.fail_at:
            self.fail_seq = None
            raise RuntimeError("injected in postprocess")
        return super()._stops(seq, token)


class FailInStopsOf(FailInStops):
    """``FailInStops`` aimed at the sequence whose prompt starts with token 4."""

    def _stops(self, seq: Any, token: int) -> bool:
        if self.fail_at and seq.token_ids[0] == 4:
            self.fail_seq = seq
        return super()._stops(seq, token)


def test_partial_outputs_hold_the_requests_the_failing_step_finished() -> None:
    """Issue 28's defect 4: the step's postprocess finishes the first request, then
    raises for the second; the first is complete and is handed back."""
    config = replace(CONFIG, max_num_batched_tokens=64, num_kvcache_blocks=32)
    engine = build_engine(config, spec=False, scheduler_cls=FailInStopsOf)
    engine.scheduler.fail_at = 2  # type: ignore[attr-defined]
    prompts = [[1, 2, 3], [4, 2, 3]]
    params = [replace(PARAMS, max_tokens=2), replace(PARAMS, max_tokens=5)]
    with pytest.raises(RuntimeError, match="injected in postprocess") as info:
        engine.generate(prompts, params, use_tqdm=False)
    partial = info.value.partial_outputs  # type: ignore[attr-defined]
    assert [o.outputs[0].token_ids for o in partial] == [expected_tokens(prompts[0], params[0])]
    assert partial[0].finished and partial[0].outputs[0].finish_reason == "length"
    assert_idle_and_whole(engine)


class NewsForRecovered(LLMEngine):
    """Mutant (issue 28's first held-out bug): after a failed step, the results of the
    sequences ``recover()`` preempted are recorded too: news, and a first-token time, for
    tokens that are gone."""

    def _settle(self) -> None:
        self.scheduler.recover()
        self.output_processor.record_committed(())


class ChunksSampleNothing(CheckedRunner):
    """The fake model as the real runner answers: None for a chunk that leaves the prompt
    incomplete (the fake alone returns a token there, which the scheduler ignores)."""

    def run(self, seqs: list[Any], is_prefill: bool) -> list[Any]:
        ends = [s.num_cached_tokens + s.num_scheduled_tokens for s in seqs]
        out = super().run(seqs, is_prefill)
        samples = [end == s.num_tokens for s, end in zip(seqs, ends, strict=True)]
        return [t if sampled else None for t, sampled in zip(out, samples, strict=True)]


def check_no_news_for_recovered(engine_cls: type[LLMEngine]) -> None:
    """B's prefill finishes in step 2, whose postprocess raises for it: B is recovered,
    its first token dropped. It has no first-token time, and the next step, which only
    recomputes its prompt (no prefix caching: two chunks), reports nothing."""
    config = replace(CONFIG, enable_prefix_caching=False, num_kvcache_blocks=32)
    engine = engine_cls(
        ChunksSampleNothing(config, VOCAB, 100),
        config,
        vocab_size=VOCAB,
        eos_token_id=0,
        scheduler_cls=FailInStops,
    )
    a = add(engine, [1, 2], PARAMS)
    b = add(engine, [3, 1, 4, 1, 3, 2, 2, 3], PARAMS)
    sched: Any = engine.scheduler
    sched.fail_seq = engine._requests[b].completions[0].seq
    assert [o.request_id for o in engine.step()] == [a]  # A's first token, B's first chunk
    with pytest.raises(RuntimeError, match="injected in postprocess"):
        engine.step()  # B's last chunk and first token: recovered
    assert engine._requests[b].first_token_time is None, "a first-token time for no token"
    assert sched.stats.failed_steps == 1
    assert engine.step() == [], "news for a request whose token was dropped"
    outs = _drain(engine)
    assert outs[b] == expected_tokens([3, 1, 4, 1, 3, 2, 2, 3])


def test_no_news_nor_first_token_time_for_a_sequence_recover_preempted() -> None:
    check_no_news_for_recovered(LLMEngine)


def test_the_news_check_catches_news_for_recovered_sequences() -> None:
    with pytest.raises(AssertionError, match="first-token time for no token"):
        check_no_news_for_recovered(NewsForRecovered)
