"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1 (ephemeral port), driven
by the official ``openai`` client: completions and chat equal to ``LLM.generate`` /
``LLM.chat`` on the same model and config, token for token; streamed deltas that
concatenate to the whole text, one chunk per token; ``n``, stop strings, logprobs, echo;
and every bad request a 400 in OpenAI's error shape naming the field, with nothing
queued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.sampling_params import RequestOutputKind
from tests.test_server_support import ENGINE, MODEL, PROMPTS, TEMPLATE, Live, live_server

pytestmark = pytest.mark.timeout(120)
GREEDY = dict(temperature=0, max_tokens=12)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir, chat_template=TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=30, max_retries=0)


def offline_greedy(offline: LLM, prompts: list[Any], **kw: Any) -> list[Any]:
    """``LLM.generate``'s first completion of each prompt (greedy, 12 tokens by default)."""
    params = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw})
    return [o.outputs[0] for o in offline.generate(prompts, params, use_tqdm=False)]


def streamed(offline: LLM, prompt: Any, **kw: Any) -> str:
    """The text the engine's streaming path (``add_request``/``step``, no HTTP) gives a
    greedy request. It differs from ``generate``'s when a completion ends inside a UTF-8
    character: ``generate`` decodes the whole completion (ending in U+FFFD), the
    incremental detokeniser never emits an incomplete character."""
    kw = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw}
    params = SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
    engine = offline.llm_engine
    engine.add_request("offline", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = outs
    assert out.outputs[0].token_ids == offline_greedy(offline, [prompt], **kw)[0].token_ids
    return out.outputs[0].text


def test_models_and_health(live: Live, client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == ENGINE["max_model_len"]
    assert httpx.get(live.url + "/health").status_code == 200
    missing = httpx.get(live.url + "/v1/nothing")
    assert missing.status_code == 404 and set(missing.json()["error"]) >= {"message", "type"}


def test_greedy_completions_equal_offline_generate(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.tokenizer.encode("Call me Ishmael.")  # type: ignore[union-attr]
    prompts: list[Any] = [*PROMPTS[:4], ids]
    expected = offline_greedy(offline, prompts)
    for prompt, want in zip(prompts, expected, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=EXTRA)
        (choice,) = r.choices
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.text == streamed(offline, prompt) and choice.finish_reason == "length"
        n_prompt = len(ids) if isinstance(prompt, list) else len(offline.tokenizer.encode(prompt))  # type: ignore[union-attr]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)
    # several prompts in one request: one choice each, in prompt order
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:4], **GREEDY, extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in r.choices] == [w.token_ids for w in expected[:4]]


def stream_text(client: openai.OpenAI, **kw: Any) -> tuple[str, list[Any]]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


@pytest.mark.parametrize(
    "extra",
    [{}, {"stop": [" the", "."]}, {"logprobs": 2}, {"temperature": 0.9, "seed": 3}],
    ids=["greedy", "stop", "logprobs", "seeded"],
)
def test_streamed_deltas_concatenate_to_the_text(client: openai.OpenAI, extra: Any) -> None:
    check_stream(client, extra)


def check_stream(client: openai.OpenAI, extra: Any) -> None:
    """Streamed and whole completions of one request agree: text, tokens one chunk per
    token, finish reason only at the end, usage, logprobs."""
    kw = {**GREEDY, "max_tokens": 20, **extra, "prompt": PROMPTS[1], "extra_body": EXTRA}
    whole = client.completions.create(model=MODEL, **kw)
    text, chunks = stream_text(client, **kw, stream_options={"include_usage": True})
    assert text == whole.choices[0].text
    body = [c for c in chunks if c.choices]
    # one chunk per new token, together the whole completion
    assert all(len(c.choices[0].model_extra["token_ids"]) == 1 for c in body)
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == (
        whole.choices[0].model_extra["token_ids"]
    )
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    if "logprobs" in extra:
        streamed = [lp for c in body for lp in c.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_the_stream_ends_with_done(live: Live) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) == 5
    assert all(
        json.loads(e.removeprefix("data: "))["object"] == "text_completion" for e in events[:-1]
    )


def test_n_gives_n_choices_equal_to_offline(client: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7)
    (want,) = offline.generate(PROMPTS[2], params, use_tqdm=False)
    kw = dict(model=MODEL, max_tokens=8, n=3, seed=7, temperature=1.0)
    r = client.completions.create(prompt=PROMPTS[2], extra_body={"return_token_ids": True}, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    got = [c.model_extra["token_ids"] for c in r.choices]
    assert got == [c.token_ids for c in want.outputs] and len({tuple(g) for g in got}) > 1
    # two prompts, n=3: choices numbered prompt-major
    r = client.completions.create(prompt=PROMPTS[2:4], **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices[:3]] == [c.text for c in want.outputs]


def test_stop_strings_truncate_the_text(client: openai.OpenAI, offline: LLM) -> None:
    full = streamed(offline, PROMPTS[4])
    # a stop string from the middle of the greedy text: the text ends before its first match
    start = next(i for i in range(4, len(full)) if full[i : i + 2].isalnum())
    stop = full[start : start + 2]
    want = full[: full.index(stop)]
    assert len(want) < len(full)
    (offline_stopped,) = offline_greedy(offline, [PROMPTS[4]], stop=[stop])
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], stop=stop, **GREEDY, extra_body=EXTRA
    )
    (c,) = r.choices
    assert c.text == want == offline_stopped.text
    assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", stop)
    assert stream_text(client, prompt=PROMPTS[4], stop=stop, **GREEDY, extra_body=EXTRA)[0] == want


