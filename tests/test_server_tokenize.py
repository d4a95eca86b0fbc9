"""vLLM's ``/tokenize`` and ``/detokenize`` and ``GET /v1/models/{id}``, against a live
server in both engine modes: an in-process one (``--engine-core thread``) and a
``paged-engine serve`` process (``--engine-core process``, the default, with an API key).

The model's tokenizer is the tiny model's with a post-processor that adds ``<|bos|>``, so
that ``add_special_tokens`` changes the ids and a route that ignores it fails. Token ids
must equal the tokenizer's own ``encode`` and ``apply_chat_template``, and the ids the
completion routes send the engine; ``return_token_strs`` its ``convert_ids_to_tokens``;
detokenizing round-trips. The routes never reach the engine (its thread is not woken; in
process mode they answer with the core stopped). Every refusal has its status and names
its field, and changes nothing but the refusals' counter; without the key, 401."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from tests.test_server_support import (
    ENGINE,
    MODEL,
    PROMPTS,
    TEMPLATE,
    Live,
    live_server,
    serve_process,
)

pytestmark = pytest.mark.timeout(120)
BODY_LIMIT = 256 * 1024
KEY = "tok-s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVED = "org/tiny"
"""The process server's model name: a "/" as in Hugging Face names (``org/model``)."""
TOKENIZE_FIELDS = ["count", "max_model_len", "tokens", "token_strs"]
"""vLLM's ``TokenizeResponse``, in its order (``vllm bench serve`` reads ``tokens``)."""
TEXTS = [*PROMPTS[:4], "naïve café, 日本語 🙂", "  spaces\n\tand tabs  "]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Tell me more"},
    ],
]


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its tokenizer adding ``<|bos|>`` when asked for special tokens, and
    without a chat template of its own (the servers' is ``TEMPLATE``, or none)."""
    out = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_model_dir, out)
    for kept in out.glob("chat_template*"):  # a template file save_pretrained would leave
        kept.unlink()
    tok = AutoTokenizer.from_pretrained(out)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)]
    )
    tok.chat_template = None
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(bos_model_dir: Path) -> Any:
    """The tokenizer, loaded apart from any server's."""
    tokenizer = AutoTokenizer.from_pretrained(bos_model_dir)
    with_bos, without = tokenizer.encode("hi"), tokenizer.encode("hi", add_special_tokens=False)
    assert with_bos == [tokenizer.bos_token_id, *without], "special tokens must matter here"
    assert tokenizer.chat_template is None
    return tokenizer


@pytest.fixture(scope="module")
def live(bos_model_dir: Path) -> Iterator[Live]:
    with live_server(
        bos_model_dir, chat_template=TEMPLATE, max_request_body_bytes=BODY_LIMIT
    ) as server:
        yield server


