"""The core client's own faults, with a stand-in process and pipe (a real core cannot be
made to lose its engine thread, or to send an unreadable message, on demand):

* a core whose engine thread died (``fatal``) is ended, so the reader sees its pipe close
  and restarts it or reports the death (it used to stay up: a 503 server forever);
* a message the reader cannot unpickle ends the core the same way;
* a message that cannot be handled is logged, and the reader reads on;
* ``stop()`` asks a core whose engine thread died to end (it may still read its pipe);
* a dead core's requests are each reported ended (the metrics, DP's load counts);
* ``stop()`` while a restart loads ends the new core: nothing is left running."""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
from typing import Any

import pytest

from paged_engine.entrypoints import core_client
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.sampling_params import SamplingParams


class FakeProcess:
    def __init__(self) -> None:
        self.ended = threading.Event()
        self.terminated = 0
        self.exitcode: int | None = None
        self.pid = 12345

    def is_alive(self) -> bool:
        return not self.ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.ended.wait(timeout)

    def terminate(self) -> None:
        self.terminated += 1
        self.exitcode = -15
        self.ended.set()

    kill = terminate


class FakeConn:
    """Hands out ``messages`` in order; an exception in it is raised; once they are used
    up, it waits for its process to end and then reads EOF."""

    def __init__(self, process: FakeProcess, messages: list[Any]) -> None:
        self.process = process
        self.messages = messages
        self.sent: list[Any] = []
        self.closed = False

    def recv(self) -> Any:
        if self.messages:
            m = self.messages.pop(0)
            if isinstance(m, EOFError):  # the process died: killed
                self.process.exitcode = -9
                self.process.ended.set()
            if isinstance(m, BaseException):
                raise m
            return m
        self.process.ended.wait(10)
        raise EOFError

    def poll(self, timeout: float) -> bool:
        return bool(self.messages) or self.process.ended.wait(timeout)

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def close(self) -> None:
        self.closed = True


class FakeCoreClient(CoreClient):
    def __init__(self, scripts: list[list[Any]], restarts: int = 0) -> None:
        self.deaths: list[str] = []
        super().__init__(CoreSpec("fake"), restarts=restarts, on_death=self.deaths.append)
        self.scripts = scripts
        self.spawned: list[tuple[FakeProcess, FakeConn]] = []
        self.spawn_started = threading.Event()

    def _spawn(self) -> tuple[Any, Any]:
        process = FakeProcess()
        conn = FakeConn(process, self.scripts.pop(0))
        self.spawned.append((process, conn))
        self.spawn_started.set()
        return process, conn


READY = ("ready", None)


def test_a_fatal_engine_thread_ends_the_core_and_is_reported() -> None:
    client = FakeCoreClient([[READY, ("fatal", "the engine thread died: boom")]])
    client.launch()
    client._read()  # returns once the core is dead and not restarted
    process, conn = client.spawned[0]
    assert process.terminated == 1 and conn.closed
    assert client.deaths == ["the engine thread died: boom"]
    assert not client.alive


def test_a_fatal_engine_thread_is_restarted_when_asked() -> None:
    scripts: list[list[Any]] = [[READY, ("fatal", "boom")], [READY, EOFError()]]
    client = FakeCoreClient(scripts, restarts=1)
    client.launch()
    reader = threading.Thread(target=client._read)
    reader.start()
    reader.join(10)
    assert len(client.spawned) == 2 and client.spawned[0][0].terminated == 1
    assert client.spawned[0][1].closed  # the replaced core's pipe
    assert client.restarts_left == 0
    assert client.deaths and "boom" not in client.deaths[-1]  # the second core's death


def test_an_unreadable_message_ends_the_core() -> None:
    client = FakeCoreClient([[READY, pickle.UnpicklingError("garbage")]])
    client.launch()
    reader = threading.Thread(target=client._read)  # an escaping error ends only it
    reader.start()
    reader.join(10)
    process, _ = client.spawned[0]
    assert process.terminated == 1
    assert client.deaths == ["the engine core process died (exit code -15)"]


def test_stop_during_a_restart_ends_the_new_core() -> None:
    scripts = [[READY, EOFError()], []]  # the second core never becomes ready
    client = FakeCoreClient(scripts, restarts=1)
    client.launch()
    client.spawn_started.clear()
    reader = threading.Thread(target=client._read)
    reader.start()
    assert client.spawn_started.wait(10)  # the restart is loading
    assert client.stop(1.0)
    reader.join(10)
    assert not reader.is_alive()
    new, new_conn = client.spawned[1]
    assert new.terminated >= 1 and new_conn.closed
    assert client._process is client.spawned[0][0]  # the new core never served
    assert client.deaths == []  # a stop is not a death


def test_a_message_that_cannot_be_handled_is_logged_and_reading_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger=core_client.log.name)
    core_client.log.addHandler(caplog.handler)  # whatever an earlier test did to propagation
    bad = ("observe", "no_such_method", ())  # the observer has no such method
    after: Any = object()
    client = FakeCoreClient([[READY, bad, ("snapshot", after), EOFError()]])
    client.launch()
    reader = threading.Thread(target=client._read)  # an escaping error ends only it
    reader.start()
    reader.join(10)
    assert client.snapshot is after  # the next message was still read
    assert client.deaths == ["the engine core process died (exit code -9)"]
    core_client.log.removeHandler(caplog.handler)
    assert "could not be handled" in caplog.text


def test_stop_asks_a_core_whose_engine_thread_died_to_end() -> None:
    client = FakeCoreClient([[READY]])
    client.launch()
    client.fatal = "the engine thread died: boom"  # its process still reads its pipe
    client.stop(0.1)
    assert ("stop",) in client.spawned[0][1].sent


class RecordingObserver:
    def __init__(self) -> None:
        self.ends: list[tuple[str, str]] = []

    def added(self, request_ids: list[str], arrival_time: float) -> None:
        return None

    def output(self, out: Any) -> None:
        return None

    def ended(self, request_id: str, how: str) -> None:
        self.ends.append((request_id, how))


def test_a_dead_cores_requests_are_reported_ended() -> None:
    """The metrics and DP's load counts hear of each request a dead core took along."""
    client = FakeCoreClient([[READY, EOFError()]])
    observer = RecordingObserver()
    client.observer = observer
    client.launch()
    sink: asyncio.Queue[Any] = asyncio.Queue()
    requests: list[tuple[str, object, SamplingParams]] = [
        (r, [1, 2, 3], SamplingParams(max_tokens=4)) for r in ("a", "b")
    ]
    client.streams.open(1, sink, requests)
    client._read()
    assert sorted(observer.ends) == [("a", "failed"), ("b", "failed")]
