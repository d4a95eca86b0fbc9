"""Broken servers the server tests must catch: each mutant is patched into one live server
(an instance attribute of its engine loop, or a name the routes look up per request), run
through the same check as the real test, and caught only by that check's assertion."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

import paged_engine.entrypoints.openai_requests as openai_requests
import paged_engine.entrypoints.openai_server as openai_server
from paged_engine import LLM
from paged_engine.entrypoints.formatters import ChatFormatter, CompletionFormatter
from paged_engine.entrypoints.serving import param_of
from tests.test_server import check_bad_request, check_stream
from tests.test_server_equality import chat_body, check_equal
from tests.test_server_load import check_closed_streams, check_retried_fault, idle
from tests.test_server_support import ENGINE, TEMPLATE, Live, live_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir, max_step_failures=3, chat_template=TEMPLATE) as server:
        yield server


@pytest.fixture
def clean(live: Live) -> Iterator[Live]:
    """The live server, idle again after the mutant (its requests may run on)."""
    yield live
    live.runner.fail_next = 0
    assert idle(live.wait_metrics(idle, timeout=20)), "the server did not become idle"


def test_a_loop_that_never_aborts_is_caught(clean: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clean.server.loop, "abort", lambda request_ids: None)
    with pytest.raises(AssertionError, match=r"\) == 8"):
        check_closed_streams(clean)


def test_giving_up_on_the_first_failed_step_is_caught(
    clean: Live, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clean.server.loop._routes.quarantine, "threshold", 1)
    with pytest.raises(AssertionError, match="error: the engine failed 1 steps"):
        check_retried_fault(clean, LLM(tiny_model_dir, **ENGINE))


class FirstChunkLost(CompletionFormatter):
    def chunks(self, out: Any) -> list[str]:
        chunks = super().chunks(out)
        return chunks[1:] if len(self._started) <= 1 and len(self._done) == 0 else chunks


def test_a_stream_that_loses_a_chunk_is_caught(
    clean: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_requests, "CompletionFormatter", FirstChunkLost)
    client = openai.OpenAI(base_url=clean.url + "/v1", api_key="x", timeout=30, max_retries=0)
    with pytest.raises(AssertionError):
        check_stream(client, {})


class ChatStopReasonLost(ChatFormatter):
    """Streamed chat chunks with ``stop_reason`` null where the whole response has it."""

    def chunks(self, out: Any) -> list[str]:
        return super().chunks(
            replace(out, outputs=[replace(c, stop_reason=None) for c in out.outputs])
        )


def test_a_chat_stream_that_drops_the_stop_reason_is_caught(
    clean: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = chat_body(clean, {"stop": "STOP"})
    monkeypatch.setattr(openai_requests, "ChatFormatter", ChatStopReasonLost)
    with pytest.raises(AssertionError, match="stop_reason None streamed"):
        check_equal(clean, "chat/completions", body)


def test_an_error_blaming_the_wrong_field_is_caught(
    clean: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_server, "refused_field", lambda e, rename: "prompt")
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 100000}'
    with pytest.raises(AssertionError, match="'param': 'prompt'"):
        check_bad_request(clean, "completions", body, "max_tokens", None)
    assert param_of("prompt (1 tokens) + max_tokens (9) exceeds max_model_len (8)") == "max_tokens"


# Last: touching the engine from two threads may leave it inconsistent.
def test_an_abort_from_the_event_loop_thread_is_caught(
    clean: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = clean.server.loop

    def abort_here(request_ids: Any) -> None:  # touches the engine from the caller's thread
        for r in request_ids:
            loop._routes._routes.pop(r, None)
        loop._engine.abort_request(list(request_ids))

    monkeypatch.setattr(loop, "abort", abort_here)
    with pytest.raises(AssertionError, match="engine touched by 2 threads"):
        check_closed_streams(clean)
    clean.engine.threads.clear()
