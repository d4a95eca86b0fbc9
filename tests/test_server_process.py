"""``paged-engine serve`` as a process: flags refused by name before the model loads; then a
live server (ephemeral port, key from ``PAGED_ENGINE_API_KEY``) answering 401 without the
key on every route but ``/health``, a 400 for chat without a template, 503 beyond
``--max-queue``; and SIGTERM while streams run: the streams end and the process exits 0
within its bounded time, under load too (``shutdown_timeout + SHUTDOWN_BOUND_S``)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_engine.__main__ import main as cli
from paged_engine.entrypoints.server_runtime import SHUTDOWN_BOUND_S
from tests.test_server_support import MODEL, PROMPTS, serve_process

pytestmark = pytest.mark.timeout(120)
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_CONTEXT = 65536
LONG_TOKENS = 60_000
"""New tokens a long request asks for: far more than any CPU makes in the seconds a test
waits, so such a request is still in flight when a test needs it to be (a shorter one once
finished within a grace period on a fast CPU: see the load test below)."""
LONG = dict(
    model=MODEL,
    max_tokens=LONG_TOKENS,
    temperature=0,
    stream=True,
    extra_body={"ignore_eos": True},
)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port must be an int in [0, 65535], got 70000"),
        (["--max-queue", "0"], "--max-queue: must be an int >= 1, got 0"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a finite number >= 0"),
        (["--chat-template", "no/such/file"], "--chat-template: 'no/such/file' is neither"),
        (["--api-key", ""], "--api-key must be a non-empty string"),
        (["--block-size", "0"], "--block-size must be an int >= 1, got 0"),
        (["--log-level", "loud"], "--log-level: invalid choice"),
        (["--max-prompt-chars", "0"], "--max-prompt-chars: must be an int >= 1, got 0"),
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes: must be an int >= 1"),
    ],
)
def test_bad_serve_flags_are_refused_by_name_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        cli(["serve", "/nonexistent/model", *flags])  # the model would be the error otherwise
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_help_shows_the_server_flags_and_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli(["serve", "--help"])
    out = capsys.readouterr().out
    for text in ("--host HOST", "(default: 127.0.0.1)", "--max-queue N", "(default: 1024)",
                 "PAGED_ENGINE_API_KEY", "--max-model-len", "--block-size", "--max-prompt-chars N",
                 "--max-request-body-bytes N", "(default: 16777216)"):  # fmt: skip
        assert text in out, text


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for ``LONG_TOKENS`` new tokens."""
    from paged_engine.utils.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-long") / "model"
    return make_tiny_model(out, seed=0, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def untemplated(long_context_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The long-context tiny model without the chat template ``make_tiny_model`` writes."""
    dst = tmp_path_factory.mktemp("untemplated") / "m"
    path = Path(shutil.copytree(long_context_model_dir, dst))
    (path / "chat_template.jinja").unlink()
    return path


@pytest.fixture(scope="module")
def served(untemplated: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """One server process for the module (its start costs seconds); the SIGTERM test,
    last, ends it."""
    flags = ["--max-queue", "4", "--shutdown-timeout", "0.5"]
    flags += ["--max-model-len", str(LONG_CONTEXT), "--num-kv-blocks", "8192"]
    with serve_process(untemplated, *flags, env={"PAGED_ENGINE_API_KEY": KEY}) as served:
        yield served


@pytest.fixture
def proc(served: tuple[str, subprocess.Popen[str]]) -> str:
    assert served[1].poll() is None, "the server process has exited"
    return served[0]


@pytest.mark.parametrize(
    ("method", "route"),
    [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/nowhere"),
    ],
)
def test_every_route_but_health_needs_the_key(proc: str, method: str, route: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, proc + route, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert (
        httpx.request(method, proc + route, json=body, headers=AUTH, timeout=10).status_code != 401
    )
    assert httpx.get(proc + "/health", timeout=10).status_code == 200


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(proc: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proc + "/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=proc + "/v1", api_key=KEY).models.list().data[0].id == MODEL


def test_chat_without_a_template_is_a_400_naming_the_flag(proc: str) -> None:
    client = openai.OpenAI(base_url=proc + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "--chat-template" in info.value.message and info.value.param == "messages"


def test_beyond_max_queue_the_server_answers_503(proc: str) -> None:
    client = openai.OpenAI(base_url=proc + "/v1", api_key=KEY, timeout=30, max_retries=0)
    streams = [client.completions.create(prompt=p, **LONG) for p in PROMPTS[:4]]  # type: ignore[call-overload]
    for s in streams:
        next(s)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(proc + "/v1/completions", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 503 and "--max-queue" in r.json()["error"]["message"], r.text
    for s in streams:
        s.close()
    deadline = time.monotonic() + 5
    while (
        r := httpx.post(proc + "/v1/completions", json=body, headers=AUTH, timeout=10)
    ).status_code == 503:
        assert time.monotonic() < deadline, "the closed streams were never released"
        time.sleep(0.05)
    assert r.status_code == 200


def test_sigterm_ends_the_streams_and_exits_in_bounded_time(
    served: tuple[str, subprocess.Popen[str]],
) -> None:
    """Last in the module: it stops the module's server."""
    url, process = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=30, max_retries=0)
    ends: dict[int, Any] = {}
    started = threading.Barrier(5)

    def consume(i: int) -> None:
        stream = client.completions.create(prompt=PROMPTS[i], **LONG)  # type: ignore[call-overload]
        n = 0
        try:
            for _ in stream:
                n += 1
                if n == 3:
                    started.wait(20)
            ends[i] = ("end", n)
        except openai.APIError as e:
            ends[i] = ("error", n, e.message)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(20)
    t0 = time.monotonic()
    process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads), "a stream never ended"
    assert process.wait(15) == 0
    elapsed = time.monotonic() - t0
    # each stream ran on during the grace period, then ended with the shutdown error event
    assert sorted(ends) == [0, 1, 2, 3]
    for end in ends.values():
        assert end[0] == "error" and "shutting down" in end[2] and 3 <= end[1] < LONG_TOKENS, end
    assert elapsed < 10, elapsed
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_shutdown_under_load_ends_within_its_timeout_and_the_stated_bound(
    long_context_model_dir: Path,
) -> None:
    """Sixteen clients sending request after request (half streamed), each far longer
    than ``--shutdown-timeout``, and one stalled halfway through sending its body: after
    SIGTERM the requests in flight run through the grace period, then end (an error
    event, a 503), and the process exits 0 within the timeout plus ``SHUTDOWN_BOUND_S``
    (the old server waited for the stalled client until the timeout plus 5 s, then spent
    seconds more in the interpreter's exit). Each request asks for 60,000 tokens: 1,500
    (as before) ended within the grace period on a fast CPU (AMD Zen 5), so none was in
    flight for the shutdown to end."""
    grace = 2.0
    flags = ["--shutdown-timeout", str(grace), "--max-model-len", str(LONG_CONTEXT)]
    flags += ["--num-kv-blocks", "32768"]  # 16 growing contexts are never preempted
    with serve_process(long_context_model_dir, *flags) as (url, process):
        ends: list[str] = []
        stop = threading.Event()

        def streamer(i: int) -> None:
            body = {"model": MODEL, "prompt": PROMPTS[i % 8], "max_tokens": LONG_TOKENS}
            body |= {"ignore_eos": True, "stream": True}
            while not stop.is_set():
                try:
                    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                        ends.append([line for line in r.iter_lines() if line][-2])
                except httpx.HTTPError:  # the server has closed
                    time.sleep(0.05)

        def plain(i: int) -> None:
            body = {"model": MODEL, "prompt": PROMPTS[i % 8], "max_tokens": LONG_TOKENS}
            body |= {"ignore_eos": True}
            http = httpx.Client(timeout=60)
            while not stop.is_set():
                try:
                    ends.append(http.post(url + "/v1/completions", json=body).text)
                except httpx.HTTPError:
                    time.sleep(0.05)

        threads = [threading.Thread(target=streamer, args=(i,)) for i in range(8)]
        threads += [threading.Thread(target=plain, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)))
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100000\r\n\r\n{"model": "tiny", "prompt": "'
        )
        time.sleep(3)  # load for a while
        t0 = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(grace + SHUTDOWN_BOUND_S + 30)
        elapsed = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(10)
        stalled.close()
    assert code == 0
    assert grace <= elapsed <= grace + SHUTDOWN_BOUND_S, elapsed
    # the requests in flight at the signal were ended by the shutdown
    assert sum("shutting down" in e for e in ends) >= 16, ends[-18:]
