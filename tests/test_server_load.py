"""The server under concurrent load, disconnects and engine faults, against a live uvicorn
on 127.0.0.1 with the official ``openai`` client: 64 concurrent streams equal to offline
generation with no block leaked; closed streams and vanished non-streaming clients
aborted and their blocks freed within a second (``/metrics``); a failed engine step
retried without changing any output, repeated failures turned into 500s for the requests
in flight while the server keeps serving; and the engine touched by one thread only."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_engine import LLM, SamplingParams
from tests.test_server_support import ENGINE, MODEL, PROMPTS, Live, live_server

pytestmark = pytest.mark.timeout(120)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    with live_server(tiny_model_dir, max_step_failures=3) as server:
        yield server


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, **ENGINE)


def idle(m: dict[str, float]) -> bool:
    return m["num_requests_running"] == m["num_requests_waiting"] == m["kv_blocks_in_use"] == 0


def workload(n: int) -> list[tuple[str, int]]:
    """``n`` prompts (some sharing a prefix) with 8-23 new tokens each."""
    return [(f"{PROMPTS[i % 8]} {PROMPTS[(i * 3) % 8]} #{i}", 8 + (i * 7) % 16) for i in range(n)]


async def stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> list[int] | str:
    """The streamed token ids, or the error that ended the stream."""
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body=EXTRA,
        )
        ids: list[int] = []
        async for chunk in stream:
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids
    except openai.APIError as e:
        return f"error: {e.message}"


def stream_all(live: Live, work: list[tuple[str, int]]) -> list[list[int] | str]:
    """Every request of ``work`` streamed at once (bounded: 60 s in all)."""

    async def run() -> list[list[int] | str]:
        client = openai.AsyncOpenAI(
            base_url=live.url + "/v1", api_key="x", timeout=60, max_retries=0
        )
        async with client:
            return await asyncio.gather(*(stream_one(client, p, m) for p, m in work))

    return asyncio.run(asyncio.wait_for(run(), 60))


def offline_tokens(offline: LLM, work: list[tuple[str, int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    outs = offline.generate([p for p, _ in work], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_concurrent_streams(live: Live, offline: LLM, n: int) -> None:
    """``n`` concurrent streams equal offline generation; afterwards nothing is held, and
    the engine was touched by the loop's thread alone."""
    work = workload(n)
    want = offline_tokens(offline, work)
    finished = 'requests_total{outcome="finished"}'
    before = live.metrics()
    assert stream_all(live, work) == want
    after = live.wait_metrics(idle)
    assert idle(after), after
    assert after[finished] - before.get(finished, 0) == n
    ttft = "time_to_first_token_seconds_count"
    assert after[ttft] - before.get(ttft, 0) == n
    assert live.engine.threads == {live.server.loop.thread_id}


def test_64_concurrent_streams_equal_offline_and_leak_no_block(live: Live, offline: LLM) -> None:
    check_concurrent_streams(live, offline, 64)


def test_closed_streams_are_aborted_and_their_blocks_freed_within_a_second(live: Live) -> None:
    check_closed_streams(live)


def check_closed_streams(live: Live) -> None:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", timeout=30, max_retries=0)
    streams = [
        client.completions.create(
            model=MODEL,
            prompt=f"{p} {i}",
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body=EXTRA,
        )
        for i, p in enumerate(PROMPTS * 2)
    ]
    for s in streams:  # a few tokens each
        for _ in range(3):
            next(s)
    running = live.metrics()
    assert running["num_requests_running"] + running["num_requests_waiting"] == 16
    aborted_before = running.get('requests_total{outcome="aborted"}', 0)
    for s in streams[:8]:
        s.close()
    t0 = time.monotonic()
    # within a second: the bound on an abort reaching the engine
    half = live.wait_metrics(
        lambda m: m["num_requests_running"] + m["num_requests_waiting"] == 8, timeout=1.0
    )
    # the aborts went through the engine loop's thread
    assert live.engine.threads == {live.server.loop.thread_id}, "engine touched by 2 threads"
    assert half["num_requests_running"] + half["num_requests_waiting"] == 8, half
    assert half.get('requests_total{outcome="aborted"}', 0) - aborted_before == 8
    # the survivors hold at most their own blocks: ceil((prompt + 400) / 8) each
    assert 0 < half["kv_blocks_in_use"] <= 8 * (20 + 400) // 8
    for s in streams[8:]:
        s.close()
    done = live.wait_metrics(idle, timeout=2.0)
    assert idle(done) and time.monotonic() - t0 < 2.0, done


