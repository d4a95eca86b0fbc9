"""Data parallelism's replicas over their lives (``dp_client``, ``dp_remote``): a replica
that dies releases its load counts (a real core killed, and the router's own sweep with no
``ended`` reported at all); replicas stop at once (N within one bound) and launch at once
(the second spawned before the first is loaded); a replica that fails to load fails the
launch with its own error and ends the one still loading (no process left); on CUDA each
local replica sees its own devices (``replica_devices``, and a real spawned child's
environment), fewer devices than replicas refused before anything starts."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import SamplingParams
from paged_engine.entrypoints import dp_client, dp_remote
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec, end_process
from paged_engine.entrypoints.dp_client import DPClient, LocalCoreClient, stop_all
from paged_engine.entrypoints.dp_headless import CUDA_VISIBLE, local_devices, replica_devices
from paged_engine.entrypoints.loop_types import RequestFailed

pytestmark = pytest.mark.timeout(240)
BLOCK = 8


def spawned_children() -> list[int]:
    """This process's engine cores: multiprocessing's spawned children, not its tracker."""
    found = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline and state != "Z":
                found.append(int(pid))
    return found


# ---- load counts -----------------------------------------------------------------------


@pytest.fixture
def two_cores(tiny_model_dir: Path) -> Iterator[tuple[list[CoreClient], Any]]:
    spec = CoreSpec(str(tiny_model_dir), {"kvcache_block_size": BLOCK, "num_threads": 1})
    cores: list[CoreClient] = dp_remote.launch_replicas(spec, 2, 0, address=("127.0.0.1", 0))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    for c in cores:
        c.start(loop)
    yield cores, loop
    stop_all(cores, 5)
    loop.call_soon_threadsafe(loop.stop)


def test_a_dead_replica_releases_its_load(two_cores: tuple[list[CoreClient], Any]) -> None:
    cores, loop = two_cores
    dp = DPClient(cores)
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    async def submit(rid: str, prompt: list[int]) -> asyncio.Queue[Any]:
        return await dp.submit([(rid, {"prompt_token_ids": prompt}, params)], 0.0)

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    sinks = [call(submit("a", [1, 2, 3])), call(submit("b", [4, 5, 6]))]
    assert dp.in_flight == [1, 1] and dp._owner == {"a": 0, "b": 1}  # one each
    assert call(sinks[0].get()).request_id == "a"  # running
    os.kill(cores[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
    while not isinstance(event := call(sinks[0].get()), RequestFailed):
        pass
    assert event.status == 500
    assert dp.loads() == [0, 1] and dp._owner == {"b": 1}
    assert dp.choose([]) == 1  # the live one, unskewed
    dp.abort(["b"])
    deadline = time.monotonic() + 30
    while dp.loads() != [0, 0] or dp._owner:
        assert time.monotonic() < deadline, (dp.in_flight, dp._owner)
        time.sleep(0.05)


class _Replica:
    """What ``DPClient`` reads of a replica, without a process: ``submit`` accepts."""

    def __init__(self) -> None:
        self.alive, self.observer, self.snapshot, self.fatal = True, None, None, None
        self.info: Any = type("Info", (), {"block_size": BLOCK, "prefix_cache_hash": "xxh64"})()
        self.stopped: list[float] = []

    async def submit(self, requests: Any, arrival_time: float) -> asyncio.Queue[Any]:
        return asyncio.Queue()

    def stop(self, timeout: float) -> bool:
        self.stopped.append(time.monotonic())
        time.sleep(timeout)
        return True


def test_the_router_releases_a_dead_or_restarted_replicas_load_by_itself() -> None:
    """No ``ended`` comes for the failed requests here: the sweep alone releases them."""
    replicas = [_Replica(), _Replica()]
    dp = DPClient(replicas)  # type: ignore[arg-type]
    two = SamplingParams(n=2)
    for rid in ("a", "b", "c"):
        asyncio.run(dp.submit([(rid, {"prompt_token_ids": [1]}, two)], 0.0))
    assert dp.in_flight == [4, 2] and dp._owner == {"a": 0, "b": 1, "c": 0}
    replicas[0].alive = False
    assert dp.loads() == [0, 2] and dp._owner == {"b": 1}
    replicas[0].alive = True
    replicas[1].info = type(replicas[1].info)()  # restarted: a new core, holding nothing
    assert dp.loads() == [0, 0] and dp._owner == {}
    dp.ended("b")  # its late report changes nothing
    assert dp.in_flight == [0, 0]


# ---- stop and launch at once -----------------------------------------------------------


def test_replicas_stop_at_once() -> None:
    replicas = [_Replica() for _ in range(4)]
    dp = DPClient(replicas)  # type: ignore[arg-type]
    started = time.monotonic()
    assert dp.stop(0.5) is True
    assert time.monotonic() - started < 1.5  # one after another: 2 s
    firsts = [r.stopped[0] for r in replicas]
    assert max(firsts) - min(firsts) < 0.4


def test_a_stop_that_raises_is_raised_after_every_other_stop() -> None:
    replicas = [_Replica() for _ in range(3)]

    def broken(timeout: float) -> bool:
        raise OSError("broken pipe")

    replicas[0].stop = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="broken pipe"):
        stop_all(replicas, 0.1)  # type: ignore[arg-type]
    assert [len(r.stopped) for r in replicas[1:]] == [1, 1]


def test_replicas_launch_at_once(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both are spawned before either has loaded (one after another: the second after the
    first is ready)."""
    spawned: list[float] = []
    ready: list[float] = []
    real_spawn, real_launch = LocalCoreClient._spawn, LocalCoreClient.launch

    def spawn(self: LocalCoreClient) -> tuple[Any, Any]:
        spawned.append(time.monotonic())
        return real_spawn(self)

    def launch(self: LocalCoreClient) -> Any:
        info = real_launch(self)
        ready.append(time.monotonic())
        return info

    monkeypatch.setattr(LocalCoreClient, "_spawn", spawn)
    monkeypatch.setattr(LocalCoreClient, "launch", launch)
    spec = CoreSpec(str(tiny_model_dir), {"kvcache_block_size": BLOCK, "num_threads": 1})
    cores = dp_remote.launch_replicas(spec, 2, 0, address=("127.0.0.1", 0))
    try:
        assert len(spawned) == len(ready) == 2 and all(c.alive for c in cores)
        assert len({c.pid for c in cores}) == 2
        assert max(spawned) < min(ready)
    finally:
        assert stop_all(cores, 5)
    assert spawned_children() == []


