"""Tool calling on ``/v1/chat/completions``: which tool choice a request makes, the JSON
schema that forces a call, and the calls read back out of the model's text.

Why here, apart from the formatter: the policy is decided once per HTTP request (and
refused by name before anything reaches the engine), while the text is read per choice
as it ends, or as it streams. Three ways a call comes about, as in vLLM:

* ``tool_choice="auto"`` (the server started with ``--enable-auto-tool-choice`` and
  ``--tool-call-parser hermes``): the model may write calls in the Hermes format that
  Qwen's chat templates teach, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, after any text; the text before the first is the content. A call
  whose JSON does not parse leaves the whole text as content;
* ``"required"``: the output is forced (structured outputs) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the request's tools each;
* a named function: the output is forced to that function's parameters schema, and is
  its arguments.

``"none"`` (or no tools) reads nothing. A streamed choice sends its content until a call
begins; the calls follow, whole, in the chunk that ends it (``ToolStream``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from paged_engine.entrypoints.serving import RequestError

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, as OpenAI's ``tool_calls`` entries carry it (``arguments``: JSON text)."""

    name: str
    arguments: str
    id: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call(name: object, arguments: object) -> ToolCall:
    if not isinstance(name, str):
        raise ValueError("a tool call's name is not a string")
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, args, f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """What one request's ``tools`` / ``tool_choice`` ask for (see the module docstring)."""

    mode: str
    """``"auto"``, ``"required"`` or ``"named"``."""
    tools: tuple[dict[str, Any], ...]
    """Each tool's ``function`` object (name, description, parameters)."""
    name: str | None = None
    """The named function (``mode == "named"``)."""
    parallel: bool = True
    """``parallel_tool_calls``: False allows one call at most (the first is kept)."""

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is held to (None: free text, ``auto``)."""
        if self.mode == "named":
            return _parameters(next(t for t in self.tools if t["name"] == self.name))
        if self.mode == "required":
            one_of_them = [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t["name"]]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                }
                for t in self.tools
            ]
            item = {"type": "object", "anyOf": one_of_them}
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
            if not self.parallel:
                schema["maxItems"] = 1
            return schema
        return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and its calls, from a finished choice's text."""
        content, calls = self._read(text)
        return content, calls if self.parallel else calls[:1]

    def _read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            if self.mode == "named":
                json.loads(text)  # the forced output is the arguments: JSON, or no call
                return None, [_call(self.name, text)]
            if self.mode == "required":
                calls = json.loads(text)
                if not isinstance(calls, list):
                    raise ValueError("not a list of calls")
                return None, [_call(c["name"], c["parameters"]) for c in calls]
        except (ValueError, KeyError, TypeError):  # cut short (max_tokens): left as text
            return text, []
        return parse_hermes(text)

    @property
    def finish_reason(self) -> str:
        """A choice that made calls ends with this (OpenAI's: ``stop`` for a named one)."""
        return "stop" if self.mode == "named" else "tool_calls"


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a Hermes-format text; no call (and all of the text as content)
    where a call's JSON does not parse or lacks a name."""
    at = text.find(START)
    if at < 0:
        return text, []
    try:
        calls = []
        for body in _CALL.findall(text):
            call = json.loads(body)
            calls.append(_call(call["name"], call.get("arguments", {})))
    except (ValueError, KeyError, TypeError):
        return text, []
    content = text[:at]
    return (content if content.strip() else None), calls


def tool_policy(
    tools: list[dict[str, Any]] | None,
    tool_choice: object,
    auto_parser: str | None,
    parallel: bool = True,
) -> ToolPolicy | None:
    """The policy of a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
    (OpenAI's shapes, as dicts), None where no call is to be read; a ``RequestError``
    naming the field for what cannot be served. ``auto_parser``: the server's
    ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None."""
    functions = []
    for t in tools or ():
        f = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(f, dict):
            raise RequestError("each tool must be {type: function, function: {...}}", param="tools")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise RequestError("each tool's function needs a name", param="tools")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise RequestError(f"tool {f['name']!r}: parameters must be an object", param="tools")
        functions.append(f)
    if len({f["name"] for f in functions}) != len(functions):
        raise RequestError("two tools have the same name", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return None
    if not functions:
        raise RequestError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "required":
        return ToolPolicy("required", tuple(functions), parallel=parallel)
    if tool_choice == "auto":
        if auto_parser is None:
            raise RequestError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        return ToolPolicy("auto", tuple(functions), parallel=parallel)
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise RequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {f["name"] for f in functions}:
        raise RequestError(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return ToolPolicy("named", tuple(functions), name, parallel)


class ToolStream:
    """One streamed choice under a policy: the text to send now, held back from where a
    call may begin (``auto``: a ``<tool_call>`` or a prefix of one at the end; forced:
    all of it); the calls are read once the choice ends."""

    __slots__ = ("_policy", "_sent", "_text")

    def __init__(self, policy: ToolPolicy) -> None:
        self._policy = policy
        self._text = ""
        self._sent = 0

    def add(self, new_text: str) -> str:
        """The content to send now for ``new_text`` (the choice goes on)."""
        self._text += new_text
        if self._policy.mode != "auto":
            return ""
        at = self._text.find(START, self._sent)
        end = at if at >= 0 else len(self._text) - _partial_start(self._text)
        end = max(end, self._sent)
        out, self._sent = self._text[self._sent : end], end
        return out

    def finish(self, new_text: str) -> tuple[str, list[ToolCall]]:
        """The content still to send and the calls, once the choice has ended."""
        self._text += new_text
        content, calls = self._policy.extract(self._text)
        if not calls:
            return self._text[self._sent :], []
        assert content is None or len(content) >= self._sent, "content was held back"
        return (content or "")[self._sent :], calls


def _partial_start(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0
