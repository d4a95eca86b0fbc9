"""Tool calls read out of text (``entrypoints/tool_calls``): the Hermes format, the forced
shapes of ``required`` and a named function, the request's policy refused by field, and
a streamed choice whose content stops where a call begins, however its text is split."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_engine.entrypoints.serving import RequestError
from paged_engine.entrypoints.tool_calls import ToolPolicy, ToolStream, parse_hermes, tool_policy

WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


def calls_of(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_after_text() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me look.\n"
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    d = calls[0].as_dict()
    assert d["type"] == "function" and d["function"]["name"] == "get_weather"


def test_hermes_edge_cases() -> None:
    assert parse_hermes("no call here") == ("no call here", [])
    unterminated = '<tool_call>{"name": "get_time", "arguments": {}}'
    content, calls = parse_hermes(unterminated)
    assert content is None and calls_of(calls) == [("get_time", {})]
    for broken in (
        '<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3}</tool_call>',  # a name that is no string
    ):
        assert parse_hermes("x " + broken) == ("x " + broken, []), broken


def test_the_policy_is_refused_by_field() -> None:
    auto = "hermes"
    assert tool_policy(None, None, auto) is None
    assert tool_policy(TOOLS, "none", auto) is None
    assert tool_policy(TOOLS, None, auto) == ToolPolicy("auto", (WEATHER, TIME))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert tool_policy(TOOLS, named, None) == ToolPolicy("named", (WEATHER, TIME), "get_time")
    bad: list[tuple[Any, Any, str | None, str, str]] = [
        (TOOLS, "auto", None, "tool_choice", "--enable-auto-tool-choice"),
        (None, "required", auto, "tool_choice", "needs tools"),
        (TOOLS, {"function": {"name": "nope"}}, auto, "tool_choice", "'nope'"),
        (TOOLS, "sometimes", auto, "tool_choice", 'must be "none"'),
        (TOOLS + TOOLS[:1], "auto", auto, "tools", "same name"),
        ([{"type": "function", "function": {}}], "auto", auto, "tools", "needs a name"),
        ([{"type": "retrieval"}], "auto", auto, "tools", "type: function"),
        ([{"function": {"name": "f", "parameters": 3}}], "auto", auto, "tools", "'f'"),
    ]
    for tools, choice, parser, field, words in bad:
        with pytest.raises(RequestError) as e:
            tool_policy(tools, choice, parser)
        assert e.value.param == field and words in e.value.message, (choice, e.value.message)


def test_required_forces_an_array_of_the_tools_calls() -> None:
    policy = tool_policy(TOOLS, "required", None)
    assert policy is not None
    schema = policy.forced_schema()
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["get_weather"], ["get_time"]]
    assert options[0]["properties"]["parameters"] == WEATHER["parameters"]
    assert all(o["required"] == ["name", "parameters"] for o in options)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    content, calls = policy.extract(text)
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Oslo"})]
    assert policy.extract('[{"name": "get_wea') == ('[{"name": "get_wea', [])  # cut short
    assert policy.finish_reason == "tool_calls"
    single = tool_policy(TOOLS, "required", None, parallel=False)
    assert single is not None and single.forced_schema() == dict(schema, maxItems=1)
    two = '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]'
    assert len(policy.extract(two)[1]) == 2 and len(single.extract(two)[1]) == 1


def test_a_named_function_s_output_is_its_arguments() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    policy = tool_policy(TOOLS, named, None)
    assert policy is not None and policy.forced_schema() == WEATHER["parameters"]
    content, calls = policy.extract('{"city": "Rome"}')
    assert content is None and calls_of(calls) == [("get_weather", {"city": "Rome"})]
    assert policy.extract('{"city": "Ro') == ('{"city": "Ro', [])
    assert policy.finish_reason == "stop"
    assert ToolPolicy("auto", (WEATHER,)).forced_schema() is None


TEXTS = [
    "plain words, <tool_ but no call",
    'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call>',
    "<tool_call>{broken</tool_call> after",
    "ends with <tool_c",
]


@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 80), max_size=6))
def test_a_streamed_choice_sends_its_content_and_holds_its_calls(
    text: str, cuts: list[int]
) -> None:
    """Whatever the pieces, the content sent is the whole text's content, no character of
    a call is sent as content, and the calls are the whole text's."""
    stream = ToolStream(ToolPolicy("auto", (WEATHER, TIME)))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    sent = "".join(stream.add(p) for p in pieces[:-1])
    want_content, want_calls = parse_hermes(text)
    if want_calls:
        assert "<tool_call>" not in sent and sent == (want_content or "")[: len(sent)]
    rest, calls = stream.finish(pieces[-1])
    assert sent + rest == ((want_content or "") if want_calls else text)
    assert calls_of(calls) == calls_of(want_calls)


def test_a_forced_choice_streams_nothing_before_its_end() -> None:
    stream = ToolStream(ToolPolicy("named", (WEATHER,), "get_weather"))
    assert stream.add('{"city": ') == ""
    rest, calls = stream.finish('"Nice"}')
    assert rest == "" and calls_of(calls) == [("get_weather", {"city": "Nice"})]
