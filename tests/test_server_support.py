"""Helpers of the server tests (no tests here): a live server on 127.0.0.1 in a thread of
the test process (uvicorn on a real socket, ephemeral port) or as a ``paged-engine serve``
subprocess, ``/metrics`` parsed, and two test doubles around the engine: one that
records which threads touch it, one whose model runner raises on demand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from paged_engine import LLM
from paged_engine.entrypoints.openai_server import OpenAIServer
from paged_engine.entrypoints.server_runtime import DrainingServer, uvicorn_config
from paged_engine.entrypoints.settings import ServerSettings

MODEL = "tiny"
ENGINE = dict(block_size=8, num_kvcache_blocks=512, max_model_len=512)
TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "To make a cup of tea, boil",
    "Computers store numbers in",
    "The weather today is",
    "Question: what is the capital of France? Answer:",
    "Dear team, thank you for",
    "Mathematics is the language of",
]


class RecordingEngine:
    """The real engine, noting the thread of every attribute access."""

    def __init__(self, engine: Any) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "threads", set())

    def __getattr__(self, name: str) -> Any:
        self.threads.add(threading.get_ident())
        return getattr(self._engine, name)


class Fatal(BaseException):
    """Not an ``Exception``: what the engine loop cannot recover from."""


class FlakyRunner:
    """The real model runner, raising ``RuntimeError`` on its next ``fail_next`` runs (or,
    with ``decode_batch`` set, on its next ``fail_next`` decode runs of at least that many
    sequences), or ``Fatal`` on every run while ``fatal``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail_next = 0
        self.decode_batch: int | None = None
        self.failed = 0
        self.fatal = False
        self._lock = threading.Lock()

    def run(self, seqs: Any, is_prefill: bool) -> Any:
        if self.fatal:
            raise Fatal("injected fatal fault")
        batch = self.decode_batch
        with self._lock:
            if self.fail_next > 0 and (batch is None or (not is_prefill and len(seqs) >= batch)):
                self.fail_next -= 1
                self.failed += 1
                raise RuntimeError("injected model fault")
        return self.inner.run(seqs, is_prefill)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Live:
    url: str
    server: OpenAIServer
    engine: RecordingEngine
    runner: FlakyRunner

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5).text)

    def wait_metrics(self, pred: Any, timeout: float = 10.0) -> dict[str, float]:
        """Poll ``/metrics`` until ``pred(metrics)``; the last metrics either way. The
        default is generous (a loaded CI machine); latency checks pass their own bound."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if pred(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` from Prometheus' text format (no comments)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("paged_engine_")] = float(value)
    return out


@contextmanager
def live_server(
    model_dir: Path, server_cls: type[OpenAIServer] = OpenAIServer, **settings: Any
) -> Iterator[Live]:
    """An in-process server (uvicorn in a thread) on the tiny model, with the doubles."""
    llm = LLM(model_dir, **ENGINE)
    engine = llm.llm_engine
    runner = FlakyRunner(engine.model_runner)
    engine.model_runner = runner
    recording = RecordingEngine(engine)
    server = server_cls(
        recording,  # type: ignore[arg-type]
        ServerSettings(served_model_name=MODEL, port=0, log_level="warning", **settings),
        tokenizer=llm.tokenizer,
        max_model_len=llm.config.max_model_len,
    )
    uv = DrainingServer(uvicorn_config(server), server)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while uv.address is None:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Live(f"http://127.0.0.1:{uv.address[1]}", server, recording, runner)
    finally:
        uv.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"


@contextmanager
def serve_process(
    model_dir: Path, *flags: str, env: dict[str, str] | None = None, new_session: bool = False
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``python -m paged_engine serve`` on an ephemeral port (in a session and process group
    of its own with ``new_session``); (url, process)."""
    cmd = [sys.executable, "-m", "paged_engine", "serve", str(model_dir), "--port", "0"]
    cmd += ["--served-model-name", MODEL, "--block-size", "8", "--threads", "1", *flags]
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        start_new_session=new_session,
    )
    lines: list[str] = []
    url: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                url.append(m[1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 90
    while not url:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("serve did not start:\n" + "".join(lines))
        time.sleep(0.05)
    try:
        yield url[0], proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