@pytest.fixture(scope="module")
def served(bos_model_dir: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``serve`` with the default ``--engine-core process``, a key, no chat template."""
    flags = ["--served-model-name", SERVED, "--engine-core", "process"]
    with serve_process(bos_model_dir, *flags, env={"PAGED_ENGINE_API_KEY": KEY}) as served:
        yield served


@pytest.fixture
def proc(served: tuple[str, subprocess.Popen[str]]) -> str:
    assert served[1].poll() is None, "the server process has exited"
    return served[0]


def post(url: str, route: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=30, **kw)


def tokenize(url: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = post(url, "/tokenize", {"model": MODEL, **body}, **kw)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert list(out) == TOKENIZE_FIELDS and out["count"] == len(out["tokens"]), out
    return out


def detokenize(url: str, tokens: list[int], **kw: Any) -> str:
    r = post(url, "/detokenize", {"model": MODEL, "tokens": tokens}, **kw)
    assert r.status_code == 200, r.text
    assert list(r.json()) == ["prompt"], r.text
    return str(r.json()["prompt"])


def unchanged(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Every metric but the refusals' counter is as it was; the refusals by status."""
    keep = {k: v for k, v in before.items() if "rejected" not in k}
    assert {k: v for k, v in after.items() if "rejected" not in k} == keep
    return {k: v for k, v in after.items() if k.startswith("requests_rejected_total")}


def rendered(tok: Any, conversation: list[dict[str, Any]], **kw: Any) -> list[int]:
    """``apply_chat_template``'s ids of the conversation under the server's template."""
    out = tok.apply_chat_template(conversation, tokenize=True, chat_template=TEMPLATE, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


# ---- the in-process server (--engine-core thread) ----------------------------------------


def test_the_routes_never_wake_the_engine(live: Live) -> None:
    """The engine thread blocks while idle: a route that reached the engine would wake it."""
    live.wait_metrics(lambda m: m["num_requests_running"] + m["num_requests_waiting"] == 0)
    time.sleep(0.2)
    live.engine.threads.clear()
    before = live.metrics()
    tokenize(live.url, {"prompt": "hello"})
    tokenize(live.url, {"messages": CONVERSATIONS[0]})
    detokenize(live.url, [5, 6, 7])
    assert httpx.get(live.url + f"/v1/models/{MODEL}", timeout=10).status_code == 200
    assert live.engine.threads == set()
    unchanged(before, live.metrics())


def test_a_prompt_tokenizes_as_the_tokenizers_own_encode(live: Live, tok: Any) -> None:
    for text in TEXTS:
        out = tokenize(live.url, {"prompt": text})
        assert out["tokens"] == tok.encode(text) == tok.encode(text, add_special_tokens=True)
        assert out["tokens"][0] == tok.bos_token_id
        assert out["max_model_len"] == ENGINE["max_model_len"] and out["token_strs"] is None
        plain = tokenize(live.url, {"prompt": text, "add_special_tokens": False})
        assert plain["tokens"] == tok.encode(text, add_special_tokens=False) == out["tokens"][1:]
    # model may be omitted, as in vLLM
    assert post(live.url, "/tokenize", {"prompt": "hi"}).json()["tokens"] == tok.encode("hi")


def test_return_token_strs_is_the_tokenizers_convert_ids_to_tokens(live: Live, tok: Any) -> None:
    for body in ({"prompt": TEXTS[4]}, {"messages": CONVERSATIONS[1]}):
        out = tokenize(live.url, {**body, "return_token_strs": True})
        assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
        assert len(out["token_strs"]) == out["count"] > 3
        assert tokenize(live.url, {**body, "return_token_strs": None})["token_strs"] is None


def test_the_chat_form_is_the_chat_template_applied(live: Live, tok: Any) -> None:
    for conv in CONVERSATIONS:
        out = tokenize(live.url, {"messages": conv})
        assert out["tokens"] == rendered(tok, conv, add_generation_prompt=True)
        no_prompt = tokenize(live.url, {"messages": conv, "add_generation_prompt": False})
        assert no_prompt["tokens"] == rendered(tok, conv, add_generation_prompt=False)
        assert no_prompt["tokens"] != out["tokens"]
        final = {"messages": conv, "add_generation_prompt": False, "continue_final_message": True}
        assert tokenize(live.url, final)["tokens"] == rendered(
            tok, conv, continue_final_message=True
        )
        # the template writes its own specials; asked, the tokenizer's are added on top
        special = tokenize(live.url, {"messages": conv, "add_special_tokens": True})
        assert special["tokens"] == [tok.bos_token_id, *out["tokens"]]
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]
    out = tokenize(live.url, {"messages": [{"role": "user", "content": parts}]})
    joined = [{"role": "user", "content": "first part\nsecond"}]
    assert out["tokens"] == rendered(tok, joined, add_generation_prompt=True)


def test_the_ids_are_those_the_completion_routes_send_the_engine(live: Live) -> None:
    extra = {"return_token_ids": True, "max_tokens": 1, "temperature": 0}
    for text in TEXTS[:3]:
        r = post(live.url, "/v1/completions", {"model": MODEL, "prompt": text, **extra})
        assert r.status_code == 200, r.text
        sent = r.json()["choices"][0]["prompt_token_ids"]
        assert tokenize(live.url, {"prompt": text})["tokens"] == sent
    for conv in CONVERSATIONS:
        r = post(live.url, "/v1/chat/completions", {"model": MODEL, "messages": conv, **extra})
        assert r.status_code == 200, r.text
        assert tokenize(live.url, {"messages": conv})["tokens"] == r.json()["prompt_token_ids"]


def test_detokenize_round_trips(live: Live, tok: Any) -> None:
    for text in TEXTS:
        plain = tokenize(live.url, {"prompt": text, "add_special_tokens": False})["tokens"]
        assert detokenize(live.url, plain) == text
        ids = tokenize(live.url, {"prompt": text})["tokens"]
        assert detokenize(live.url, ids) == tok.decode(ids) == tok.bos_token + text
    assert detokenize(live.url, []) == ""
    every = list(range(len(tok.get_vocab())))  # the whole vocabulary, its last id included
    assert detokenize(live.url, every) == tok.decode(every)


def test_vllm_bench_serves_alignment_calls(live: Live, tok: Any) -> None:
    """What ``vllm bench serve`` does when its tokenizer disagrees with the server's: token
    ids of each prompt without special tokens, then the text of their first ``prompt_len``."""
    for text in PROMPTS:
        body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
        tokens = post(live.url, "/tokenize", body).json()["tokens"]
        cut = post(live.url, "/detokenize", {"model": MODEL, "tokens": tokens[:3]}).json()
        assert cut["prompt"] == tok.decode(tokens[:3]) and text.startswith(cut["prompt"])


HI = [{"role": "user", "content": "hi"}]


def refusal(name: str, route: str, body: Any, status: int, param: Any, code: Any) -> Any:
    """One refused request; a ``dict`` body is sent with ``"model": MODEL`` unless it has
    its own."""
    if isinstance(body, dict):
        body = {"model": MODEL, **body}
    return pytest.param(route, body, status, param, code, id=name)


TOKENS_PAST_LIMIT = [7] * (BODY_LIMIT // 2)
REFUSALS = [
    refusal("tokenize-model", "/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model",
            "model_not_found"),
    refusal("chat-model", "/tokenize", {"model": "gpt-4", "messages": HI}, 404, "model",
            "model_not_found"),
    refusal("detokenize-model", "/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model",
            "model_not_found"),
    refusal("no-prompt", "/tokenize", {}, 400, "prompt", "invalid_type"),
    refusal("prompt-not-text", "/tokenize", {"prompt": [1, 2]}, 400, "prompt", "invalid_type"),
    refusal("flag-not-bool", "/tokenize", {"prompt": "hi", "add_special_tokens": 1}, 400,
            "add_special_tokens", "invalid_type"),
    refusal("both-forms", "/tokenize", {"prompt": "hi", "messages": HI}, 400, "prompt",
            "invalid_type"),
    refusal("unknown-field", "/tokenize", {"messages": HI, "tools": []}, 400, "tools",
            "invalid_type"),
    refusal("no-messages", "/tokenize", {"messages": []}, 400, "messages", "invalid_type"),
    refusal("no-role", "/tokenize", {"messages": [{"content": "hi"}]}, 400, "messages.0.role",
            "invalid_type"),
    refusal("own-template", "/tokenize", {"messages": HI, "chat_template": TEMPLATE}, 400,
            "chat_template", None),
    refusal("continue-and-prompt", "/tokenize", {"messages": HI, "continue_final_message": True},
            400, "continue_final_message", None),
    refusal("past-vocabulary", "/detokenize", {"tokens": [5, 768]}, 400, "tokens",
            "invalid_value"),
    refusal("negative-id", "/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value"),
    refusal("huge-id", "/detokenize", {"tokens": [2**64]}, 400, "tokens", "invalid_value"),
    refusal("id-not-int", "/detokenize", {"tokens": [1, 2.0]}, 400, "tokens.1", "invalid_type"),
    refusal("no-tokens", "/detokenize", {}, 400, "tokens", "invalid_type"),
    refusal("tokens-past-body-limit", "/detokenize", {"tokens": TOKENS_PAST_LIMIT}, 413, None,
            "request_too_large"),
    refusal("prompt-past-body-limit", "/tokenize", {"prompt": "x" * BODY_LIMIT}, 413, None,
            "request_too_large"),
    refusal("not-json", "/tokenize", "{", 400, None, "json_invalid"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "status", "param", "code"), REFUSALS)
def test_a_refusal_names_its_field_and_changes_nothing(
    live: Live, route: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    assert len(live.server.tokenizer) == 768, "past-vocabulary's 768 is the first id past it"
    before = live.metrics()
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(live.url + route, content=content, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    want = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["type"] == want
    rejected = unchanged(before, live.metrics())
    key = f'requests_rejected_total{{status="{status}"}}'
    assert rejected[key] == before.get(key, 0) + 1


@pytest.fixture
def seen(live: Live, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Each text the server's tokenizer encodes, renders or decodes: (call, thread name)."""
    tokenizer = live.server.tokenizer
    calls: list[tuple[str, str]] = []
    for name in ("encode", "apply_chat_template", "decode"):
        real = getattr(tokenizer, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, spy)
    return calls


def test_a_long_text_is_refused_before_tokenizing_and_work_runs_on_the_pool(
    live: Live, seen: list[tuple[str, str]]
) -> None:
    limit = live.server.max_prompt_chars
    before = live.metrics()
    long: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "x" * (limit + 1)}, "prompt"),
        ({"messages": [{"role": "user", "content": "x" * (limit + 1)}]}, "messages"),
    ]
    for body, param in long:
        r = post(live.url, "/tokenize", {"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["code"] == "prompt_too_long"
        assert "--max-prompt-chars" in r.json()["error"]["message"]
    unchanged(before, live.metrics())
    assert seen == []
    # at the limit it is tokenized (no max_model_len here: vLLM's route reports the length)
    out = tokenize(live.url, {"prompt": "x" * limit})
    assert out["count"] > out["max_model_len"]
    tokenize(live.url, {"messages": CONVERSATIONS[0]})
    detokenize(live.url, [5, 6])
    assert [name for name, _ in seen] == ["encode", "apply_chat_template", "encode", "decode"]
    assert all(thread.startswith("tokenize-") for _, thread in seen), seen


def test_models_retrieve_is_the_listed_card(live: Live) -> None:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card == client.models.list().data[0] and card.id == MODEL
    assert card.model_dump()["max_model_len"] == ENGINE["max_model_len"]
    for other in ("gpt-4", MODEL + "x", f"{MODEL}/{MODEL}"):
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(other)
        assert info.value.body["param"] == "model"  # type: ignore[index]
        assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


# ---- the serve process (--engine-core process) ------------------------------------------


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the engine core, the resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_process_mode_serves_them_with_the_engine_core_stopped(
    served: tuple[str, subprocess.Popen[str]], tok: Any
) -> None:
    url, process = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=10)
    listed = client.models.list().data[0]
    max_model_len = listed.model_dump()["max_model_len"]
    assert isinstance(max_model_len, int) and max_model_len > 0
    cores = children(process.pid)
    assert cores, "the engine core process was not found"
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):  # the engine is stopped indeed
            body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
            httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
        for text in TEXTS:
            out = tokenize(url, {"model": SERVED, "prompt": text}, headers=AUTH)
            assert out["tokens"] == tok.encode(text) and out["max_model_len"] == max_model_len
            plain = tokenize(
                url, {"model": SERVED, "prompt": text, "add_special_tokens": False}, headers=AUTH
            )
            assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
            r = post(url, "/detokenize", {"model": SERVED, "tokens": plain["tokens"]}, headers=AUTH)
            assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
        assert client.models.retrieve(SERVED) == listed and listed.id == SERVED
    finally:
        for pid in cores:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize(
    ("method", "route"),
    [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", f"/v1/models/{SERVED}")],
)
def test_the_new_routes_need_the_key(proc: str, method: str, route: str) -> None:
    body = {"model": SERVED, "prompt": "hi"} if route == "/tokenize" else {"tokens": [5]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, proc + route, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, proc + route, json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def test_chat_without_a_template_is_the_chat_routes_400(proc: str) -> None:
    body = {"model": SERVED, "messages": CONVERSATIONS[0]}
    chat = post(proc, "/v1/chat/completions", body, headers=AUTH).json()["error"]
    r = post(proc, "/tokenize", body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == chat["param"] == "messages"
    assert "--chat-template" in error["message"] and "--chat-template" in chat["message"]
    client = openai.OpenAI(base_url=proc + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny")
