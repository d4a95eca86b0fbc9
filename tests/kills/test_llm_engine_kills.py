"""Tests that kill mutants mutmut (tox -e mutation) found alive in engine/llm_engine.py and
engine/request_builder.py (which was part of it: the mutants named ``_build`` are now
``RequestBuilder.build``'s); the rest of the engine's front end is in test_engine_kills.py.

Each section names what it kills. The expected values never come from the code under test:
they are written out by hand from the documented behaviour.
"""

from __future__ import annotations

from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request import Request
from paged_engine.engine.request_builder import child_seed
from paged_engine.engine.scheduler import Scheduler
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeModelRunner, FakeTokenizer

CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=4,
    max_model_len=40,
    kvcache_block_size=4,
    num_kvcache_blocks=16,
)
PROMPT = [1, 2, 3, 4, 2, 3, 4, 1, 3]  # two full blocks of 4, then one token


# --------------------------------------------------------------------------------------------
# child_seed keeps the first completion's seed itself, whatever int it is: kills
# x_child_seed__mutmut_1 (every index mixed, so index 0 gives seed % 2**64).
# --------------------------------------------------------------------------------------------


def test_the_first_child_seed_is_the_seed_itself_even_outside_64_bits() -> None:
    assert child_seed(-1, 0) == -1  # a seed of -1 is a seed (SamplingParams' docstring)
    assert child_seed(2**64 + 3, 0) == 2**64 + 3


# --------------------------------------------------------------------------------------------
# The engine's own allocator follows the config's enable_prefix_caching: kills
# xǁLLMEngineǁ__init____mutmut_61 (the keyword dropped: the allocator's default, on).
# --------------------------------------------------------------------------------------------


def test_the_engines_own_allocator_honours_prefix_caching_off() -> None:
    off = EngineConfig(**{**_fields(CONFIG), "enable_prefix_caching": False})
    pool = off.num_kvcache_blocks
    assert pool is not None
    engine = LLMEngine(FakeModelRunner(pool, 4, VOCAB), off, vocab_size=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate(PROMPT, params, use_tqdm=False)
    (again,) = engine.generate(PROMPT, params, use_tqdm=False)
    assert again.num_cached_tokens == 0  # on, the two full blocks would hit: 8


def _fields(config: EngineConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


# --------------------------------------------------------------------------------------------
# RequestBuilder.build (``_build`` then): the refusal names its caller (kills
# _build__mutmut_12, ``where`` None), and the sequences carry the prompt's cache salt
# (kills _47, the salt dropped) and, with prompt logprobs, a salt that starts with it
# (kills _53, ``salt and ''``; _54, "XXXX" for none).
# --------------------------------------------------------------------------------------------


def test_bad_params_are_refused_by_the_callers_name() -> None:
    engine = build_engine(CONFIG, spec=False)
    with pytest.raises(TypeError) as info:
        engine.add_request("r", [1, 2], 5)
    assert str(info.value) == (
        "add_request: sampling params must be SamplingParams or a dict, got 5"
    )
    assert not engine.has_unfinished_requests()


def _salts(engine: LLMEngine) -> list[str | None]:
    return [seq.cache_salt for seq in engine.scheduler.waiting]


def test_sequences_carry_the_prompts_cache_salt() -> None:
    engine = build_engine(CONFIG, spec=False)
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3], "cache_salt": "s"}, SamplingParams(n=2))
    assert _salts(engine) == ["s", "s"]


@pytest.mark.parametrize("salt", [None, "s"])
def test_a_prompt_logprobs_salt_starts_with_the_prompts_salt(salt: str | None) -> None:
    engine = build_engine(CONFIG, spec=False)
    prompt: dict[str, object] = {"prompt_token_ids": [1, 2, 3]}
    if salt is not None:
        prompt["cache_salt"] = salt
    engine.add_request("r", prompt, SamplingParams(n=2, prompt_logprobs=0))
    first, second = _salts(engine)
    assert first is not None
    assert first.startswith(f"{salt or ''}\x00prompt_logprobs\x00r\x00")
    # Completion 0 alone computes the prompt's rows; the other shares its blocks.
    assert second == first
    params = [seq.sampling_params.prompt_logprobs for seq in engine.scheduler.waiting]
    assert params == [0, None]


