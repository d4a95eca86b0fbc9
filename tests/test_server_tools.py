"""Tool calling on ``/v1/chat/completions``, through the ``openai`` client's typed responses,
on the tiny model (a live server in this process):

* the tools reach the chat template (the prompt grows by them), unless ``tool_choice`` is
  ``"none"``;
* ``"required"`` and a named function force the output (structured outputs) into calls of
  the request's tools, whose arguments follow each tool's parameters;
* ``"auto"`` reads Hermes-format calls (``<tool_call>{json}</tool_call>``) from the text;
  a regex forces the tiny model to write one here, as a trained model would;
* streamed, the content stops where a call begins and the calls come whole at the end,
  equal to the non-streamed response;
* bad ``tools`` / ``tool_choice`` are 400s naming the field, and nothing is queued;
* a formatter that reads no calls is caught."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from paged_engine.entrypoints.tool_calls import ToolPolicy
from tests.test_server_support import MODEL, TEMPLATE, Live, live_server

pytestmark = pytest.mark.timeout(180)
TOOL_TEMPLATE = "{% if tools %}<|bos|>tools: {{ tools | tojson }}\n{% endif %}" + TEMPLATE
CITIES = ["Paris", "Oslo"]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": CITIES}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BASE: dict[str, Any] = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=120)
FORCED_CALL = (
    r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}'
    r"</tool_call>"
)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir, chat_template=TOOL_TEMPLATE, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def follows_its_tool(call: Any) -> str:
    """The call's name, once its arguments are checked against that tool's parameters."""
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id
    if call.function.name == "get_weather":
        assert set(args) == {"city"} and args["city"] in CITIES, args
    else:
        assert call.function.name == "get_time", call.function.name
        assert set(args) == {"zone"} and args["zone"] in ("UTC", "CET"), args
    return str(call.function.name)


def test_the_tools_reach_the_template(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(**BASE | {"max_tokens": 1})
    with_tools = client.chat.completions.create(**BASE | {"max_tokens": 1}, tools=TOOLS)
    hidden = client.chat.completions.create(
        **BASE | {"max_tokens": 1}, tools=TOOLS, tool_choice="none"
    )
    assert plain.usage and with_tools.usage and hidden.usage
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens


def check_required(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        **BASE, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1 and choice.message.content is None
    follows_its_tool(calls[0])


def test_required_makes_one_call_of_a_tool(client: openai.OpenAI) -> None:
    check_required(client)


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(**BASE, tools=TOOLS, tool_choice=named)  # type: ignore[arg-type]
    (choice,) = r.choices
    assert choice.finish_reason == "stop"  # OpenAI's, for a named function
    (call,) = choice.message.tool_calls or []
    assert follows_its_tool(call) == "get_time"


def auto_request(stream: bool) -> dict[str, Any]:
    return dict(
        BASE,
        tools=TOOLS,
        tool_choice="auto",
        stream=stream,
        extra_body={"structured_outputs": {"regex": FORCED_CALL}},
    )


def test_auto_reads_the_calls_in_the_text(client: openai.OpenAI) -> None:
    (choice,) = client.chat.completions.create(**auto_request(False)).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls or []
    assert follows_its_tool(call) == "get_weather"


def test_streamed_calls_equal_the_whole_response(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(**auto_request(False)).choices[0]
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**auto_request(True)):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
            assert "<tool_call" not in (ch.delta.content or "")
    assert content == whole.message.content and finish == "tool_calls"
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == want  # type: ignore[union-attr]
    assert [c.index for c in calls] == list(range(len(want)))


@pytest.mark.parametrize(
    ("tools", "choice", "field", "words"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        (None, "required", "tool_choice", "needs tools"),
        ([{"type": "function", "function": {"description": "x"}}], "auto", "tools", "name"),
        (TOOLS, "whenever", "tool_choice", 'must be "none"'),
    ],
)
def test_bad_tool_requests_are_refused_by_field(
    client: openai.OpenAI, live: Live, tools: Any, choice: Any, field: str, words: str
) -> None:
    extra: dict[str, Any] = {"tool_choice": choice} | ({"tools": tools} if tools else {})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**BASE, extra_body=extra)
    err = e.value.body
    assert isinstance(err, dict) and err.get("param") == field, err
    assert words in str(err.get("message")), err
    snap = live.server.loop.snapshot  # type: ignore[union-attr]
    assert snap is not None and snap.running == snap.waiting == 0


def test_auto_needs_the_server_s_parser(tiny_model_dir: Path) -> None:
    with live_server(tiny_model_dir, chat_template=TOOL_TEMPLATE) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**BASE, tools=TOOLS)  # tool_choice: auto by default
        err = e.value.body
        assert isinstance(err, dict) and err.get("param") == "tool_choice", err
        assert "--enable-auto-tool-choice" in str(err.get("message")), err
        plain = c.chat.completions.create(
            **BASE | {"max_tokens": 2}, tools=TOOLS, tool_choice="none"
        )
        assert plain.choices[0].message.tool_calls is None


def test_a_formatter_that_reads_no_calls_is_caught(
    client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ToolPolicy, "extract", lambda self, text: (text, []))
    with pytest.raises(AssertionError):
        check_required(client)