def test_logprobs_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    (want,) = offline_greedy(offline, [PROMPTS[5]], logprobs=3)
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[5], logprobs=3, **GREEDY, extra_body=EXTRA
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 12
    for token, got, top, position in zip(
        want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs, strict=True
    ):
        assert got == pytest.approx(position[token].logprob, abs=1e-4)
        # OpenAI keys the alternatives by text: tokens that decode alike share a key
        expected: dict[str, float] = {}
        for entry in position.values():
            expected.setdefault(entry.decoded_token, entry.logprob)
        assert top == pytest.approx(expected, abs=1e-4) and 3 <= len(position) <= 4
    assert lp.tokens == [want.logprobs[i][t].decoded_token for i, t in enumerate(want.token_ids)]
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_echo_prefixes_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    want = streamed(offline, PROMPTS[6])
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[6], echo=True, **GREEDY, extra_body=EXTRA
    )
    assert r.choices[0].text == PROMPTS[6] + want
    text, _ = stream_text(client, prompt=PROMPTS[6], echo=True, **GREEDY, extra_body=EXTRA)
    assert text == PROMPTS[6] + want


def test_chat_through_the_template(client: openai.OpenAI, offline: LLM) -> None:
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is tea?"}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    (want,) = offline.chat(conv, params, chat_template=TEMPLATE, use_tqdm=False)
    kw: Any = dict(model=MODEL, messages=conv, temperature=0, max_completion_tokens=12)
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, extra_body=EXTRA)
    (c,) = r.choices
    text = streamed(offline, want.prompt_token_ids)
    assert c.message.role == "assistant" and c.message.content == text
    assert c.model_extra["token_ids"] == want.outputs[0].token_ids
    assert r.model_extra["prompt_token_ids"] == want.prompt_token_ids
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    w = want.outputs[0]
    for entry, token, position in zip(c.logprobs.content, w.token_ids, w.logprobs, strict=True):
        assert entry.logprob == pytest.approx(position[token].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 2
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=EXTRA))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert len(chunks) == 12 and chunks[-1].choices[0].finish_reason == "length"
    # text parts are joined as the template's content
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is tea?"}]}]
    (want2,) = offline.chat(
        [{"role": "user", "content": "What is tea?"}],
        params,
        chat_template=TEMPLATE,
        use_tqdm=False,
    )
    r2 = client.chat.completions.create(
        model=MODEL, messages=parts, temperature=0, max_tokens=12, extra_body=EXTRA
    )  # type: ignore[arg-type]
    assert r2.choices[0].message.content == streamed(offline, want2.prompt_token_ids)