# --------------------------------------------------------------------------------------------
# Which completions get an incremental detokenizer: only with a tokenizer, detokenize on,
# and streaming (add_request) or stop strings. Kills _build__mutmut_67 (``... or (stream
# or stop)``), _68 (``has_tok or ...``), _84 (always one), generate__mutmut_46
# (generate's requests built as streams). _73 (skip_special_tokens None) is killed by the
# detokenizer keeping the request's choice.
# --------------------------------------------------------------------------------------------


class Recording(LLMEngine):
    """Keeps every request it queues, so a test can look at it after generate()."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Request] = []

    def _enqueue(self, request: Request) -> None:
        self.seen.append(request)
        super()._enqueue(request)


def _recording(tokenizer: FakeTokenizer | None) -> Recording:
    engine = build_engine(CONFIG, spec=False, tokenizer=tokenizer, engine_cls=Recording)
    assert isinstance(engine, Recording)
    return engine


@pytest.mark.parametrize(
    ("tokenizer", "params", "stream", "expected"),
    [
        (True, SamplingParams(max_tokens=2), True, True),
        (True, SamplingParams(max_tokens=2, detokenize=False), True, False),
        (False, SamplingParams(max_tokens=2), True, False),
        (True, SamplingParams(max_tokens=2), False, False),
        (True, SamplingParams(max_tokens=2, stop=["<9>"]), False, True),
    ],
    ids=["stream", "stream-no-detokenize", "stream-no-tokenizer", "generate", "generate-stop"],
)
def test_only_streams_and_stop_strings_get_an_incremental_detokenizer(
    tokenizer: bool, params: SamplingParams, stream: bool, expected: bool
) -> None:
    engine = _recording(FakeTokenizer() if tokenizer else None)
    if stream:
        engine.add_request("r", [1, 2, 3], params)
    else:
        engine.generate([[1, 2, 3]], params, use_tqdm=False)
    (request,) = engine.seen
    assert [c.detokenizer is not None for c in request.completions] == [expected]


@pytest.mark.parametrize("skip", [True, False])
def test_the_detokenizer_keeps_the_requests_skip_special_tokens(skip: bool) -> None:
    engine = _recording(FakeTokenizer())
    engine.add_request("r", [1, 2, 3], SamplingParams(skip_special_tokens=skip))
    (completion,) = engine.seen[0].completions
    assert completion.detokenizer is not None
    assert completion.detokenizer.skip_special_tokens is skip


# --------------------------------------------------------------------------------------------
# step() after a postprocess that raised halfway: the sequences it committed are still
# news for the next step() (kills _step__mutmut_16, `stage_step(seqs, tokens, None)`: their
# results recorded with report_running None).
# --------------------------------------------------------------------------------------------


class FailOnce(Scheduler):
    """Raises in the stop check of one chosen sequence, once (after the sequences before it
    in the batch have committed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_seq: Sequence | None = None

    def _stops(self, seq: Sequence, token: int) -> bool:
        if seq is self.fail_seq:
            self.fail_seq = None
            raise RuntimeError("injected in postprocess")
        return super()._stops(seq, token)


def test_a_failed_steps_committed_tokens_are_reported_by_the_next_step() -> None:
    engine = build_engine(CONFIG, spec=False, scheduler_cls=FailOnce)
    sched: Any = engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [2, 3, 4], params)
    assert sorted(o.request_id for o in engine.step()) == ["a", "b"]  # the prefill
    a, b = list(sched.running)  # decoded in this order
    sched.fail_seq = b
    with pytest.raises(RuntimeError, match="injected in postprocess"):
        engine.step()  # a commits its second token; b is preempted
    assert (a.num_completion_tokens, b.num_completion_tokens) == (2, 1)
    # The next step is b's prefill alone; a's second token is still news.
    outs = {o.request_id: o for o in engine.step()}
    assert sorted(outs) == ["a", "b"]
    assert len(outs["a"].outputs[0].token_ids) == 2


def test_a_reused_request_id_with_prompt_logprobs_never_hits_the_cache() -> None:
    """Kills ``_build__mutmut_55`` (the salt without its unique part) and pins the bug it
    exposed: the salt used ``id(parsed)``, an address CPython reuses, so a request id
    reused after its request finished could get an earlier request's salt and skip
    computing the cached prompt rows (6 of 200 in one run)."""
    engine = build_engine(CONFIG, spec=False)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    cached, salts = [], set()
    for _ in range(200):
        engine.add_request("r", PROMPT, params)
        salts.add(engine.scheduler.waiting[0].cache_salt)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        cached.append(outs[-1].num_cached_tokens)
    assert set(cached) == {0}
    assert len(salts) == 200
