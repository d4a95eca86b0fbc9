"""Data-parallel replicas on other hosts (``dp_remote``, ``dp_headless``), all on 127.0.0.1: a
head (``serve --data-parallel-size N --data-parallel-size-local L``) and a separate
``serve --headless`` process tree, the stand-in for a second node, serve through the
``openai`` client the text offline ``generate`` gives; a headless core with the wrong
``$PAGED_ENGINE_DP_AUTHKEY`` is refused and not counted; a missing key is refused by name
before anything starts; a head whose remote replicas do not come refuses to serve; killing
the headless tree fails the remote's in-flight request only, the head serving on with its
local replica; SIGTERM to the head ends it, and the headless cores end with their
connections (no process left, checked in /proc)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.entrypoints.cli import main
from paged_engine.entrypoints.settings import DP_AUTHKEY_ENV
from tests.test_server_support import MODEL, PROMPTS, parse_metrics

pytestmark = pytest.mark.timeout(300)
KEY = "a shared test secret"
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """``python -m paged_engine serve`` in the background, its stderr collected."""

    def __init__(self, model_dir: Path, *flags: str, key: str | None) -> None:
        cmd = [sys.executable, "-m", "paged_engine", "serve", str(model_dir), "--port", "0"]
        cmd += ["--served-model-name", MODEL, "--block-size", "8", "--threads", "1", *flags]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop(DP_AUTHKEY_ENV, None)
        if key is not None:
            env[DP_AUTHKEY_ENV] = key
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.text)
            if m:
                return m
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.text}"
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text}"
            time.sleep(0.05)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def head_flags(port: int, size: int, local: int, timeout: float = 200) -> list[str]:
    return [
        "--data-parallel-size",
        str(size),
        "--data-parallel-size-local",
        str(local),
        "--data-parallel-rpc-port",
        str(port),
        "--data-parallel-connect-timeout",
        str(timeout),
    ]


def headless_flags(port: int, local: int = 1) -> list[str]:
    return [
        "--headless",
        "--data-parallel-rpc-port",
        str(port),
        "--data-parallel-size-local",
        str(local),
    ]


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (children of any of their threads), from /proc."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(FileNotFoundError):
                todo += map(int, children.read_text().split())
    return found


def cores_of(pid: int) -> list[int]:
    """The engine cores under ``pid``: multiprocessing's spawned children, not its tracker."""
    found = []
    for p in tree(pid)[1:]:
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(p)
    return found