def test_a_vanished_client_of_a_non_streamed_request_is_aborted(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    before = live.metrics().get('requests_total{outcome="aborted"}', 0)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True}
    uvicorn_log = logging.getLogger("uvicorn.error")  # it does not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            with pytest.raises(httpx.ReadTimeout):
                timeout = httpx.Timeout(5, read=0.3)
                httpx.post(live.url + "/v1/completions", json=body, timeout=timeout)
            m = live.wait_metrics(idle)
            # the route has returned (its abort is what freed the blocks) and logged
            # whatever it had to; a served request afterwards shows the loop is free
            r = httpx.post(live.url + "/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert idle(m) and m['requests_total{outcome="aborted"}'] - before == 1, m
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, [(r.getMessage(), r.exc_info) for r in problems]


def test_a_failed_step_is_retried_without_changing_any_output(live: Live, offline: LLM) -> None:
    check_retried_fault(live, offline)


def check_retried_fault(live: Live, offline: LLM) -> None:
    """Two failed steps in a row, once every stream has sent tokens (so none can be run
    again unseen): retried, every output as without the fault."""
    work = [(p, 40 + (i * 7) % 16) for i, (p, _) in enumerate(workload(6))]
    want = offline_tokens(offline, work)
    failed_before = live.metrics()["engine_failed_steps_total"]
    live.runner.decode_batch = len(work)  # all of them decoding: each has streamed a token
    live.runner.fail_next = 2  # fewer than max_step_failures in a row
    try:
        got = stream_all(live, work)
    finally:
        live.runner.fail_next, live.runner.decode_batch = 0, None
    assert got == want
    m = live.wait_metrics(idle)
    assert live.runner.failed >= 2 and m["engine_failed_steps_total"] - failed_before == 2
    assert idle(m)


def test_repeated_step_failures_fail_the_requests_in_flight_and_the_server_recovers(
    live: Live,
) -> None:
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", timeout=30, max_retries=0)
    failed_before = live.metrics().get('requests_total{outcome="failed"}', 0)
    live.runner.fail_next = 10**9
    errors: dict[str, Any] = {}

    def plain() -> None:
        try:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8)
        except openai.APIStatusError as e:
            errors["plain"] = e

    def streamed() -> None:
        try:
            for _ in client.completions.create(
                model=MODEL, prompt=PROMPTS[2], max_tokens=8, stream=True
            ):
                pass
        except openai.APIError as e:
            errors["stream"] = e

    threads = [threading.Thread(target=f) for f in (plain, streamed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    live.runner.fail_next = 0
    assert isinstance(errors.get("plain"), openai.InternalServerError), errors
    assert (
        errors["plain"].status_code == 500 and "failed 3 steps in a row" in errors["plain"].message
    )
    assert errors["plain"].type == "server_error"
    assert "failed 3 steps in a row" in errors["stream"].message
    m = live.wait_metrics(idle)
    assert idle(m) and m['requests_total{outcome="failed"}'] - failed_before == 2
    # the engine serves again
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 5
    assert httpx.get(live.url + "/health").status_code == 200


def test_a_dead_engine_loop_fails_its_requests_and_health_says_so(live: Live) -> None:
    """Last: it ends the module's engine loop."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", timeout=30, max_retries=0)
    live.runner.fatal = True
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    assert "the engine loop died" in info.value.message and "Fatal" in info.value.message
    assert httpx.get(live.url + "/health").status_code == 503
    with pytest.raises(openai.APIStatusError) as later:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
    assert later.value.status_code == 503 and "the engine loop died" in later.value.message
