"""Every validation branch has a row that fails when the branch is removed.

Tables, one per file: ``EngineConfig`` (paged_engine/config.py), the ``SamplingParams``
refusals tests/test_sampling.py's table does not pin to their own message
(paged_engine/sampling_params.py), prompts and requests (paged_engine/engine/inputs.py)
and ``Sequence`` (paged_engine/engine/sequence.py). Each row is a bad value, the exception
type, and the words of *that* branch's message: where a later check would also refuse the
value (``stop_token_ids="12"`` fails as a string and again as non-int tokens), only the
message tells the branches apart. Both halves of the contract: the refusal (an
``errors.InvalidRequestError`` carrying the row's field and place), and nothing
changed (no ``Sequence`` id consumed; an engine with a request in flight has the same
queues, requests and allocator state, and still finishes that request).

Shown to bite by a sweep that deleted each ``if ...: raise`` of those files in turn (and
each operand of an ``or``, each link of a chained comparison) and ran this file with
tests/test_sampling.py, test_allocator_examples.py, test_cache_salt.py, test_engine.py
and test_api_engine.py: every mutant fails them (86 of 87) but one branch shown unreachable
(tests/equivalent_mutants.md). (The ``SamplingParams`` branches not listed here are killed by
test_sampling.py's table.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.inputs import check_request, parse_params, parse_prompt
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.sequence import Sequence
from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError
from paged_engine.sampling_params import SamplingParams
from tests.engine_machine import VOCAB, build_engine
from tests.fake_model import FakeTokenizer

# ---- EngineConfig -----------------------------------------------------------------------------

COUNTS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "kvcache_block_size",
    "num_kvcache_blocks",
    "kv_cache_memory",
    "num_threads",
)
CONFIG_ROWS: list[tuple[str, object, str]] = [
    *[
        (name, value, rf"{name} must be an int >= 1, got {value!r}")
        for name in COUNTS
        for value in (0, -3, True, 2.0, "8")
    ],
    ("enable_prefix_caching", 1, "enable_prefix_caching must be a bool, got 1"),
    ("enable_prefix_caching", None, "enable_prefix_caching must be a bool"),
    ("prefix_cache_hash", "md5", r"prefix_cache_hash must be one of \('xxh64', 'sha256'\)"),
    ("attention_backend", "flash", "attention_backend must be one of"),
    ("dtype", "fp8", "dtype must be one of"),
    ("device", "", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got ''"),
    ("device", 0, "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 0"),
    ("device", 5, "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 5"),  # truthy
    *[
        ("gpu_memory_utilization", g, rf"gpu_memory_utilization must be in \(0, 1\], got {g!r}")
        for g in (1.01, 1.5, 2, 0, 0.0, -0.1, math.nan, math.inf, True, "0.5", None)
    ],
    ("seed", 1.5, "seed must be an int, got 1.5"),
    ("seed", True, "seed must be an int, got True"),
    ("seed", "3", "seed must be an int, got '3'"),
]


@pytest.mark.parametrize(
    ("name", "value", "match"), CONFIG_ROWS, ids=[f"{r[0]}={r[1]!r}" for r in CONFIG_ROWS]
)
def test_engine_config_refuses(name: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{name: value})  # type: ignore[arg-type]


def test_engine_config_keeps_the_boundary_values() -> None:
    cfg = EngineConfig(
        max_num_batched_tokens=1,
        max_num_seqs=1,
        max_model_len=1,
        kvcache_block_size=1,
        num_kvcache_blocks=1,
        kv_cache_memory=1,
        gpu_memory_utilization=1,  # the upper bound is included
        seed=-(2**70),
        num_threads=1,
        device="cuda:3",
    )
    assert (cfg.gpu_memory_utilization, cfg.num_kvcache_blocks, cfg.seed) == (1, 1, -(2**70))
    assert EngineConfig(gpu_memory_utilization=1e-9).gpu_memory_utilization == 1e-9
    assert EngineConfig(num_kvcache_blocks=None, kv_cache_memory=None, num_threads=None)


# ---- SamplingParams ---------------------------------------------------------------------------

PARAM_ROWS: list[tuple[dict[str, Any], type[Exception], str]] = [
    # the finite check, not the sign check after it
    *[
        ({"temperature": t}, ValueError, rf"temperature must be finite, got {t!r}")
        for t in (math.inf, -math.inf, math.nan, 10**400)
    ],
    ({"top_p": math.inf}, ValueError, "top_p must be finite"),
    ({"repetition_penalty": math.nan}, ValueError, "repetition_penalty must be finite"),
    # not a sequence of ids, although iterable (a string's characters, bytes' ints, keys)
    ({"stop_token_ids": "12"}, TypeError, "stop_token_ids must be a sequence of ints, got '12'"),
    ({"stop_token_ids": b"\x01"}, TypeError, "stop_token_ids must be a sequence of ints"),
    ({"stop_token_ids": {1: 2}}, TypeError, "stop_token_ids must be a sequence of ints"),
    ({"output_kind": "delta"}, TypeError, "output_kind must be a RequestOutputKind"),
    ({"output_kind": 1}, TypeError, "output_kind must be a RequestOutputKind"),
    # check_request repeats this one for requests built another way (equivalent_mutants.md)
    ({"stop": "x", "detokenize": False}, ValueError, "stop strings need detokenize=True"),
]


@pytest.mark.parametrize(
    ("values", "exc", "match"), PARAM_ROWS, ids=[repr(r[0])[:40] for r in PARAM_ROWS]
)
def test_sampling_params_refuse(values: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match) as refused:
        SamplingParams(**values)
    _check_structured(refused.value, exc, next(iter(values)), "")


def test_stop_strings_without_detokenize_never_reach_a_request() -> None:
    """Why ``check_request``'s own stop/detokenize check is unreachable (listed in
    tests/equivalent_mutants.md): no ``SamplingParams`` that ``parse_params`` hands on
    can hold the pair, even when the caller set it after construction."""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop="x", detokenize=False)
    params = SamplingParams(stop="x")
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        dataclasses.replace(params, detokenize=False)
    params.detokenize = False  # mutable, as vLLM's: checked when the request is added
    with pytest.raises(InvalidRequestError, match="prompt 2: stop strings need detokenize"):
        parse_params(params, "prompt 2")
    assert params.detokenize is False and params.stop == ("x",)  # the caller's, untouched


# ---- prompts and requests (engine/inputs.py) ----------------------------------------------------

CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=40,
    kvcache_block_size=4,
    num_kvcache_blocks=6,  # 24 slots: fewer than max_model_len needs
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

PROMPT_ROWS: list[tuple[object, bool, type[Exception], str, str]] = [
    # (prompt, with a tokenizer, exception, message, field)
    (
        {"prompt": "<1>", "bogus": 1},
        True,
        TypeError,
        r"unknown prompt key\(s\) \['bogus'\]",
        "prompt",
    ),
    (
        {"prompt_token_ids": [1], "cache_salt": 3},
        True,
        TypeError,
        "cache_salt must be a string",
        "cache_salt",
    ),
    (
        {"prompt_token_ids": [1], "prompt": 5},
        True,
        TypeError,
        "prompt must be a string, got 5",
        "prompt",
    ),
    (
        {"prompt_token_ids": "12"},
        True,
        TypeError,
        "prompt_token_ids must be a list of ints",
        "prompt_token_ids",
    ),
    (
        {"prompt_token_ids": 3},
        True,
        TypeError,
        "prompt_token_ids must be a list of ints",
        "prompt_token_ids",
    ),
    ({"prompt": 5}, True, TypeError, "prompt must be a string, got 5", "prompt"),
    ({"prompt": [1, 2]}, True, TypeError, r"prompt must be a string, got \[1, 2\]", "prompt"),
    (
        {"cache_salt": "s"},
        True,
        TypeError,
        "a prompt dict needs 'prompt' or 'prompt_token_ids'",
        "prompt",
    ),
    ("<1><2>", False, TypeError, "a text prompt needs a tokenizer; pass token ids", "prompt"),
    ({"prompt": "<1>"}, False, TypeError, "a text prompt needs a tokenizer", "prompt"),
    (
        42,
        True,
        TypeError,
        "a prompt is a string, a list of token ids or a prompt dict, got int",
        "prompt",
    ),
    ([], True, ValueError, "the prompt is empty", "prompt"),
    ({"prompt_token_ids": []}, True, ValueError, "the prompt is empty", "prompt_token_ids"),
    ([1, "2"], True, TypeError, "token 1 is '2', not an int", "prompt"),
    ([1, True], True, TypeError, "token 1 is True, not an int", "prompt"),
    ([1, 1.0], True, TypeError, "token 1 is 1.0, not an int", "prompt"),
    (
        [1, VOCAB],
        True,
        ValueError,
        rf"token 1 is {VOCAB}, outside the vocabulary \[0, {VOCAB}\)",
        "prompt",
    ),
    ([-1], True, ValueError, "token 0 is -1, outside the vocabulary", "prompt"),
    (
        {"prompt_token_ids": [1, VOCAB]},
        True,
        ValueError,
        "token 1 is 5, outside",
        "prompt_token_ids",
    ),
]


@pytest.mark.parametrize(
    ("prompt", "tokenizer", "exc", "match", "field"),
    PROMPT_ROWS,
    ids=[repr(r[0]) for r in PROMPT_ROWS],
)
def test_parse_prompt_refuses(
    prompt: object, tokenizer: bool, exc: type[Exception], match: str, field: str
) -> None:
    tok = FakeTokenizer() if tokenizer else None
    with pytest.raises(exc, match=f"^where: .*{match}") as refused:
        parse_prompt(prompt, tok, VOCAB, "where")
    _check_structured(refused.value, exc, field, "where")


def _check_structured(error: BaseException, exc: type[Exception], field: str, where: str) -> None:
    """The refusal carries its field and place (errors.py), as the type the row names."""
    wanted = InvalidRequestTypeError if exc is TypeError else InvalidRequestError
    assert type(error) is wanted, type(error)
    assert (error.field, error.where) == (field, where)  # type: ignore[attr-defined]


def _tokens(n: int) -> list[int]:
    return [i % VOCAB for i in range(n)]


REQUEST_ROWS: list[tuple[list[int], SamplingParams, bool, str, str]] = [
    # (prompt, params, with a tokenizer, message, field)
    (
        _tokens(40),
        SamplingParams(max_tokens=1),
        True,
        r"the prompt \(40 tokens\) leaves no room",
        "prompt",
    ),
    (
        _tokens(41),
        SamplingParams(max_tokens=None),
        True,
        r"the prompt \(41 tokens\) leaves no room",
        "prompt",
    ),
    (
        _tokens(10),
        SamplingParams(max_tokens=31),
        True,
        r"prompt \(10 tokens\) \+ max_tokens \(31\) exceeds max_model_len \(40\)",
        "max_tokens",
    ),
    (
        _tokens(10),
        SamplingParams(max_tokens=20),  # 29 computed tokens: 8 blocks
        True,
        "the request needs 8 KV blocks at full length but the pool has 6",
        "max_tokens",
    ),
    (
        _tokens(3),
        SamplingParams(max_tokens=None),  # up to max_model_len: 39 computed, 10 blocks
        True,
        "the request needs 10 KV blocks at full length but the pool has 6",
        "max_tokens",
    ),
    (
        _tokens(3),
        SamplingParams(logprobs=21),
        True,  # max_logprobs (20) bounds it, or the engine's vocabulary (5) when smaller
        r"logprobs=21 is more than the (20 allowed \(max_logprobs|5 allowed \(the vocab)",
        "logprobs",
    ),
    (
        _tokens(3),
        SamplingParams(prompt_logprobs=21),
        True,
        "prompt_logprobs=21 is more than",
        "prompt_logprobs",
    ),
    (_tokens(3), SamplingParams(stop="x"), False, "stop strings need a tokenizer", "stop"),
]


@pytest.mark.parametrize(
    ("prompt", "params", "tokenizer", "match", "field"),
    REQUEST_ROWS,
    ids=[r[3][:30] for r in REQUEST_ROWS],
)
def test_check_request_refuses(
    prompt: list[int], params: SamplingParams, tokenizer: bool, match: str, field: str
) -> None:
    with pytest.raises(ValueError, match=f"^where: {match}") as refused:
        check_request(prompt, params, CONFIG, 6, "where", has_tokenizer=tokenizer)
    _check_structured(refused.value, ValueError, field, "where")


def test_check_request_accepts_the_limits() -> None:
    check_request(_tokens(39), SamplingParams(max_tokens=1), CONFIG, 10, "w", has_tokenizer=False)
    # 10 + 14 tokens, the last never computed: 23 slots, 6 blocks: exactly the pool
    check_request(_tokens(10), SamplingParams(max_tokens=14), CONFIG, 6, "w", has_tokenizer=False)
    check_request(_tokens(3), SamplingParams(logprobs=20), CONFIG, 6, "w", has_tokenizer=False)


@pytest.mark.parametrize(
    ("params", "match", "field", "where"),
    [
        (
            "greedy",
            "where: sampling params must be SamplingParams or a dict",
            "sampling_params",
            "where",
        ),
        (
            0.5,
            "where: sampling params must be SamplingParams or a dict",
            "sampling_params",
            "where",
        ),
        (
            {"temprature": 0.5},  # built at admission: the refusal names the request too
            r"where: unknown sampling parameter\(s\) \['temprature'\]",
            "temprature",
            "where",
        ),
    ],
)
def test_parse_params_refuses(params: object, match: str, field: str, where: str) -> None:
    with pytest.raises(TypeError, match=match) as refused:
        parse_params(params, "where")
    _check_structured(refused.value, TypeError, field, where)


def _engine(tokenizer: bool) -> LLMEngine:
    return build_engine(CONFIG, spec=False, tokenizer=FakeTokenizer() if tokenizer else None)


def _state(engine: LLMEngine) -> object:
    sched = engine.scheduler
    return (
        engine.block_manager.snapshot(),  # type: ignore[attr-defined]
        [(s.seq_id, list(s.token_ids), s.num_cached_tokens) for s in sched.waiting],
        [(s.seq_id, list(s.token_ids), s.num_cached_tokens) for s in sched.running],
        sorted(engine._requests),
    )


ENGINE_ROWS = [(p, None, t, e, m, f) for p, t, e, m, f in PROMPT_ROWS] + [
    (p, sp, t, ValueError, m, f) for p, sp, t, m, f in REQUEST_ROWS
]


@pytest.mark.parametrize(
    ("prompt", "params", "tokenizer", "exc", "match", "field"),
    ENGINE_ROWS,
    ids=[f"{r[3].__name__}-{r[4][:30]}" for r in ENGINE_ROWS],
)
def test_a_refused_request_leaves_the_engine_as_it_was(
    prompt: object,
    params: SamplingParams | None,
    tokenizer: bool,
    exc: type[Exception],
    match: str,
    field: str,
) -> None:
    engine = _engine(tokenizer)
    engine.add_request("busy", [4, 4, 4, 4, 4], GREEDY)
    engine.step()
    before = _state(engine)
    with pytest.raises(exc, match=f"add_request: .*{match}") as refused:
        engine.add_request("bad", prompt, params or GREEDY)
    _check_structured(refused.value, exc, field, "add_request")
    assert _state(engine) == before
    finals = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["busy"]
    assert len(finals[0].outputs[0].token_ids) == GREEDY.max_tokens
    assert engine.block_manager.num_free_blocks == 6


# ---- Sequence ---------------------------------------------------------------------------------

SEQUENCE_ROWS: list[tuple[dict[str, Any], type[Exception], str]] = [
    *[
        (
            {"token_ids": [1], "block_size": bs},
            ValueError,
            rf"block_size must be an int >= 1, got {bs!r}",
        )
        for bs in (0, -1, True, 2.0, "4")
    ],
    ({"token_ids": []}, ValueError, "a sequence needs at least one token"),
    ({"token_ids": [1, 2.0]}, TypeError, r"token ids must be ints, got 2.0"),
    ({"token_ids": [1, True]}, TypeError, r"token ids must be ints, got True"),
    ({"token_ids": [1, "2"]}, TypeError, r"token ids must be ints, got '2'"),
    # the int64 bound: R4 packs each token as an int64
    ({"token_ids": [1, 2**63]}, ValueError, rf"token ids must be in \[0, 2\*\*63\), got {2**63}"),
    ({"token_ids": [2**64 + 5]}, ValueError, r"token ids must be in \[0, 2\*\*63\)"),
    ({"token_ids": [3, -1]}, ValueError, r"token ids must be in \[0, 2\*\*63\), got -1"),
    ({"token_ids": [1], "cache_salt": 3}, TypeError, "cache_salt must be a str or None, got int"),
    ({"token_ids": [1], "cache_salt": b"s"}, TypeError, "cache_salt must be a str or None"),
    ({"token_ids": [1], "cache_salt": ""}, ValueError, "cache_salt must be a non-empty string"),
]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"), SEQUENCE_ROWS, ids=[repr(r[0])[:40] for r in SEQUENCE_ROWS]
)
def test_sequence_refuses_and_takes_no_id(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    before = Sequence([1]).seq_id
    with pytest.raises(exc, match=match):
        Sequence(**kwargs)
    assert Sequence([1]).seq_id == before + 1  # the refused sequence consumed no id


def test_sequence_keeps_the_int64_extremes() -> None:
    seq = Sequence([0, 2**63 - 1], block_size=1, cache_salt="a")
    assert seq.token_ids == [0, 2**63 - 1] and seq.cache_salt == "a"
