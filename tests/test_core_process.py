"""``serve --engine-core process`` (the default): the engine core in a process of its own,
driven with the ``openai`` client. Its output equals offline ``generate``; a client that
disconnects has its request aborted in the core (the pool is empty again); a core that
dies fails the requests in flight, turns ``/health`` to 503 and ends the server with
status 1, or is restarted with ``--engine-core-restarts``; SIGTERM ends both processes;
a killed API process leaves no orphan core."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.errors import ModelConfigError
from tests.test_server_support import MODEL, PROMPTS, parse_metrics, serve_process

pytestmark = pytest.mark.timeout(180)
MAX_TOKENS = 12


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child (of any of its threads: a restart starts it
    from the reader thread) running multiprocessing's spawn entry point."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
            for pid in map(int, children.read_text().split()):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                    return pid
        time.sleep(0.05)
    raise AssertionError(f"no engine core process under {server_pid}")


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> list[str]:
    llm = LLM(tiny_model_dir, block_size=8, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture
def server(tiny_model_dir: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with serve_process(tiny_model_dir, "--engine-core", "process") as live:
        yield live


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_output_equals_offline_generate(
    server: tuple[str, subprocess.Popen[str]], offline: list[str]
) -> None:
    url, proc = server
    assert core_pid(proc.pid) != proc.pid
    got = client(url).completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == offline
    streamed = client(url).completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == offline[0]
    shown = parse_metrics(httpx.get(url + "/metrics").text)
    assert shown["generation_tokens_total"] == MAX_TOKENS * (len(PROMPTS) + 1)


def test_stop_strings_logprobs_and_n_are_made_in_the_api_process_as_offline(
    server: tuple[str, subprocess.Popen[str]], tiny_model_dir: Path
) -> None:
    """The API process makes the text (the core sends token ids): stop strings, logprob
    tokens and ``n`` come out as offline ``generate`` gives them, streamed or not."""
    url, _ = server
    llm = LLM(tiny_model_dir, block_size=8, num_threads=1)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    said = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    stops = [o.outputs[0].text[4:7] for o in said]
    for prompt, stop in zip(PROMPTS[:2], stops, strict=True):
        params = SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, stop=(stop,), logprobs=2
        )
        (want,) = llm.generate(prompt, params, use_tqdm=False)
        got = client(url).completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
            logprobs=2, extra_body={"ignore_eos": True},
        )  # fmt: skip
        choice = got.choices[0]
        assert (choice.text, choice.finish_reason) == (want.outputs[0].text, "stop")
        assert choice.logprobs is not None
        wanted_tokens = [next(iter(p.values())).decoded_token for p in want.outputs[0].logprobs]
        assert choice.logprobs.tokens == wanted_tokens
        streamed = client(url).completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in streamed) == want.outputs[0].text
    seeded = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True)
    (want,) = llm.generate(PROMPTS[2], seeded, use_tqdm=False)
    got = client(url).completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0.8, seed=7, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        c.text for c in want.outputs
    ]
    llm.close()


def test_a_disconnect_aborts_the_request_in_the_core(
    server: tuple[str, subprocess.Popen[str]],
) -> None:
    url, _ = server
    stream = client(url).completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while True:
        shown = parse_metrics(httpx.get(url + "/metrics").text)
        if shown.get('requests_total{outcome="aborted"}', 0) >= 1:
            break
        assert time.monotonic() < deadline, shown
        time.sleep(0.1)
    assert shown["kv_blocks_in_use"] == 0
    assert shown["generation_tokens_total"] < 400


def test_a_dead_core_fails_its_requests_and_ends_the_server(
    server: tuple[str, subprocess.Popen[str]],
) -> None:
    url, proc = server
    stream = client(url).completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    os.kill(core_pid(proc.pid), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine core process died"):
        for _ in chunks:
            pass
    assert proc.wait(20) == 1  # --engine-core-restarts 0: the server exits, status 1


def test_a_dead_core_is_restarted_when_asked(tiny_model_dir: Path, offline: list[str]) -> None:
    with serve_process(tiny_model_dir, "--engine-core-restarts", "1") as (url, proc):
        first = core_pid(proc.pid)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while core_pid(proc.pid) == first:  # then /health: it is 200 until the death is seen
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        while httpx.get(url + "/health").status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        got = client(url).completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == offline[0]


def test_sigterm_ends_both_processes(server: tuple[str, subprocess.Popen[str]]) -> None:
    _, proc = server
    core = core_pid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert gone(core, 5)


def test_a_killed_api_process_leaves_no_orphan_core(
    server: tuple[str, subprocess.Popen[str]],
) -> None:
    _, proc = server
    core = core_pid(proc.pid)
    proc.kill()
    proc.wait(5)
    assert gone(core, 15)  # its pipe closed: the core ends itself


def test_a_core_that_cannot_load_raises_what_llm_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["PhiForCausalLM"]}')
    core = CoreClient(CoreSpec(str(tmp_path)))
    with pytest.raises(ModelConfigError, match="PhiForCausalLM") as err:
        core.launch()
    assert err.value.path == str(tmp_path / "config.json")
    assert not core.alive


def test_a_cancelled_submit_s_late_answer_is_skipped() -> None:
    """The add's answer may come after its ``submit`` was cancelled: it must not raise
    (the reader thread would die) and must leave the future as it was."""
    import concurrent.futures

    core = CoreClient(CoreSpec("unused"))
    cancelled: concurrent.futures.Future[None] = concurrent.futures.Future()
    cancelled.cancel()
    core._adds[1] = cancelled
    core._handle(("added", 1, None))
    assert cancelled.cancelled() and 1 not in core._adds
