"""What each route asks of the engine (entrypoints/openai_requests.py), without a server:
the route's own refusals name the body's field, and the prepared work carries the ids,
the parameters, the prompts and the renames the shared serving path relies on."""

from __future__ import annotations

from typing import Any

import pytest

from paged_engine.entrypoints.openai_requests import (
    check_model,
    prepare_chat,
    prepare_completion,
)
from paged_engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from paged_engine.entrypoints.serving import RequestError
from paged_engine.sampling_params import RequestOutputKind


class Tokenizer:
    chat_template = "{{ messages }}"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        return [len(m["content"]) for m in messages]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hello"}], **fields}
    )


def refusal(call: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        call()
    return info.value


def test_an_unknown_model_is_a_404_naming_model() -> None:
    e = refusal(lambda: check_model("other", "m"))
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    check_model("m", "m")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x" * 11}, "prompt"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_a_completion_refusal_names_its_field(fields: dict[str, Any], param: str) -> None:
    body = completion(**fields)
    e = refusal(lambda: prepare_completion(body, tokenizer=None, max_prompt_chars=10, created=0))
    assert (e.status, e.param) == (400, param)


def test_a_completion_is_one_request_per_prompt_with_openais_default_length() -> None:
    body = completion(prompt=["ab", "c"], n=2, stream=True)
    work = prepare_completion(body, tokenizer=Tokenizer(), max_prompt_chars=10, created=7)
    assert len(work.ids) == 2 and work.ids[0].endswith("-0") and work.ids[1].endswith("-1")
    assert work.ids[0].startswith("cmpl-") and work.ids[0][:-2] == work.ids[1][:-2]
    assert (work.params.max_tokens, work.params.n) == (16, 2)
    assert work.params.output_kind is RequestOutputKind.DELTA
    assert work.prepare() == [
        {"prompt": "ab", "prompt_token_ids": [97, 98]},
        {"prompt": "c", "prompt_token_ids": [99]},
    ]
    assert work.rename == {} and work.body is body
    given = prepare_completion(
        completion(max_tokens=None), tokenizer=None, max_prompt_chars=10, created=7
    )
    assert given.params.max_tokens is None  # given as null: up to max_model_len


@pytest.mark.parametrize(
    ("fields", "has_template", "param"),
    [
        ({}, False, "messages"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x" * 11}]}, True, "messages"),
        ({"max_completion_tokens": -1}, True, "max_completion_tokens"),
        ({"max_tokens": -1}, True, "max_tokens"),
    ],
)
def test_a_chat_refusal_names_its_field(
    fields: dict[str, Any], has_template: bool, param: str
) -> None:
    body = chat(**fields)
    e = refusal(
        lambda: prepare_chat(
            body,
            tokenizer=Tokenizer(),
            chat_template=None,
            has_chat_template=has_template,
            max_prompt_chars=10,
            created=0,
        )
    )
    assert (e.status, e.param) == (400, param)


def test_a_chat_is_one_request_whose_errors_use_the_chat_names() -> None:
    body = chat(max_completion_tokens=5, logprobs=True, top_logprobs=3)
    work = prepare_chat(
        body,
        tokenizer=Tokenizer(),
        chat_template=None,
        has_chat_template=True,
        max_prompt_chars=10,
        created=0,
    )
    assert len(work.ids) == 1 and work.ids[0].startswith("chatcmpl-")
    assert (work.params.max_tokens, work.params.logprobs) == (5, 3)
    assert work.params.output_kind is RequestOutputKind.FINAL_ONLY
    assert work.prepare() == [{"prompt_token_ids": [5]}]
    assert work.rename == {
        "prompt": "messages",
        "max_tokens": "max_completion_tokens",
        "logprobs": "top_logprobs",
    }