def test_a_replica_that_fails_to_load_fails_the_launch_and_ends_the_others(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[LocalCoreClient] = []
    spawned: list[Any] = []
    real_init, real_launch = LocalCoreClient.__init__, LocalCoreClient.launch
    real_spawn = LocalCoreClient._spawn

    def spawn(self: LocalCoreClient) -> Any:
        process, conn = real_spawn(self)
        spawned.append(process)
        return process, conn

    def init(self: LocalCoreClient, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)

    def launch(self: LocalCoreClient) -> Any:
        if self is made[1]:
            time.sleep(1.0)  # replica 0 is spawned and loading meanwhile
            raise ValueError("replica 1 refused its model")
        return real_launch(self)

    monkeypatch.setattr(LocalCoreClient, "__init__", init)
    monkeypatch.setattr(LocalCoreClient, "launch", launch)
    monkeypatch.setattr(LocalCoreClient, "_spawn", spawn)
    spec = CoreSpec(str(tiny_model_dir), {"kvcache_block_size": BLOCK, "num_threads": 1})
    with pytest.raises(ValueError, match="replica 1 refused its model"):
        dp_remote.launch_replicas(spec, 2, 0, address=("127.0.0.1", 0))
    assert made[0].info is None  # cut short while loading, not waited for
    assert len(spawned) == 1 and not spawned[0].is_alive()
    assert spawned_children() == []


# ---- devices ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "replicas", "tp", "count", "visible", "expected"),
    [
        ("cpu", 2, 1, 4, None, [None, None]),
        ("auto", 2, 1, 0, None, [None, None]),  # no CUDA here: the CPU
        ("cuda", 1, 1, 4, None, [None]),  # one replica: as without data parallelism
        ("cuda", 2, 1, 2, None, ["0", "1"]),
        ("auto", 3, 1, 4, None, ["0", "1", "2"]),
        ("cuda", 2, 2, 4, None, ["0,1", "2,3"]),  # each TP group its own devices
        ("auto", 2, 2, 4, "3,5, 7,9", ["3,5", "7,9"]),  # of this process's own list
    ],
)
def test_each_local_replica_gets_its_own_devices(
    device: str, replicas: int, tp: int, count: int, visible: str | None, expected: list[Any]
) -> None:
    assert replica_devices(device, replicas, tp, count, visible) == expected


def test_too_few_or_one_named_device_is_refused() -> None:
    with pytest.raises(ValueError, match="need 4 CUDA devices, this machine has 3"):
        replica_devices("cuda", 2, 2, 3)
    with pytest.raises(ValueError, match="--device cuda:1 names one CUDA device"):
        replica_devices("cuda:1", 2, 1, 4)


def test_too_few_devices_are_refused_before_any_core_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(CUDA_VISIBLE, raising=False)
    spec = CoreSpec("/no/model", {"device": "auto"})
    assert local_devices(CoreSpec("/no/model", {"device": "cpu"}), 2) == [None, None]
    made: list[object] = []
    monkeypatch.setattr(dp_remote, "LocalCoreClient", lambda *a, **k: made.append(a))
    with pytest.raises(ValueError, match=r"2 data-parallel replicas here .* need 2 CUDA"):
        dp_remote.launch_replicas(spec, 2, 0, address=("127.0.0.1", 0))
    assert made == []


def test_a_spawned_replica_sees_only_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real child's environment (its /proc entry), a restart's spawn alike; this
    process's own is left as it was."""
    monkeypatch.setenv(CUDA_VISIBLE, "4,5,6,7")
    client = LocalCoreClient(CoreSpec("/no/model"), "6,7")
    for _ in range(2):  # the launch, then a restart
        process, conn = client._spawn()
        try:
            deadline = time.monotonic() + 10  # its exec may come after the spawn returns
            while b"spawn_main" not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        finally:
            end_process(process, 0.0)
            conn.close()
        assert f"{CUDA_VISIBLE}=6,7".encode() in environ
    assert os.environ[CUDA_VISIBLE] == "4,5,6,7"
    client.give_up()
    with pytest.raises(RuntimeError, match="the core client is stopping"):
        client.launch()  # nothing is spawned once given up
    assert dp_client.LocalCoreClient is LocalCoreClient
