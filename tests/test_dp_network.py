"""The head-headless connection (``dp_remote.CoreListener``, ``dp_headless``): a
connection that says nothing is dropped after ``AUTH_TIMEOUT_S`` and holds no real core
off meanwhile (nor do more silent ones than the listener authenticates at once); a head
that says nothing does not hold a headless core forever; both ends of a real connection
carry the keepalive options; and, in a network namespace of its own whose loopback is then
taken down (a peer that vanishes without closing), the head counts the remote replica
dead, and the core its head gone, within the keepalive bound."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from paged_engine.entrypoints import dp_headless, dp_remote
from paged_engine.entrypoints.dp_headless import connect_to_head
from paged_engine.entrypoints.dp_remote import CoreListener

pytestmark = pytest.mark.timeout(120)
KEY = b"a shared test secret"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[CoreListener]:
    monkeypatch.setattr(dp_headless, "AUTH_TIMEOUT_S", 0.5)
    listener = CoreListener(("127.0.0.1", 0), KEY)
    yield listener
    listener.close()


def address_of(listener: CoreListener) -> tuple[str, int]:
    host, port = listener.address.rsplit(":", 1)
    return host, int(port)


def accepted(listener: CoreListener, within: float) -> tuple[Connection, str]:
    item = listener._accepted.get(timeout=within)
    assert item is not None
    return item


def closed_after(sock: socket.socket, within: float) -> float:
    """Seconds until the peer closed ``sock`` (what it sent before is read and dropped)."""
    started = time.monotonic()
    sock.settimeout(within)
    while sock.recv(4096):
        pass
    return time.monotonic() - started


def test_a_silent_connection_holds_no_core_off_and_is_dropped(
    listener: CoreListener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dp_headless, "AUTH_TIMEOUT_S", 2.0)
    silent = socket.create_connection(address_of(listener))
    time.sleep(0.1)  # accepted first: the old listener then waited on it, unbounded
    started = time.monotonic()
    conn = connect_to_head(address_of(listener), KEY, timeout=5)
    head_conn, peer = accepted(listener, within=5)
    assert time.monotonic() - started < 1.0  # not after the silent one's 2 s
    assert peer.startswith("127.0.0.1:")
    head_conn.send(("ping", 1))
    assert conn.recv() == ("ping", 1)
    assert 0.5 < closed_after(silent, within=5) < 2.5  # dropped at its deadline
    silent.close()
    conn.close()
    head_conn.close()


def test_more_silent_connections_than_slots_still_let_a_core_in(
    listener: CoreListener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every slot taken the next connection is closed at once; the core retries."""
    monkeypatch.setattr(dp_remote, "MAX_AUTHENTICATING", 2)
    small = CoreListener(("127.0.0.1", 0), KEY)
    try:
        silent = [socket.create_connection(address_of(small)) for _ in range(3)]
        assert closed_after(silent[2], within=5) < 0.3  # no slot: closed unread
        conn = connect_to_head(address_of(small), KEY, timeout=10)
        head_conn, _ = accepted(small, within=5)
        head_conn.send("in")
        assert conn.recv() == "in"
        for s in silent:
            s.close()
        conn.close()
        head_conn.close()
    finally:
        small.close()


def test_a_silent_head_does_not_hold_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_headless, "AUTH_TIMEOUT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts (backlog), says nothing
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"no key handshake within 0\.3 s"):
            connect_to_head(server.getsockname(), KEY, timeout=1.0)
        assert time.monotonic() - started < 3.0


def options(conn: Connection) -> tuple[int, ...]:
    sock = socket.socket(fileno=conn.fileno())
    try:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )
    finally:
        sock.detach()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux's options")
def test_both_ends_of_a_real_connection_are_kept_alive(listener: CoreListener) -> None:
    conn = connect_to_head(address_of(listener), KEY, timeout=5)
    head_conn, _ = accepted(listener, within=5)
    assert options(conn) == options(head_conn) == (1, 5, 2, 5, 15_000)
    conn.close()
    head_conn.close()


DETECTION = """
import asyncio, json, subprocess, sys, threading, time
from paged_engine.entrypoints import dp_headless
from paged_engine.entrypoints.core_process import CoreInfo
from paged_engine.entrypoints.dp_headless import connect_to_head
from paged_engine.entrypoints.dp_remote import CoreListener

dp_headless.KEEPALIVE_IDLE_S, dp_headless.KEEPALIVE_INTERVAL_S = 1, 1
dp_headless.KEEPALIVE_COUNT = 2  # dead after 3 s of silence
key = b"k"
listener = CoreListener(("127.0.0.1", 0), key)
host, port = listener.address.rsplit(":", 1)
core = connect_to_head((host, int(port)), key, timeout=5)  # the headless core's end
core.send(("ready", CoreInfo(64, 4, 1, 8, "xxh64")))
[client] = listener.replicas(1, 5)
listener.close()
client.start(asyncio.new_event_loop())
found = {}

def core_reads():
    try:
        core.recv()
    except OSError as err:
        found["core"] = [repr(err), time.monotonic() - down]

reader = threading.Thread(target=core_reads)
subprocess.run(["ip", "link", "set", "lo", "down"], check=True)  # the peer vanishes
down = time.monotonic()
reader.start()
client.abort(["sent-while-down"])  # data in flight: keepalive alone would not probe
while client.alive and time.monotonic() - down < 60:
    time.sleep(0.05)
found["head"] = [client.fatal, time.monotonic() - down]
reader.join(60)
print(json.dumps(found))
"""


def test_a_vanished_peer_is_detected_on_both_ends() -> None:
    """Needs a network namespace of its own (``unshare -rn``: an unprivileged user
    namespace will do); skipped where the kernel refuses one."""
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace here: {probe.stderr.decode().strip()}")
    script = 'ip link set lo up && exec "$0" -c "$1"'
    done = subprocess.run(
        ["unshare", "-rn", "sh", "-c", script, sys.executable, DETECTION],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    why, after = found["head"]
    assert why is not None and "the remote engine core at 127.0.0.1:" in why
    assert "disconnected" in why and after < 10, found
    error, after = found["core"]
    assert "TimeoutError" in error and after < 10, found
