"""The server's limits, against a live uvicorn on the tiny model: a prompt or conversation
longer than ``max_prompt_chars`` is a 400 naming the field before it reaches the
tokenizer; a body over ``max_request_body_bytes`` a 413 in OpenAI's shape, whether its
length is declared or not; a request that can never fit in ``max_queue`` a 400 naming the
field, one that could fit later a 503; a long tokenization holds up no other request.
Every refusal leaves the engine as it was."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_engine.entrypoints.settings import ServerSettings
from tests.test_server_support import ENGINE, MODEL, PROMPTS, TEMPLATE, Live, live_server

pytestmark = pytest.mark.timeout(120)
MAX_QUEUE = 8
BODY_LIMIT = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(
        tiny_model_dir,
        chat_template=TEMPLATE,
        max_queue=MAX_QUEUE,
        max_request_body_bytes=BODY_LIMIT,
    ) as server:
        yield server


@pytest.fixture
def seen(live: Live, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every text the tokenizer encodes or renders (its calls recorded)."""
    tok = live.server.tokenizer
    lengths: list[int] = []
    encode, render = tok.encode, tok.apply_chat_template

    def spy_encode(text: str, *args: Any, **kwargs: Any) -> Any:
        lengths.append(len(text))
        return encode(text, *args, **kwargs)

    def spy_render(messages: Any, *args: Any, **kwargs: Any) -> Any:
        lengths.append(sum(len(m.get("content") or "") for m in messages))
        return render(messages, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", spy_encode)
    monkeypatch.setattr(tok, "apply_chat_template", spy_render)
    return lengths


def post(live: Live, route: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/{route}", json=body, timeout=30, **kw)


def refused(
    live: Live, r: httpx.Response, status: int, param: str | None, code: str, before: float
) -> dict[str, Any]:
    """``r`` is a refusal in OpenAI's shape, and the engine is as it was."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        param,
        code,
    ), error
    after = live.metrics()
    assert after["requests_added_total"] == before
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    return dict(error)


def test_the_prompt_limit_is_max_model_len_times_the_longest_token(live: Live) -> None:
    longest = max(map(len, live.server.tokenizer.get_vocab()))
    assert live.server.max_prompt_chars == ENGINE["max_model_len"] * longest


def test_a_huge_prompt_is_refused_before_it_is_tokenized(live: Live, seen: list[int]) -> None:
    before = live.metrics()["requests_added_total"]
    huge = "tea " * 250_000  # 1 MB
    r = post(live, "completions", {"model": MODEL, "prompt": huge, "max_tokens": 2})
    error = refused(live, r, 400, "prompt", "prompt_too_long", before)
    assert "1,000,000 characters" in error["message"] and "--max-prompt-chars" in error["message"]
    # the second prompt of a list: named by its index, and no prompt was tokenized
    r = post(live, "completions", {"model": MODEL, "prompt": ["fine", huge], "max_tokens": 2})
    assert "prompt 1 is" in refused(live, r, 400, "prompt", "prompt_too_long", before)["message"]
    # a conversation: the template is never rendered
    chat = {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    r = post(live, "chat/completions", chat)
    refused(live, r, 400, "messages", "prompt_too_long", before)
    assert seen == []


def test_a_prompt_at_the_limit_reaches_the_tokenizer(live: Live, seen: list[int]) -> None:
    limit = live.server.max_prompt_chars
    before = live.metrics()["requests_added_total"]
    r = post(live, "completions", {"model": MODEL, "prompt": "x" * (limit + 1)})
    refused(live, r, 400, "prompt", "prompt_too_long", before)
    r = post(live, "completions", {"model": MODEL, "prompt": "x" * limit})
    # tokenized, then too long for max_model_len: the engine's own refusal
    error = refused(live, r, 400, "prompt", "invalid_value", before)
    assert "max_model_len" in error["message"] and seen == [limit]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413(live: Live, declared: bool) -> None:
    before = live.metrics()["requests_added_total"]
    stop = "s" * (BODY_LIMIT + 1)
    raw = json.dumps({"model": MODEL, "prompt": "hi", "stop": stop}).encode()
    headers = {"content-type": "application/json"}
    content: Any = (
        raw if declared else iter([raw[i : i + 65536] for i in range(0, len(raw), 65536)])
    )
    r = httpx.post(f"{live.url}/v1/completions", content=content, headers=headers, timeout=30)
    error = refused(live, r, 413, None, "request_too_large", before)
    assert "--max-request-body-bytes" in error["message"]
    # just under the limit, the same body is parsed (and refused for what it says)
    small = json.dumps({"model": MODEL, "prompt": "hi", "stop": [""]}).encode()
    r = httpx.post(f"{live.url}/v1/completions", content=small, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_a_request_that_can_never_fit_is_a_400_and_one_that_could_later_a_503(
    live: Live,
) -> None:
    before = live.metrics()["requests_added_total"]
    many = {"model": MODEL, "prompt": ["hi"] * (MAX_QUEUE + 1), "max_tokens": 2}
    r = post(live, "completions", many)
    assert "--max-queue" in refused(live, r, 400, "prompt", "invalid_value", before)["message"]
    wide = {"model": MODEL, "prompt": "hi", "n": MAX_QUEUE + 1, "temperature": 1.0}
    refused(live, post(live, "completions", wide), 400, "n", "invalid_value", before)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = post(live, "chat/completions", {**chat, "n": MAX_QUEUE + 1, "temperature": 1.0})
    refused(live, r, 400, "n", "invalid_value", before)
    # hold 6 of the 8 sequences with two streams of n=3
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", timeout=30, max_retries=0)
    streams = [
        client.completions.create(
            model=MODEL,
            prompt=p,
            n=3,
            temperature=1.0,
            seed=1,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for p in PROMPTS[:2]
    ]
    try:
        for s in streams:
            next(s)
        three = {"model": MODEL, "prompt": PROMPTS[2:5], "max_tokens": 2}
        r = post(live, "completions", three)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        # full or not, one that can never fit is told so
        assert post(live, "completions", many).status_code == 400
        assert post(live, "completions", {**three, "prompt": PROMPTS[2:4]}).status_code == 200
    finally:
        for s in streams:
            s.close()


def test_a_long_tokenization_holds_up_no_other_request(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = live.server.tokenizer
    entered, go_on = threading.Event(), threading.Event()
    encode = tok.encode

    def slow_for_long_texts(text: str, *args: Any, **kwargs: Any) -> Any:
        if len(text) > 1000:
            entered.set()
            go_on.wait(30)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", slow_for_long_texts)
    answers: dict[str, httpx.Response] = {}

    def ask(name: str, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        answers[name] = post(live, "completions", body)

    long = threading.Thread(target=ask, args=("long", (PROMPTS[1] + " ") * 40))
    long.start()
    assert entered.wait(10), "the long prompt was never tokenized"
    short = threading.Thread(target=ask, args=("short", PROMPTS[0]))
    short.start()
    short.join(10)
    answered_meanwhile = not short.is_alive()
    go_on.set()
    long.join(30)
    short.join(30)
    assert answered_meanwhile, "a request waited for another's tokenization"
    assert answers["short"].status_code == 200 and answers["long"].status_code == 200
    assert answers["long"].json()["usage"]["prompt_tokens"] > 200


@pytest.mark.parametrize(
    "field", ["max_prompt_chars", "max_request_body_bytes", "tokenize_threads", "max_queue"]
)
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_a_bad_limit_is_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be an int >= 1, got {value!r}$"):
        ServerSettings(served_model_name=MODEL, **{field: value})


def test_the_limits_default_to_the_model_and_16_mib() -> None:
    s = ServerSettings(served_model_name=MODEL)
    assert s.max_prompt_chars is None and s.max_request_body_bytes == 16 * 1024 * 1024
