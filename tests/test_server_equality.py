"""Streamed and whole responses are the same response: for every route and the sampling
features that shape a choice (``n`` with several prompts, logprobs, stop strings, stop
tokens, ``max_tokens``, echo), the server-sent chunks of a streamed request, joined,
equal the non-streamed response field by field: each choice's text, token ids, finish
reason, stop reason and logprobs, the role, and the usage. Each chunk carries a choice's
ending only once, in its last chunk. Raw HTTP (``httpx``), so no client drops a field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_server_support import MODEL, PROMPTS, TEMPLATE, Live, live_server

pytestmark = pytest.mark.timeout(120)
BASE = {"model": MODEL, "temperature": 0, "max_tokens": 14, "return_token_ids": True}
CONV = [{"role": "user", "content": "What is tea?"}]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir, chat_template=TEMPLATE) as server:
        yield server


def whole(live: Live, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{live.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def stream(live: Live, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of the streamed request (with usage), ``[DONE]`` checked and dropped."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{live.url}/v1/{route}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    return [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]


def joined(chunks: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """The chunks as one response: each choice's pieces concatenated in order."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks[:-1]:
        assert chunk["usage"] is None, chunk
        for ch in chunk["choices"]:
            i = ch["index"]
            fresh = i not in choices
            c = choices.setdefault(i, {"text": "", "token_ids": [], "logprobs": None})
            assert c.get("finish_reason") is None, f"choice {i} goes on after its end: {chunk}"
            if chat:
                assert (ch["delta"]["role"] == "assistant") == fresh, chunk
                c["text"] += ch["delta"]["content"] or ""
            else:
                c["text"] += ch["text"]
            c["token_ids"] += ch["token_ids"] or []
            if ch["logprobs"] is not None:
                c["logprobs"] = extend(c["logprobs"], ch["logprobs"])
            c["finish_reason"], c["stop_reason"] = ch["finish_reason"], ch["stop_reason"]
            if ch["finish_reason"] is None:
                assert ch["stop_reason"] is None, f"a stop reason before the end: {chunk}"
    assert chunks[-1]["choices"] == [], "the usage chunk carries no choice"
    return {"choices": [choices[i] for i in sorted(choices)], "usage": chunks[-1]["usage"]}


def extend(acc: dict[str, Any] | None, piece: dict[str, Any]) -> dict[str, Any]:
    acc = acc or {k: [] for k in piece}
    for k, v in piece.items():
        acc[k] += v
    return acc


def check_equal(live: Live, route: str, body: dict[str, Any]) -> None:
    """The streamed request, joined, equals the whole one, field by field."""
    chat = route == "chat/completions"
    want = whole(live, route, body)
    got = joined(stream(live, route, body), chat)
    assert len(got["choices"]) == len(want["choices"])
    for g, w in zip(got["choices"], want["choices"], strict=True):
        text = w["message"]["content"] if chat else w["text"]
        if chat:
            assert w["message"]["role"] == "assistant"
        assert g["text"] == text
        assert g["token_ids"] == w["token_ids"]
        assert g["finish_reason"] == w["finish_reason"] is not None
        assert g["stop_reason"] == w["stop_reason"], f"stop_reason {g['stop_reason']!r} streamed"
        assert_close(g["logprobs"], w["logprobs"], "logprobs")
    assert got["usage"] == want["usage"]


def assert_close(got: Any, want: Any, where: str) -> None:
    """Equal, floats within 1e-5 (the two requests ran in different batches)."""
    if isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) <= 1e-5, (where, got, want)
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), (where, got.keys(), want.keys())
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), (where, len(got), len(want))
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_close(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def greedy_ids(live: Live, prompt: str) -> tuple[str, list[int]]:
    c = whole(live, "completions", {**BASE, "prompt": prompt, "ignore_eos": True})["choices"][0]
    return c["text"], c["token_ids"]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"max_tokens": 3},
        {"prompt": PROMPTS[2:4], "n": 2, "temperature": 1.0, "seed": 5},
        {"logprobs": 2},
        {"echo": True},
        {"stop": "STOP"},
        {"stop": "STOP", "include_stop_str_in_output": True},
        {"stop_token_ids": "TOKEN"},
    ],
    ids=["greedy", "max-tokens", "n-prompts", "logprobs", "echo", "stop", "stop-kept", "stop-id"],
)
def test_streamed_completions_equal_whole_ones(live: Live, extra: dict[str, Any]) -> None:
    check_equal(live, "completions", completion_body(live, extra))


def completion_body(live: Live, extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over a greedy request on ``PROMPTS[1]``; a stop string or token marked as
    such is taken from the middle of that request's greedy completion."""
    text, ids = greedy_ids(live, PROMPTS[1])
    body = {**BASE, "prompt": PROMPTS[1], "ignore_eos": True, **extra}
    if extra.get("stop") == "STOP":
        start = next(i for i in range(3, len(text)) if text[i : i + 2].strip())
        body["stop"] = [text[start : start + 2]]
    if extra.get("stop_token_ids") == "TOKEN":
        body["stop_token_ids"] = [ids[5]]
    return body


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"max_completion_tokens": 3},
        {"n": 2, "temperature": 1.0, "seed": 5},
        {"logprobs": True, "top_logprobs": 2},
        {"stop": "STOP"},
        {"stop_token_ids": "TOKEN"},
    ],
    ids=["greedy", "max-tokens", "n", "logprobs", "stop", "stop-id"],
)
def test_streamed_chats_equal_whole_ones(live: Live, extra: dict[str, Any]) -> None:
    check_equal(live, "chat/completions", chat_body(live, extra))


def chat_body(live: Live, extra: dict[str, Any]) -> dict[str, Any]:
    """As ``completion_body``, for a conversation."""
    base = {**BASE, "messages": CONV, "ignore_eos": True}
    c = whole(live, "chat/completions", base)["choices"][0]
    text, ids = c["message"]["content"], c["token_ids"]
    body = {**base, **extra}
    if "max_completion_tokens" in extra:
        del body["max_tokens"]
    if extra.get("stop") == "STOP":
        start = next(i for i in range(3, len(text)) if text[i : i + 2].strip())
        body["stop"] = text[start : start + 2]
    if extra.get("stop_token_ids") == "TOKEN":
        body["stop_token_ids"] = [ids[5]]
    return body


def test_the_stop_cases_really_stop(live: Live) -> None:
    """The stop cases above end by their stop string or token, not by length."""
    for route, make in (("completions", completion_body), ("chat/completions", chat_body)):
        for extra, reason in (({"stop": "STOP"}, str), ({"stop_token_ids": "TOKEN"}, int)):
            c = whole(live, route, make(live, extra))["choices"][0]
            assert c["finish_reason"] == "stop" and isinstance(c["stop_reason"], reason), c
