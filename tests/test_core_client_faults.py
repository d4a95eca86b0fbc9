"""The core client's own faults, with a stand-in process and pipe (a real core cannot be
made to lose its engine thread, or to send an unreadable message, on demand):

* a core whose engine thread died (``fatal``) is ended, so the reader sees its pipe close
  and restarts it or reports the death (it used to stay up: a 503 server forever);
* a message the reader cannot unpickle ends the core the same way;
* ``stop()`` while a restart loads ends the new core: nothing is left running."""

from __future__ import annotations

import pickle
import threading
from typing import Any

from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec


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
    scripts = [[READY, ("fatal", "boom")], [READY, EOFError()]]
    client = FakeCoreClient(scripts, restarts=1)
    client.launch()
    reader = threading.Thread(target=client._read)
    reader.start()
    reader.join(10)
    assert len(client.spawned) == 2 and client.spawned[0][0].terminated == 1
    assert client.restarts_left == 0
    assert client.deaths and "boom" not in client.deaths[-1]  # the second core's death


def test_an_unreadable_message_ends_the_core() -> None:
    client = FakeCoreClient([[READY, pickle.UnpicklingError("garbage")]])
    client.launch()
    client._read()
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
