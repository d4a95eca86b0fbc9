"""What the Ray data-parallel tests share (``test_ray_dp.py``, ``test_ray_nodes.py``): replicas
launched as Ray actors behind a ``DPClient`` on an event loop of their own, long requests
that stay running while a replica is killed, and the checks that everything was released."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_engine import SamplingParams
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.entrypoints.dp_client import DPClient, stop_all
from paged_engine.entrypoints.dp_ray import RayReplicas
from paged_engine.entrypoints.loop_types import RequestFailed
from paged_engine.entrypoints.metrics import ServerMetrics
from tests.test_server_support import parse_metrics
from tests.tp_support import assert_gone

BLOCK = 8
LONG = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
"""Long enough to be running still when a replica is killed."""


def core_spec(model_dir: Path, **kwargs: Any) -> CoreSpec:
    return CoreSpec(str(model_dir), {"kvcache_block_size": BLOCK, "num_threads": 1, **kwargs})


@dataclass
class Served:
    """Launched replicas behind a router, its metrics bound as the server binds them."""

    replicas: RayReplicas
    cores: list[CoreClient]
    dp: DPClient
    loop: asyncio.AbstractEventLoop
    metrics: ServerMetrics

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams = LONG) -> Any:
        """The request's event queue (it is sent to the replica the router chooses)."""
        return self.call(self.dp.submit([(rid, {"prompt_token_ids": prompt}, params)], 0.0))

    def alive_gauges(self) -> list[float]:
        m = parse_metrics(self.metrics.render().decode())
        return [m[f'dp_replica_alive{{replica="{i}"}}'] for i in range(len(self.cores))]


@contextmanager
def served(model_dir: Path, count: int = 2, **kwargs: Any) -> Iterator[Served]:
    """``count`` replicas as Ray actors (``RayReplicas(..., **kwargs)``), stopped and
    released at the end."""
    replicas = RayReplicas(core_spec(model_dir), count, **kwargs)
    cores = replicas.launch()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        for c in cores:
            c.start(loop)
        dp = DPClient(cores)
        metrics = ServerMetrics()
        metrics.bind(dp)
        dp.observer = metrics
        yield Served(replicas, cores, dp, loop, metrics)
    finally:
        stop_all(cores, 5.0)
        replicas.close()
        loop.call_soon_threadsafe(loop.stop)


def failure_of(s: Served, sink: Any, within: float = 30.0) -> RequestFailed:
    """The request's ``RequestFailed``, skipping its outputs until then."""
    deadline = time.monotonic() + within
    while not isinstance(event := s.call(sink.get(), within), RequestFailed):
        assert time.monotonic() < deadline, "the request did not fail"
    return event


def released(ray: Any, replicas: RayReplicas, cpus: float, within: float = 15.0) -> None:
    """Every placement group removed, the actors' processes gone, ``cpus`` CPUs free."""
    for group in ray.util.placement_group_table().values():
        assert group["state"] == "REMOVED", group
    assert_gone([pid for _, _, pid in replicas.nodes], within)
    deadline = time.monotonic() + within
    while ray.available_resources().get("CPU") != cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == cpus, ray.available_resources()