BAD = [
    (b'{"model": "tiny", "prompt": ', None, "json_invalid"),
    (b'["not", "an", "object"]', None, None),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "ten"}', "max_tokens", None),
    (b'{"model": "tiny", "prompt": 5}', "prompt", None),
    (b'{"model": "tiny", "prompt": "hi", "n": 1.5}', "n", None),
    (b'{"model": "tiny", "prompt": "hi", "temperature": "hot"}', "temperature", None),
    (b'{"model": "tiny", "prompt": "hi", "stream": "yes"}', "stream", None),
    (b'{"model": "tiny", "prompt": "hi", "stop": 3}', "stop", None),
    (b'{"model": "tiny", "prompt": "hi", "max_token": 3}', "max_token", None),
    (b'{"prompt": "hi"}', "model", None),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000}', "max_tokens", None),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', "max_tokens", None),
    (b'{"model": "tiny", "prompt": ""}', "prompt", None),
    (b'{"model": "tiny", "prompt": []}', "prompt", None),
    (b'{"model": "tiny", "prompt": ["fine", ""]}', "prompt", None),
    (b'{"model": "tiny", "prompt": [[1, 2], [99999]]}', "prompt", None),
    (b'{"model": "tiny", "prompt": "' + b"tea " * 600 + b'"}', "prompt", None),
    (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', "temperature", None),
    (b'{"model": "tiny", "prompt": "hi", "top_p": 0}', "top_p", None),
    (b'{"model": "tiny", "prompt": "hi", "n": 2, "temperature": 0}', "n", None),
    (b'{"model": "tiny", "prompt": "hi", "logprobs": 50}', "logprobs", None),
    (b'{"model": "tiny", "prompt": "hi", "stop": [""]}', "stop", None),
    (b'{"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias", None),
    (b'{"model": "tiny", "prompt": [1, 2], "echo": true}', "echo", None),
]
BAD_CHAT = [
    (b'{"model": "tiny", "messages": []}', "messages", None),
    (b'{"model": "tiny", "messages": [{"content": "hi"}]}', "messages.0.role", None),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}]}',
        "messages.0.content",
        None,
    ),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        b'"max_completion_tokens": 9999}',
        "max_completion_tokens",
        None,
    ),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
        "top_logprobs",
        None,
    ),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        b'"logprobs": true, "top_logprobs": 21}',
        "top_logprobs",
        None,
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "param", "code"),
    [("completions", *b) for b in BAD] + [("chat/completions", *b) for b in BAD_CHAT],
)
def test_bad_requests_are_400s_naming_the_field_and_queue_nothing(
    live: Live, route: str, body: bytes, param: str | None, code: str | None
) -> None:
    check_bad_request(live, route, body, param, code)


def check_bad_request(
    live: Live,
    route: str,
    body: bytes,
    param: str | None,
    code: str | None,
    status: int = 400,
    type_: str = "invalid_request_error",
) -> None:
    """A ``status`` (400) in OpenAI's error shape naming ``param``; nothing reached the
    engine."""
    before = live.metrics()["requests_added_total"]
    r = httpx.post(
        f"{live.url}/v1/{route}", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == type_ and error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    after = live.metrics()
    assert after["requests_added_total"] == before
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_an_unknown_model_is_a_404_naming_the_field(live: Live, route: str) -> None:
    # OpenAI's and vLLM's answer: the model is not found (not a malformed request)
    key = b'"prompt": "hi"' if route == "completions" else b'"messages": [{"role": "user"}]'
    body = b'{"model": "gpt-4", ' + key + b"}"
    check_bad_request(live, route, body, "model", "model_not_found", 404, "not_found_error")


def test_the_openai_client_sees_a_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100000)
    assert info.value.status_code == 400 and info.value.param == "max_tokens"
    assert "max_model_len" in info.value.message


def test_the_prefix_cache_and_pool_metrics_carry_vllms_names(
    live: Live, client: openai.OpenAI
) -> None:
    # Two full blocks (block size 8) of tokens no other test sends, plus one: the second
    # request finds both blocks cached; the last prompt token is always computed.
    prompt = [700 + i for i in range(17)]
    before = live.metrics()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    after = live.wait_metrics(
        lambda m: m["prefix_cache_queries_total"] >= before["prefix_cache_queries_total"] + 34
    )
    assert after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] == 34
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == 16
    usage = after["kv_blocks_in_use"] / after["kv_blocks_total"]
    assert after["kv_cache_usage_perc"] == pytest.approx(usage)
