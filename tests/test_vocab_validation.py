"""The validation boundary that knows the model (``engine/inputs.check_request``): every token
id a request names within the vocabulary, ``n`` within ``EngineConfig.max_n``, the stop
strings, ``bad_words`` and ``logit_bias`` within their bounds; each refusal an
``InvalidRequestError`` naming the field, raised before anything is queued.

Both halves of the contract, for every row: the structured error (type, ``field``,
``where``, message), and the engine exactly as it was: the same queues, requests and
allocator state, no ``Sequence`` built, the request in flight finishing with the tokens
it gets in a twin engine that never saw the refusal, and a later ``generate`` equal to a
fresh engine's. Through the real model (where the old code failed inside the step):
tests/test_vocab_sampling.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.inputs import check_request
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request_limits import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from paged_engine.engine.sequence import Sequence
from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeTokenizer

pytestmark = pytest.mark.timeout(120)  # an unbounded n=10**12 would hang, not fail

CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=40,
    kvcache_block_size=4,
    num_kvcache_blocks=16,
    max_n=4,
)
BUSY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = dict(temperature=1.0, max_tokens=4)

# (params, with a tokenizer, field, words of the message)
ROWS: list[tuple[dict[str, Any], bool, str, str]] = [
    ({"logit_bias": {VOCAB: 1.0}}, True, "logit_bias", rf"names token {VOCAB}, outside the vo"),
    ({"logit_bias": {1: 1.0, VOCAB + 7: -1.0}}, True, "logit_bias", f"names token {VOCAB + 7}"),
    ({"allowed_token_ids": [0, VOCAB]}, True, "allowed_token_ids", f"names token {VOCAB},"),
    ({"stop_token_ids": [2, VOCAB, 1]}, True, "stop_token_ids", f"names token {VOCAB},"),
    ({**SAMPLED, "n": 5}, True, "n", r"n=5 is more than the 4 allowed \(max_n\)"),
    ({**SAMPLED, "n": 10**12}, True, "n", "is more than the 4 allowed"),
    (
        {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
        True,
        "stop",
        f"stop has {MAX_STOP_STRINGS + 1} strings, more than the {MAX_STOP_STRINGS} allowed",
    ),
    (
        {"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]},
        True,
        "stop",
        f"a string of {MAX_STOP_STRING_CHARS + 1} characters, more than the",
    ),
    (
        {"logit_bias": {t: 0.5 for t in range(MAX_LOGIT_BIAS + 1)}},
        True,
        "logit_bias",
        f"logit_bias has {MAX_LOGIT_BIAS + 1} entries, more than the {MAX_LOGIT_BIAS} allowed",
    ),
    ({"bad_words": ["x"]}, False, "bad_words", "bad_words need a tokenizer"),
    (
        {"bad_words": [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]},
        False,
        "bad_words",
        f"bad_words has {MAX_BAD_WORDS + 1} strings, more than the {MAX_BAD_WORDS} allowed",
    ),
    (
        {"bad_words": ["y" * (MAX_BAD_WORD_CHARS + 1)]},
        False,
        "bad_words",
        f"a string of {MAX_BAD_WORD_CHARS + 1} characters",
    ),
]


def _engine(tokenizer: bool) -> LLMEngine:
    return build_engine(CONFIG, spec=False, tokenizer=FakeTokenizer() if tokenizer else None)


def _state(engine: LLMEngine) -> object:
    sched = engine.scheduler
    return (
        engine.block_manager.snapshot(),  # type: ignore[attr-defined]
        [(s.seq_id, list(s.token_ids), s.num_cached_tokens) for s in sched.waiting],
        [(s.seq_id, list(s.token_ids), s.num_cached_tokens) for s in sched.running],
        sorted(engine._requests),
        engine.block_manager.num_free_blocks,
    )


def _finish(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("the engine did not drain")


NEXT = [[1, 2, 3], [4, 4]]


@pytest.mark.parametrize(
    ("values", "tokenizer", "field", "match"), ROWS, ids=[f"{r[2]}-{r[3][:24]}" for r in ROWS]
)
def test_a_request_beyond_the_model_is_refused_and_changes_nothing(
    values: dict[str, Any], tokenizer: bool, field: str, match: str
) -> None:
    engine, twin = _engine(tokenizer), _engine(tokenizer)
    for e in (engine, twin):
        e.add_request("busy", [4, 3, 2, 1, 1], BUSY)
        e.step()
    before = _state(engine)
    first_id = Sequence([1]).seq_id
    with pytest.raises(InvalidRequestError, match=f"^add_request: .*{match}") as refused:
        engine.add_request("bad", [1, 2], SamplingParams(**values))
    assert refused.value.field == field and refused.value.where == "add_request"
    assert Sequence([1]).seq_id == first_id + 1  # no sequence was built for it
    assert _state(engine) == before
    assert _finish(engine) == _finish(twin)  # "busy", with the same tokens
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks
    fresh = _engine(tokenizer)
    want = [o.outputs[0].token_ids for o in fresh.generate(NEXT, BUSY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in engine.generate(NEXT, BUSY, use_tqdm=False)] == want


@pytest.mark.parametrize(
    ("values", "tokenizer", "field", "match"), ROWS, ids=[f"{r[2]}-{r[3][:24]}" for r in ROWS]
)
def test_generate_refuses_the_batch_before_queuing_any(
    values: dict[str, Any], tokenizer: bool, field: str, match: str
) -> None:
    engine = _engine(tokenizer)
    params = [BUSY, SamplingParams(**values), BUSY]
    with pytest.raises(InvalidRequestError, match=f"^prompt 1: .*{match}") as refused:
        engine.generate([[1, 2], [2, 3], [3, 4]], params, use_tqdm=False)
    assert refused.value.field == field and refused.value.where == "prompt 1"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == CONFIG.num_kvcache_blocks
    assert engine.scheduler.is_finished()


def test_the_bounds_themselves_are_accepted() -> None:
    ok = [
        {"logit_bias": {VOCAB - 1: 1.0, 0: -1.0}},
        {"allowed_token_ids": list(range(VOCAB))},
        {"stop_token_ids": [VOCAB - 1]},
        {**SAMPLED, "n": CONFIG.max_n},
        {"stop": ["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
    ]
    for values in ok:
        params = SamplingParams(**values)
        assert (
            check_request([1], params, CONFIG, 16, "w", has_tokenizer=True, vocab_size=VOCAB)
            is params
        )
    # a bias of exactly MAX_LOGIT_BIAS entries, over a vocabulary that holds them
    bias = SamplingParams(logit_bias={t: 0.5 for t in range(MAX_LOGIT_BIAS)})
    check_request([1], bias, CONFIG, 16, "w", has_tokenizer=False, vocab_size=MAX_LOGIT_BIAS)
    with pytest.raises(InvalidRequestError, match=f"names token {MAX_LOGIT_BIAS - 1}"):
        check_request(
            [1], bias, CONFIG, 16, "w", has_tokenizer=False, vocab_size=MAX_LOGIT_BIAS - 1
        )


def test_n_is_bounded_by_the_engines_config() -> None:
    wide = EngineConfig(**{**_config_fields(), "max_n": 300})
    params = SamplingParams(temperature=1.0, max_tokens=2, n=300)
    check_request([1], params, wide, 16, "w", has_tokenizer=False, vocab_size=VOCAB)
    with pytest.raises(InvalidRequestError, match="n=300 is more than the 128 allowed") as refused:
        check_request([1], params, EngineConfig(), 16, "w", has_tokenizer=False)
    assert refused.value.field == "n"


def _config_fields() -> dict[str, Any]:
    return {
        "max_num_batched_tokens": CONFIG.max_num_batched_tokens,
        "max_model_len": CONFIG.max_model_len,
        "kvcache_block_size": CONFIG.kvcache_block_size,
        "num_kvcache_blocks": CONFIG.num_kvcache_blocks,
    }


# (values, exception type, field): refused by SamplingParams itself, before any model
PARAM_ROWS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"allowed_token_ids": []}, InvalidRequestError, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, InvalidRequestError, "allowed_token_ids"),
    ({"allowed_token_ids": "12"}, InvalidRequestTypeError, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, InvalidRequestTypeError, "allowed_token_ids"),
    ({"bad_words": [" "]}, InvalidRequestError, "bad_words"),
    ({"bad_words": ["ok", ""]}, InvalidRequestError, "bad_words"),
    ({"bad_words": 5}, InvalidRequestTypeError, "bad_words"),
    ({"bad_words": ["ok", 5]}, InvalidRequestTypeError, "bad_words"),
    ({"bad_words_token_ids": [[1], []]}, InvalidRequestError, "bad_words_token_ids"),
    ({"bad_words_token_ids": [[1, -2]]}, InvalidRequestError, "bad_words_token_ids"),
    ({"bad_words_token_ids": "ab"}, InvalidRequestTypeError, "bad_words_token_ids"),
]


@pytest.mark.parametrize(
    ("values", "exc", "field"), PARAM_ROWS, ids=[repr(r[0])[:40] for r in PARAM_ROWS]
)
def test_the_new_fields_are_refused_by_name(
    values: dict[str, Any], exc: type[Exception], field: str
) -> None:
    with pytest.raises(exc, match=field) as refused:
        SamplingParams(**values)
    assert type(refused.value) is exc and refused.value.field == field  # type: ignore[attr-defined]
    engine = _engine(True)
    with pytest.raises(exc) as again:
        engine.add_request("bad", [1], values)  # a dict of params, through from_dict
    assert again.value.field == field  # type: ignore[attr-defined]
    assert not engine.has_unfinished_requests()


def test_the_new_fields_normalise_as_vllm() -> None:
    p = SamplingParams(allowed_token_ids=[3, 1, 3], bad_words="hello")
    assert p.allowed_token_ids == (3, 1) and p.bad_words == ("hello",)
    assert SamplingParams(bad_words=None).bad_words == ()
    assert SamplingParams(bad_words_token_ids=[[2, 2], [1]]).bad_words_token_ids == ((2, 2), (1,))