def all_gone(pids: list[int], within: float) -> bool:
    """Every pid ended (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for p in pids:
            try:
                state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if state != "Z":
                alive.append(p)
        if not alive:
            return True
        time.sleep(0.05)
    return False


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = False) -> Any:
    return client(url).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> list[str]:
    llm = LLM(tiny_model_dir, block_size=8, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_missing_key_is_refused_by_name_before_anything_starts(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(DP_AUTHKEY_ENV, raising=False)
    port = free_port()
    for flags in (head_flags(port, 2, 1, timeout=1), headless_flags(port)):
        argv = ["serve", str(tiny_model_dir), "--port", "0", *flags]
        with pytest.raises(SystemExit) as exit:  # argparse's: before any model loads
            main(argv)
        assert exit.value.code == 2
        assert f"set ${DP_AUTHKEY_ENV}" in capsys.readouterr().err
    with socket.socket() as s:  # nothing listened there
        s.bind(("127.0.0.1", port))


def test_a_head_whose_replicas_do_not_come_refuses_to_serve(tiny_model_dir: Path) -> None:
    head = Serve(tiny_model_dir, *head_flags(free_port(), 1, 0, timeout=2), key=KEY)
    try:
        assert head.proc.wait(60) == 1
        assert "1 of 1 remote engine cores did not connect" in head.text
        assert "serving" not in head.text
    finally:
        head.end()


def test_a_head_and_a_headless_node_serve_as_offline(
    tiny_model_dir: Path, offline: list[str]
) -> None:
    port = free_port()
    head = Serve(tiny_model_dir, *head_flags(port, 2, 1), key=KEY)
    nodes: list[Serve] = []
    try:
        nodes.append(Serve(tiny_model_dir, *headless_flags(port), key="not the key"))
        assert nodes[0].proc.wait(90) == 1  # its core was refused before loading anything
        assert f"refused this core's key (${DP_AUTHKEY_ENV}" in nodes[0].text
        head.wait_for("refused an engine core", 10)  # not counted: the head waits on
        assert head.proc.poll() is None and "serving" not in head.text

        nodes.append(Serve(tiny_model_dir, *headless_flags(port), key=KEY))
        url = head.wait_for(r"serving .* on (http://\S+)", 180)[1]
        assert [complete(url, p).choices[0].text for p in PROMPTS] == offline
        [core] = cores_of(nodes[1].proc.pid)

        # Two long streams at once, on prompts no replica has seen: the second goes to the
        # least loaded replica, the other one (a prompt seen before would follow its blocks).
        fresh = ["Sailing ships of the northern seas", "Zero, one, two, three"]
        streams = [complete(url, p, max_tokens=1000, stream=True) for p in fresh]
        chunks = [iter(s) for s in streams]
        for c in chunks:
            next(c)
        doomed = tree(nodes[1].proc.pid)
        os.kill(core, signal.SIGKILL)  # the second node goes down, its tree with it
        nodes[1].proc.kill()
        assert all_gone(doomed, 15)
        finished, failed = [], []
        for c in chunks:
            try:
                finished.append(list(c)[-1].choices[0].finish_reason)
            except openai.APIError as err:
                failed.append(str(err))
        assert finished == ["length"], (finished, failed)  # the local replica's, run on
        assert len(failed) == 1, failed  # the remote's, and only it
        assert re.search(r"the remote engine core at 127\.0\.0\.1:\d+ disconnected", failed[0])
        assert complete(url, PROMPTS[1]).choices[0].text == offline[1]
        assert httpx.get(url + "/health").status_code == 200
        shown = parse_metrics(httpx.get(url + "/metrics").text)  # still read, and counting
        assert shown["generation_tokens_total"] >= MAX_TOKENS * (len(PROMPTS) + 1) + 1000
        assert head.proc.poll() is None
    finally:
        head.end()
        for node in nodes:
            node.end()


def test_sigterm_to_the_head_ends_the_headless_cores(
    tiny_model_dir: Path, offline: list[str]
) -> None:
    """A head that runs no core itself (L = 0) and a node running both replicas."""
    port = free_port()
    head = Serve(tiny_model_dir, *head_flags(port, 2, 0), key=KEY)
    node = Serve(tiny_model_dir, *headless_flags(port, local=2), key=KEY)
    try:
        url = head.wait_for(r"serving .* on (http://\S+)", 180)[1]
        assert [complete(url, p).choices[0].text for p in PROMPTS[:2]] == offline[:2]
        node_tree = tree(node.proc.pid)
        assert len(cores_of(node.proc.pid)) == 2
        head.proc.send_signal(signal.SIGTERM)
        assert head.proc.wait(20) == 0
        assert node.proc.wait(20) == 0  # its cores were stopped by the head and ended
        assert all_gone(node_tree, 10)
    finally:
        head.end()
        node.end()


def test_a_silent_connection_does_not_keep_a_headless_core_out(
    tiny_model_dir: Path, offline: list[str]
) -> None:
    """A TCP connection that never says a word reaches the head first: the headless core
    after it still joins (long before the connect timeout), and the head drops the silent
    one (``dp_headless.AUTH_TIMEOUT_S``)."""
    port = free_port()
    head = Serve(tiny_model_dir, *head_flags(port, 1, 0, timeout=150), key=KEY)
    node: Serve | None = None
    silent: socket.socket | None = None
    try:
        deadline = time.monotonic() + 60
        while silent is None:  # the head listens once its tokenizer is loaded
            try:
                silent = socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:
                assert head.proc.poll() is None and time.monotonic() < deadline, head.text
                time.sleep(0.1)
        node = Serve(tiny_model_dir, *headless_flags(port), key=KEY)
        url = head.wait_for(r"serving .* on (http://\S+)", 120)[1]
        assert complete(url, PROMPTS[0]).choices[0].text == offline[0]
        silent.settimeout(30)
        while silent.recv(4096):  # the challenge, then the end: dropped
            pass
    finally:
        head.end()
        if node is not None:
            node.end()
        if silent is not None:
            silent.close()
