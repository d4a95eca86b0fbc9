"""Tests that kill mutants mutmut (tox -e mutation) found alive: the engine's front end
(engine/llm_engine.py, scheduler.py aborts, stats.py, progress.py, output_processor.py).

Each section names what it kills. The expected values never come from the code under test:
they are computed by a second, deliberately naive procedure or written out by hand.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine import progress as progress_module
from paged_engine.engine.block_manager import BlockManager
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.progress import Progress
from paged_engine.engine.request_builder import child_seed
from paged_engine.engine.scheduler import Scheduler, SchedulerStats
from paged_engine.engine.sequence import Sequence, SequenceStatus
from paged_engine.engine.stats import RunStats, run_stats
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeModelRunner
from tests.test_faults import CONFIG as FAULTS_CONFIG
from tests.test_faults import PARAMS as FAULT_PARAMS
from tests.test_faults import PROMPTS as FAULT_PROMPTS
from tests.test_faults import _opportunities_before_call, count_model_calls

# --------------------------------------------------------------------------------------------
# generate()'s failure note (engine/llm_engine.py _attach_partial_outputs): the selection
# read .partial_outputs but never the note that tells a user they exist.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("late", [False, True], ids=["first-call", "last-call"])
def test_a_failed_generate_notes_its_finished_outputs_only_when_there_are_some(
    late: bool,
) -> None:
    calls = count_model_calls()  # numbered from 0
    engine = build_engine(FAULTS_CONFIG, spec=False)
    runner: Any = engine.model_runner
    runner.fault.arm(_opportunities_before_call(calls - 1 if late else 0) + 1, RuntimeError)
    with pytest.raises(RuntimeError, match="injected fault") as info:
        engine.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)
    partial = info.value.partial_outputs  # type: ignore[attr-defined]
    notes = getattr(info.value, "__notes__", [])
    if late:
        assert len(partial) >= 1
        assert notes == [f"generate: {len(partial)} request(s) had finished: see .partial_outputs"]
    else:
        assert partial == [] and notes == []


# --------------------------------------------------------------------------------------------
# LLMEngine.reset_prefix_cache and child_seed (engine/request_builder.py): no test in the selection
# called either (the allocator's R13 is tested on its own; n > 1 seeds only through a model).
# --------------------------------------------------------------------------------------------

RESET_CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=4,
    max_model_len=40,
    kvcache_block_size=4,
    num_kvcache_blocks=16,
)
RESET_PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_engine_reset_prefix_cache_forgets_blocks_only_when_idle() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    prompt = [1, 2, 3, 4, 2, 3, 4, 1, 3]  # two full blocks of 4
    engine.generate(prompt, RESET_PARAMS, use_tqdm=False)
    (warm,) = engine.generate(prompt, RESET_PARAMS, use_tqdm=False)
    assert warm.num_cached_tokens == 8
    # Refused while a request holds blocks, and nothing is forgotten.
    engine.add_request("busy", [4, 4, 4, 4, 4], RESET_PARAMS)
    engine.step()
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    (still,) = engine.generate(prompt, RESET_PARAMS, use_tqdm=False)
    assert still.num_cached_tokens == 8
    # Idle: forgotten.
    assert engine.reset_prefix_cache() is True
    (cold,) = engine.generate(prompt, RESET_PARAMS, use_tqdm=False)
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids


def test_child_seeds() -> None:
    golden = 0x9E3779B97F4A7C15  # the documented odd multiplier (2**64 / golden ratio)
    assert child_seed(12345, 0) == 12345  # the first completion keeps the seed: n = 1 as before
    assert child_seed(12345, 1) == 12345 + golden
    assert child_seed(12345, 3) == (12345 + 3 * golden) % 2**64
    assert child_seed(2**64 - 1, 1) == golden - 1  # wraps modulo 2**64
    seeds = [child_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**64 for s in seeds)


class WithoutReset(BlockManager):
    """An allocator that predates R13: everything but ``reset_prefix_cache``."""

    @property
    def reset_prefix_cache(self) -> Any:  # type: ignore[override]
        raise AttributeError("reset_prefix_cache")


def test_engine_reset_prefix_cache_without_an_allocator_that_can() -> None:
    pool, bs = RESET_CONFIG.num_kvcache_blocks, RESET_CONFIG.kvcache_block_size
    assert pool is not None
    engine = LLMEngine(
        FakeModelRunner(pool, bs, VOCAB),
        RESET_CONFIG,
        vocab_size=VOCAB,
        eos_token_id=0,
        block_manager=WithoutReset(pool, bs),
    )
    (out,) = engine.generate([1, 2, 3], RESET_PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    assert engine.reset_prefix_cache() is False


# --------------------------------------------------------------------------------------------
# RunStats (engine/stats.py): each counter is taken as a difference over the call. The
# selection's runs started from a fresh scheduler (every "before" counter 0).
# --------------------------------------------------------------------------------------------


def test_run_stats_are_differences_over_the_call() -> None:
    before = SchedulerStats(
        prefill_tokens=100,
        decode_tokens=200,
        output_tokens=300,
        cached_prompt_tokens=40,
        prompt_tokens=150,
        preemptions=5,
        peak_blocks_in_use=9,
        steps=60,
    )
    after = SchedulerStats(
        prefill_tokens=130,
        decode_tokens=270,
        output_tokens=390,
        cached_prompt_tokens=48,
        prompt_tokens=170,
        preemptions=7,
        peak_blocks_in_use=12,
        steps=95,
    )
    assert run_stats(before, after, 3, 64, 1.5) == RunStats(
        num_requests=3,
        prompt_tokens=20,
        prefill_tokens=30,
        decode_tokens=70,
        cached_prompt_tokens=8,
        preemptions=2,
        peak_blocks_in_use=12,  # a peak, not a count: the run's own
        num_blocks=64,
        steps=35,
        elapsed_s=1.5,
        output_tokens=90,
    )


# --------------------------------------------------------------------------------------------
# Aborts (engine/scheduler.py abort, engine/llm_engine.py abort_request): the return values,
# and the aborted sequence's final state.
# --------------------------------------------------------------------------------------------


def test_abort_returns_whether_it_found_the_request() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    assert engine.abort_request("nobody") is False
    assert engine.abort_request(["nobody", "else"]) is False
    engine.add_request("a", [1, 2, 3], RESET_PARAMS)
    assert engine.abort_request(["nobody", "a"]) is True
    assert not engine.has_unfinished_requests()


def test_scheduler_abort_finishes_the_sequence_once() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    sched = engine.scheduler
    seq = Sequence([1, 2, 3], block_size=RESET_CONFIG.kvcache_block_size)
    sched.add(seq)
    assert sched.abort(seq) is True
    assert seq.status is SequenceStatus.FINISHED
    assert sched.abort(seq) is False  # in no queue any more


def test_scheduler_abort_forgets_a_failed_samples_reason() -> None:
    # A sequence whose sample failed waits, finished, for its output; aborted then, its
    # reason must not outlive it in ``errors`` (read by finish_reason / stop_reason).
    sched = build_engine(RESET_CONFIG, spec=False).scheduler
    seq = Sequence([1, 2, 3], block_size=RESET_CONFIG.kvcache_block_size)
    sched.add(seq)
    sched.errors[seq.seq_id] = "logits are not finite"
    assert sched.finish_reason(seq) == "error"
    assert sched.abort(seq) is True
    assert seq.seq_id not in sched.errors


# --------------------------------------------------------------------------------------------
# generate()'s bookkeeping (engine/llm_engine.py, engine/progress.py): request ids across
# calls, the run's statistics, the stall guard, and the progress bar (the selection always
# passed use_tqdm=False).
# --------------------------------------------------------------------------------------------

THREE = [[1, 2, 3], [2, 3, 4, 1], [3, 1]]


def test_generate_numbers_its_requests_across_calls() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    ids = [
        [out.request_id for out in engine.generate(THREE, RESET_PARAMS, use_tqdm=False)]
        for _ in range(3)
    ]
    assert ids == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"]]


def test_last_run_stats_describe_the_call() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    engine.generate(THREE, RESET_PARAMS, use_tqdm=False)
    stats = engine.last_run_stats
    assert stats is not None
    assert (stats.num_requests, stats.num_blocks) == (3, RESET_CONFIG.num_kvcache_blocks)
    assert stats.prompt_tokens == 9 and stats.output_tokens == 9  # 3 + 4 + 2 in, 3 x 3 out
    assert 1 <= stats.peak_blocks_in_use <= RESET_CONFIG.num_kvcache_blocks


class NeverRuns(Scheduler):
    """A broken scheduler: claims to be finished while requests wait. Its step guard makes
    a missing stall check fail the test instead of hanging it."""

    calls = 0

    def is_finished(self) -> bool:
        return True

    def schedule(self) -> tuple[list[Sequence], bool]:
        type(self).calls += 1
        assert type(self).calls < 50, "generate kept stepping a scheduler that cannot run"
        return [], False


def test_generate_refuses_to_spin_on_a_scheduler_that_cannot_run() -> None:
    engine = build_engine(RESET_CONFIG, spec=False, scheduler_cls=NeverRuns)
    with pytest.raises(RuntimeError) as info:
        engine.generate(THREE, RESET_PARAMS, use_tqdm=False)
    assert str(info.value) == "generate: requests remain but nothing can run (a bug)"
    assert not engine.has_unfinished_requests()  # generate aborted what it added


def test_generate_shows_a_progress_bar_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    engine.generate(THREE, RESET_PARAMS)
    bar = capsys.readouterr().err
    assert "generate: 100%" in bar and "3/3" in bar
    assert " tok/s, prefill " in bar and bar.rstrip().endswith("tok/s]")
    engine.generate(THREE, RESET_PARAMS, use_tqdm=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("prompts", "params", "error", "message"),
    [
        (
            7,
            RESET_PARAMS,
            TypeError,
            "prompts must be a prompt (a string, token ids or a prompt dict) or a list of "
            "them, got int",
        ),
        ([], RESET_PARAMS, ValueError, "prompts is empty"),
        ([[1, 2]], [RESET_PARAMS] * 2, ValueError, "got 2 sampling params for 1 prompts"),
        (
            [[1, 2]],
            "greedy",
            TypeError,
            "sampling_params must be SamplingParams or a list of them, got str",
        ),
    ],
    ids=["prompts-type", "empty", "params-length", "params-type"],
)
def test_generate_refusals_name_the_problem_and_change_nothing(
    prompts: object, params: object, error: type[Exception], message: str
) -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    with pytest.raises(error) as info:
        engine.generate(prompts, params, use_tqdm=False)
    assert str(info.value) == message
    assert not engine.has_unfinished_requests()
    # Nothing was numbered: the next call's first request is "0".
    (out,) = engine.generate([[1, 2]], RESET_PARAMS, use_tqdm=False)
    assert out.request_id == "0"


def test_generate_refuses_a_busy_engine_and_leaves_its_request_alone() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    engine.add_request("mine", [1, 2, 3], RESET_PARAMS, arrival_time=123.0)
    with pytest.raises(RuntimeError) as info:
        engine.generate([[1, 2]], RESET_PARAMS, use_tqdm=False)
    assert str(info.value) == (
        "generate() needs an idle engine: requests added with add_request() are "
        "unfinished; drive them with step() first"
    )
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    (final,) = finals
    assert final.request_id == "mine" and len(final.outputs[0].token_ids) == 3
    assert final.metrics is not None and final.metrics.arrival_time == 123.0


def test_progress_reports_throughput_since_the_call_began(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    stats = SchedulerStats(prefill_tokens=1000, output_tokens=500)  # earlier calls' counts
    bar = Progress(3, stats, enabled=True)
    stats.prefill_tokens += 300
    stats.output_tokens += 40
    clock[0] += 0.5
    bar.update(["one finished request"])
    assert bar._bar.n == 1
    assert bar._bar.postfix == "out 80 tok/s, prefill 600 tok/s"  # 40 / 0.5, 300 / 0.5
    assert bar.elapsed == 0.5
    bar.close()


# OutputProcessor.forget (engine/output_processor.py): an aborted request leaves no record.
# --------------------------------------------------------------------------------------------


def test_abort_leaves_no_output_records() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    engine.add_request("a", [1, 2, 3], RESET_PARAMS)
    engine.step()
    outputs = engine.output_processor
    (request,) = [r for r in outputs.requests.values() if r.request_id == "a"]
    outputs.needs_text[request.completions[0]] = request  # as if its text were still pending
    assert engine.abort_request("a") is True
    assert not outputs.completion_of and not outputs.needs_text and not outputs.pending


# Progress's tqdm settings (engine/progress.py): kills xǁProgressǁ__init____mutmut_9, 13, 17
# (the bar stops following the terminal's width) and update__mutmut_16, 19 (a terminal
# redraw forced every step, which the class docstring rules out). A fake tqdm records what
# the bar is asked to do; the selection never looked.
# --------------------------------------------------------------------------------------------


class RecordingBar:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.postfixes: list[tuple[str, Any]] = []
        self.n = 0

    def set_postfix_str(self, s: str = "", refresh: Any = True) -> None:  # tqdm's default
        self.postfixes.append((s, refresh))

    def update(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        pass


def test_the_bar_follows_the_terminal_width_and_never_redraws_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(progress_module, "tqdm", RecordingBar)
    bar = Progress(2, SchedulerStats(), enabled=True)
    fake = bar._bar
    assert isinstance(fake, RecordingBar)
    assert fake.kwargs == {"total": 2, "desc": "generate", "disable": False, "dynamic_ncols": True}
    bar.update(["done"])
    bar.update([])
    assert [bool(refresh) for _, refresh in fake.postfixes] == [False, False]  # as tqdm reads it
    assert fake.n == 1


# LLMEngine's eos_token_id check (engine/llm_engine.py): kills xǁLLMEngineǁ__init____mutmut_23
# (the refusal without its message).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eos", [-1, True])
def test_a_bad_eos_token_id_is_refused_by_name(eos: Any) -> None:
    with pytest.raises(ValueError) as info:
        build_engine(RESET_CONFIG, spec=False, eos=eos)
    assert str(info.value) == f"eos_token_id must hold ints >= 0, got {eos!r}"


# LLMEngine's other construction refusals (engine/llm_engine.py): kills
# xǁLLMEngineǁ__init____mutmut_4 to 7 (the unknown pool's message), 8 (a vocab_size that is
# not an int let through), 10 and 11 (a vocabulary of one token refused) and 12 (no message).
# --------------------------------------------------------------------------------------------


def _runner() -> FakeModelRunner:
    pool, bs = RESET_CONFIG.num_kvcache_blocks, RESET_CONFIG.kvcache_block_size
    assert pool is not None
    return FakeModelRunner(pool, bs, VOCAB)


def test_an_engine_without_a_pool_size_is_refused_by_name() -> None:
    config = dataclasses.replace(RESET_CONFIG, num_kvcache_blocks=None)
    with pytest.raises(ValueError) as info:
        LLMEngine(_runner(), config, vocab_size=VOCAB)
    assert str(info.value) == "the KV pool size is unknown: set config.num_kvcache_blocks"


@pytest.mark.parametrize("vocab", [0, "8", 2.0])
def test_a_bad_vocab_size_is_refused_by_name(vocab: Any) -> None:
    with pytest.raises(ValueError) as info:
        LLMEngine(_runner(), RESET_CONFIG, vocab_size=vocab)
    assert str(info.value) == f"vocab_size must be an int >= 1, got {vocab!r}"


def test_a_vocabulary_of_one_token_is_accepted() -> None:
    engine = LLMEngine(_runner(), RESET_CONFIG, vocab_size=1)
    assert engine.vocab_size == 1


# A seeded request's completions (engine/request_builder.py, RequestBuilder.build): the
# first keeps the seed, the others get seed + i x 0x9E3779B97F4A7C15 mod 2**64
# (child_seed's docstring), written out here: kills xǁLLMEngineǁ_build__mutmut_34 and
# 37 to 46. And what a fresh engine reports:
# kills __init____mutmut_27 (eos ids None) and 65 (last_run_stats "").
# --------------------------------------------------------------------------------------------


def test_a_seeded_requests_completions_get_their_own_seeds() -> None:
    engine = build_engine(RESET_CONFIG, spec=False)
    engine.add_request("s", [1, 2, 3], SamplingParams(n=3, seed=5, max_tokens=2))
    seeds = [seq.sampling_params.seed for seq in engine.scheduler.waiting]
    golden = 0x9E3779B97F4A7C15
    assert seeds == [5, (5 + golden) % 2**64, (5 + 2 * golden) % 2**64]
    engine.add_request("u", [1, 2, 3], SamplingParams(n=2, max_tokens=2))
    assert [seq.sampling_params.seed for seq in list(engine.scheduler.waiting)[3:]] == [None, None]


def test_a_fresh_engine_has_no_run_statistics_and_its_eos_ids() -> None:
    engine = build_engine(RESET_CONFIG, spec=False, eos=7)
    assert engine.last_run_stats is None
    assert engine.eos_token_ids == (7,)
