"""LLMEngine with the fake model: generate, abort, liveness, and every bad request refused
before any state changes (the engine keeps serving everything else)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.indexing import num_blocks
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.stats import RunStats
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, add, build_engine
from tests.fake_model import reference_generate

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


CONFIG: dict[str, Any] = dict(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    max_model_len=32,
    kvcache_block_size=4,
    num_kvcache_blocks=16,
)


def make_engine(**overrides: Any) -> LLMEngine:
    return build_engine(EngineConfig(**{**CONFIG, **overrides}), spec=False)


def expected(prompt: list[int], params: SamplingParams, engine: LLMEngine) -> list[int]:
    tokens, _ = reference_generate(
        prompt,
        params,
        vocab_size=VOCAB,
        eos_token_id=engine.eos_token_ids[0] if engine.eos_token_ids else None,
        max_model_len=engine.config.max_model_len,
    )
    return tokens


def engine_state(engine: LLMEngine) -> object:
    sched = engine.scheduler
    return (
        engine.block_manager.snapshot(),  # type: ignore[attr-defined]
        [s.seq_id for s in sched.waiting],
        [s.seq_id for s in sched.running],
        dict(engine._requests),
    )


def test_generate_returns_outputs_in_input_order_with_per_prompt_params() -> None:
    engine = make_engine()
    prompts = [[1, 2, 3, 4, 1], [1, 2, 3, 4, 2], [3] * 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, prompt, sp in zip(outs, prompts, params, strict=True):
        assert list(out.outputs[0].token_ids) == expected(prompt, sp, engine)
        assert out.outputs[0].finish_reason == "length"
    # the second prompt shares a full block ([1, 2, 3, 4]) with the first, admitted before it
    # was computed, so it is recomputed; a rerun is served from the prefix cache
    again = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert [o.num_cached_tokens for o in again] == [4, 4, 8]
    stats = engine.last_run_stats
    assert stats is not None and stats.cached_prompt_tokens == 16 and stats.prompt_tokens == 19


def test_stop_reasons() -> None:
    engine = make_engine()
    prompt = [1, 2, 3]
    free = expected(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), engine)
    stop = free[2]
    out = engine.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop,), ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert (
        list(out.outputs[0].token_ids) == free[: free.index(stop) + 1]
        and out.outputs[0].finish_reason == "stop"
    )
    engine.scheduler.eos_token_ids = frozenset({free[1]})
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert (
        list(out.outputs[0].token_ids) == free[: free.index(free[1]) + 1]
        and out.outputs[0].finish_reason == "stop"
    )


def check_abort_forgets_the_request(engine_cls: type[LLMEngine] = LLMEngine) -> None:
    """Abort frees the request's blocks at once and forgets it (a second abort finds
    nothing, it no longer counts as unfinished); the others finish as if it never was."""
    engine = build_engine(EngineConfig(**CONFIG), spec=False, engine_cls=engine_cls)
    a = add(engine, [1, 2, 3, 4, 0, 1], GREEDY)
    b = add(engine, [2, 2, 2], GREEDY)
    engine.step()  # both admitted and prefilled
    free_before = engine.block_manager.num_free_blocks
    assert engine.abort_request(a)
    assert engine.block_manager.num_free_blocks == free_before + 2
    assert engine.get_num_unfinished_requests() == 1
    outs = []
    for _ in range(20):  # a step guard: b needs 6 steps
        if not engine.has_unfinished_requests():
            break
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [b]
    assert list(outs[0].outputs[0].token_ids) == expected([2, 2, 2], GREEDY, engine)
    assert not engine.abort_request(a), "aborted twice"
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    engine.generate([[1, 2]], GREEDY, use_tqdm=False)  # idle: generate may run


def test_abort_frees_blocks_at_once_and_others_finish() -> None:
    check_abort_forgets_the_request()


def check_run_stats_are_per_call() -> None:
    """``last_run_stats`` counts one ``generate`` call: a second run of the same prompts
    is served from the prefix cache, and its prefill counts only what it computed.
    Hand-counted (block size 4, no preemption, budget for both prompts in one step):
    prompt tokens 5 + 9; each prompt's prefill samples one token and 5 decode steps the
    other 5; at the last decode step the tables hold 3 + 4 blocks. The rerun hits 4 of
    the first prompt and 8 of the second (block 2, the last, is never looked up)."""
    engine = make_engine()
    prompts = [[1, 2, 3, 4, 1], [3] * 9]
    per_run = dict(
        num_requests=2, prompt_tokens=14, decode_tokens=10, preemptions=0,
        peak_blocks_in_use=7, num_blocks=16, steps=6, elapsed_s=0.0, output_tokens=12,
    )  # fmt: skip
    for cached, prefilled in ((0, 14), (12, 2)):
        engine.generate(prompts, GREEDY, use_tqdm=False)
        stats = engine.last_run_stats
        assert stats is not None
        want = RunStats(**per_run, cached_prompt_tokens=cached, prefill_tokens=prefilled)  # type: ignore[arg-type]
        assert replace(stats, elapsed_s=0.0) == want


def test_run_stats_are_per_call() -> None:
    check_run_stats_are_per_call()


def test_max_tokens_none_runs_to_max_model_len() -> None:
    """max_tokens=None: the request stops exactly at max_model_len, with "length"."""
    engine = make_engine(max_model_len=12)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = engine.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 9 and out.outputs[0].finish_reason == "length"
    full = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    assert list(out.outputs[0].token_ids) == expected([1, 2, 3], full, engine)


def check_liveness_with_the_smallest_legal_pool(scheduler_cls: type[Scheduler] = Scheduler) -> None:
    """A pool holding exactly one max_model_len sequence: every request finishes."""
    cfg = EngineConfig(
        max_num_batched_tokens=8,
        max_num_seqs=8,
        max_model_len=24,
        kvcache_block_size=4,
        num_kvcache_blocks=num_blocks(24, 4),
    )
    # The step guard: a scheduler that stops making progress fails at 2,000 steps (a
    # check with a message) instead of hanging the suite; ten times what this run needs.
    engine = build_engine(cfg, spec=False, scheduler_cls=scheduler_cls, max_steps=2_000)
    prompts = [[i % VOCAB, 1, 2, 3, i % 3, 4, 0, 1, 2, 3] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    for out, prompt in zip(outs, prompts, strict=True):
        assert list(out.outputs[0].token_ids) == expected(prompt, params, engine)
    stats = engine.last_run_stats
    assert stats is not None and stats.preemptions > 0
    assert stats.steps * 10 <= 2_000
    assert engine.block_manager.num_free_blocks == cfg.num_kvcache_blocks


def test_liveness_with_the_smallest_legal_pool() -> None:
    check_liveness_with_the_smallest_legal_pool()


BAD_REQUESTS = [
    ([], GREEDY, ValueError, "empty"),
    ([1, -1], GREEDY, ValueError, "token 1 is -1"),
    ([1, VOCAB], GREEDY, ValueError, f"outside the vocabulary \\[0, {VOCAB}\\)"),
    ([1, 2.0], GREEDY, TypeError, "not an int"),
    ([1, True], GREEDY, TypeError, "not an int"),
    ("text", GREEDY, TypeError, "needs a tokenizer"),
    (42, GREEDY, TypeError, "a string, a list of token ids or a prompt dict"),
    ([1] * 30, SamplingParams(max_tokens=3), ValueError, "exceeds max_model_len"),
    ([1, 2], {"max_tokens": 0}, ValueError, "max_tokens"),
    ([1, 2], {"temperature": -0.5}, ValueError, "temperature"),
    ([1, 2], {"top_p": 0.0}, ValueError, "top_p"),
    ([1, 2], {"top_p": 1.5}, ValueError, "top_p"),
    ([1, 2], {"top_k": 1.5}, TypeError, "top_k"),
    ([1, 2], {"top_k": -2}, ValueError, "top_k"),
    ([1, 2], {"temprature": 0.5}, TypeError, "temprature"),
    ([1, 2], "greedy", TypeError, "sampling params"),
]


@pytest.mark.parametrize(("prompt", "params", "exc", "words"), BAD_REQUESTS)
def test_bad_request_is_refused_and_changes_nothing(
    prompt: Any, params: Any, exc: type, words: str
) -> None:
    engine = make_engine()
    busy = add(engine, [4, 4, 4, 4, 4], GREEDY)  # other work in flight
    engine.step()
    before = engine_state(engine)
    with pytest.raises(exc, match=words):
        add(engine, prompt, params)
    assert engine_state(engine) == before
    # the engine keeps serving: the request in flight and a new one match the oracle
    new = add(engine, [1, 2, 3], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert list(outs[busy].outputs[0].token_ids) == expected([4, 4, 4, 4, 4], GREEDY, engine)
    assert list(outs[new].outputs[0].token_ids) == expected([1, 2, 3], GREEDY, engine)
    assert engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize(("prompt", "params", "exc", "words"), BAD_REQUESTS)
def test_generate_with_one_bad_request_queues_nothing(
    prompt: Any, params: Any, exc: type, words: str
) -> None:
    engine = make_engine()
    before = engine_state(engine)
    with pytest.raises(exc, match=words):
        engine.generate([[1, 2, 3], prompt], [GREEDY, params], use_tqdm=False)
    assert engine_state(engine) == before and not engine.has_unfinished_requests()
    out = engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected([1, 2, 3], GREEDY, engine)


def test_a_request_larger_than_the_pool_is_refused() -> None:
    engine = make_engine(num_kvcache_blocks=3, max_model_len=64)  # 12 token slots
    with pytest.raises(ValueError, match="needs 4 KV blocks at full length but the pool has 3"):
        add(engine, [1] * 10, SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    out = engine.generate(
        [[1] * 10], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_params_list_length_must_match_prompts() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        engine.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_generate_needs_an_idle_engine() -> None:
    engine = make_engine()
    add(engine, [1, 2], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([[1]], GREEDY, use_tqdm=False)


def test_a_request_whose_prefix_is_being_computed_waits_a_step_and_hits_it() -> None:
    """Prefix-aware admission: the second and third prompts share two full blocks with the
    first; admitted in the same step they would compute them again. Deferred one step,
    they hit them, and the results are unchanged."""
    engine = make_engine()
    prompts = [
        [1, 2, 3, 4, 0, 1, 2, 3, 4],
        [1, 2, 3, 4, 0, 1, 2, 3, 1],
        [2, 2, 2],
        [1, 2, 3, 4, 0, 1, 2, 3],
    ]
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    # prompt 3 has only two blocks: its second is its last, never looked up, so it hits one
    assert [o.num_cached_tokens for o in outs] == [0, 8, 0, 4]
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        expected(p, GREEDY, engine) for p in prompts
    ]
    batches = engine.model_runner.batches  # type: ignore[attr-defined]
    # prompts 0 and 2 (9 and 3 tokens) in the first step; 1 and 3 deferred
    assert [n for _, n in batches[0][1]] == [9, 3]
    assert [n for _, n in batches[1][1]] == [1, 4]  # a prefill step: the hits' uncached rows


def test_without_prefix_caching_nothing_is_deferred() -> None:
    engine = make_engine(enable_prefix_caching=False)
    prompts = [[1, 2, 3, 4, 0, 1, 2, 3, 4], [1, 2, 3, 4, 0, 1, 2, 3, 1]]
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    batches = engine.model_runner.batches  # type: ignore[attr-defined]
    assert len(batches[0][1]) == 2


def test_requests_that_cannot_hit_each_other_are_not_deferred() -> None:
    """Issue 11's reproduction: block (3, 3, 3, 3) cached; A and B arrive together, with
    different first blocks and equal second blocks. B hits (3, 3, 3, 3) and can never hit
    A's second block (another chain), so both run in the first step (deferring B by
    position and tokens cost it a step: tests/test_scheduler_machine.py shows both)."""
    engine = make_engine()
    engine.generate([[3, 3, 3, 3, 1]], GREEDY, use_tqdm=False)
    runner: Any = engine.model_runner
    first = len(runner.batches)
    prompts = [[1, 1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 2, 2, 2, 2, 4]]
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [n for _, n in runner.batches[first][1]] == [9, 5]
    assert [o.num_cached_tokens for o in outs] == [0, 4]
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        expected(p, GREEDY, engine) for p in prompts
    ]


# ---- a stop token's text (issue 28, defect 6) -------------------------------------------------


def _ended(engine: LLMEngine, prompt: list[int], params: SamplingParams, stream: bool) -> Any:
    if not stream:
        (out,) = engine.generate(prompt, params, use_tqdm=False)
        return out.outputs[0]
    engine.add_request("s", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].outputs[0]


def _ending_with(token: int, ignore_eos: bool) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation (EOS 0 ignored) has ``token`` first at position 2
    or later, and that continuation up to it."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for a in range(1, VOCAB):
        for b in range(1, VOCAB):
            prompt = [a, b, a]
            tokens, _ = reference_generate(
                prompt, free, vocab_size=VOCAB, eos_token_id=None, max_model_len=32
            )
            cut = tokens.index(token) if token in tokens else -1
            if cut >= 2 and (ignore_eos or 0 not in tokens[:cut]):
                return prompt, tokens[: cut + 1]
    raise AssertionError(f"no continuation ends in {token}")


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream"])
@pytest.mark.parametrize("include", [False, True], ids=["dropped", "included"])
def test_the_text_of_the_token_that_stopped_a_request(stream: bool, include: bool) -> None:
    """vLLM's rule: the text of the EOS or stop token that ended a completion is left out,
    unless ``include_stop_str_in_output``; its id stays in ``token_ids``."""
    from tests.fake_model import FakeTokenizer

    engine = build_engine(EngineConfig(**CONFIG), spec=False, tokenizer=FakeTokenizer())
    assert engine.eos_token_ids == (0,)
    for token, reason in ((0, None), (3, 3)):  # EOS, then a stop token
        prompt, tokens = _ending_with(token, ignore_eos=token != 0)
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=token != 0,
            stop_token_ids=[token] if token else [],
            include_stop_str_in_output=include,
        )
        c = _ended(engine, prompt, params, stream)
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (tokens, "stop", reason)
        shown = tokens if include else tokens[:-1]
        assert c.text == "".join(f"<{t}>" for t in shown)


def test_a_stream_gets_its_prompt_logprobs_with_its_first_token() -> None:
    """vLLM returns prompt logprobs with the first output; a stream without a tokenizer
    (nothing else makes its completion's text each step) once got them only at the end."""
    from tests import fault_tracing as ft

    engine = LLMEngine(ft.LogprobsRunner(ft.CONFIG, ft.VOCAB, 100), ft.CONFIG, vocab_size=ft.VOCAB)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]  # two chunks
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    first, last = outs[0], outs[-1]
    assert len(first.outputs[0].token_ids) == 1 and not first.finished
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    assert None not in first.prompt_logprobs[1:]
    assert first.prompt_logprobs == last.prompt_logprobs
