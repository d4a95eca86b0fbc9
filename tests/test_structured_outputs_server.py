"""Structured outputs through the server and the ``openai`` client: ``response_format``
(``json_schema``, ``json_object``) on both routes, vLLM's ``guided_*`` and
``structured_outputs`` extra fields, and refusals that name the body's field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tests.test_server_support import MODEL, TEMPLATE, Live, live_server  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[openai.OpenAI]:
    live: Live
    with live_server(tiny_model_dir, chat_template=TEMPLATE) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=30, max_retries=0)


def valid(text: str | None, finish_reason: str | None) -> dict[str, Any]:
    assert finish_reason == "stop" and text is not None, (finish_reason, text)
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    assert isinstance(doc, dict)
    return doc


def test_chat_json_schema_outputs_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city."}],
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=1.0,
        seed=1,
        n=3,
    )
    assert len(r.choices) == 3
    for c in r.choices:
        valid(c.message.content, c.finish_reason)


def test_completions_json_schema_and_json_object(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=["The quick brown fox", "Call me Ishmael."],
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": RESPONSE_FORMAT},
    )
    for c in r.choices:
        valid(c.text, c.finish_reason)
    r = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = r.choices[0].text
    assert text.startswith("{")  # an object, whole or cut by max_tokens
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllms_extra_fields(client: openai.OpenAI) -> None:
    for extra, check in (
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"\d{3}-\d{2}"}, lambda t: re.fullmatch(r"\d{3}-\d{2}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ):
        r = client.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=20, temperature=1.0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), extra


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    body = e.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
