"""The server side of the validation boundary: vLLM's ``allowed_token_ids`` and ``bad_words``
on the wire, every refusal that knows the model a 400 naming the field (and queuing
nothing), and the structured errors mapped to their field without reading messages
(``serving.param_of``, ``cli_args.flag_message``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.engine.request_limits import MAX_BAD_WORDS, MAX_STOP_STRINGS
from paged_engine.entrypoints.cli_args import flag_message
from paged_engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from paged_engine.entrypoints.serving import RequestError, param_of, sampling_params
from paged_engine.errors import InvalidRequestError, InvalidRequestTypeError
from tests.test_server import check_bad_request
from tests.test_server_support import ENGINE, MODEL, TEMPLATE, Live, live_server

pytestmark = pytest.mark.timeout(120)
VOCAB = 768  # the tiny model's (tests/test_vocab_sampling.py reads it from the model)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir, chat_template=TEMPLATE) as server:
        assert server.engine.vocab_size == VOCAB
        yield server


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


BAD: list[tuple[dict[str, Any], str]] = [
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"3": 1, str(VOCAB + 40): -1}}, "logit_bias"),
    ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"n": 129, "temperature": 1.0}, "n"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[f"{r[1]}-{str(r[0])[:30]}" for r in BAD])
def test_a_completion_beyond_the_model_is_a_400_naming_the_field(
    live: Live, fields: dict[str, Any], param: str
) -> None:
    check_bad_request(live, "completions", _body(**fields), param, None)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ],
)
def test_a_chat_beyond_the_model_is_a_400_naming_the_field(
    live: Live, fields: dict[str, Any], param: str
) -> None:
    check_bad_request(
        live, "chat/completions", json.dumps({**CHAT, **fields}).encode(), param, None
    )


def test_allowed_token_ids_reach_the_engine_as_offline(live: Live, tiny_model_dir: Path) -> None:
    allowed = [40, 77, 130, 131, 250]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", timeout=30, max_retries=0)
    got = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=10,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True},
    )
    ids = (got.choices[0].model_extra or {})["token_ids"]
    offline = LLM(tiny_model_dir, **ENGINE)
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed
    )
    want = offline.generate([5, 6, 7], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ids == want and set(ids) <= set(allowed)


# -------------------------------------------------------------- the request models, unit


def test_both_routes_carry_the_new_fields_into_sampling_params() -> None:
    comp = CompletionRequest(model=MODEL, prompt="hi", allowed_token_ids=[3, 1], bad_words=["x"])
    chat = ChatCompletionRequest.model_validate(
        {**CHAT, "allowed_token_ids": [2], "bad_words": ["y", "z"]}
    )
    for req, allowed, words in ((comp, (3, 1), ("x",)), (chat, (2,), ("y", "z"))):
        p = sampling_params(req, max_tokens=4, logprobs=None, rename={})
        assert (p.allowed_token_ids, p.bad_words) == (allowed, words)
    plain = sampling_params(
        CompletionRequest(model=MODEL, prompt="hi"), max_tokens=4, logprobs=None, rename={}
    )
    assert (plain.allowed_token_ids, plain.bad_words) == (None, ())


def test_a_refusal_by_sampling_params_names_its_field_through_the_rename() -> None:
    req = ChatCompletionRequest.model_validate({**CHAT, "allowed_token_ids": []})
    with pytest.raises(RequestError) as info:
        sampling_params(req, max_tokens=4, logprobs=None, rename={"prompt": "messages"})
    assert info.value.param == "allowed_token_ids" and info.value.status == 400


# ------------------------------------------------------------- errors mapped by their field


def test_param_of_reads_the_field_not_the_message() -> None:
    # a message that names another field first: only .field tells them apart
    err = InvalidRequestError(
        "max_tokens", "prompt (3 tokens) + max_tokens (9) exceeds ...", "add_request"
    )
    assert param_of(err) == "max_tokens"
    assert param_of(InvalidRequestError("n", "logit_bias and top_k are fine; n is not")) == "n"
    rename = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    assert param_of(err, rename) == "max_completion_tokens"
    assert (
        param_of(InvalidRequestError("prompt_token_ids", "token 1 is 9, outside"), rename)
        == "messages"
    )
    assert param_of(InvalidRequestTypeError("prompt", "a prompt is a string"), {}) == "prompt"
    # a bare message (an error that carries no field) is still read as before
    assert param_of("logprobs=21 is more than the 20 allowed") == "logprobs"
    assert param_of(ValueError("something else")) == "prompt"


def test_flag_message_swaps_the_errors_own_field() -> None:
    assert flag_message(InvalidRequestError("max_tokens", "max_tokens must be >= 1")) == (
        "--max-tokens must be >= 1"
    )
    # a one-word field is swapped where it is the error's own, even inside the message
    err = InvalidRequestError("temperature", "prompt 0: a temperature of -1 is below 0")
    assert flag_message(err) == "prompt 0: a --temperature of -1 is below 0"
    assert flag_message("a temperature of -1") == "a temperature of -1"  # a bare message
    assert flag_message("temperature must be >= 0") == "--temperature must be >= 0"
    assert flag_message(InvalidRequestError("n", "seed and device stay as words")) == (
        "seed and device stay as words"
    )
