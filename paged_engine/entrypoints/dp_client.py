"""Data parallelism (``serve --data-parallel-size N``): N engine core processes, each with
its own KV pool and prefix cache, behind one API server, with cache-aware routing.

Why cache-aware: a replica's prefix cache only helps requests that reach it. Sent round
robin, requests sharing a system prompt land on every replica and each computes that
prefix once; sent where their prefix already is, they compute it once in all. So the
router hashes each prompt's full blocks here, in the API process, exactly as the engine
does (R4's chained hash and R4s's salt, ``engine/hashing.py``, with the replicas' block
size and hash), and remembers, per replica, the block hashes it sent there
(``PrefixIndex``, bounded, least recently used first out). A request goes to the live
replica holding the longest run of its leading blocks, unless that replica has more
than ``max_imbalance`` sequences in flight beyond the least loaded one: then the least
loaded takes it (load beats locality past that point). Ties go to the least loaded, then
to the replica sent the fewest requests so far.

The router's memory approximates each replica's cache (a replica may have evicted a
block since); a wrong guess costs a recomputation, never a wrong answer.

``DPClient`` has ``EngineLoop``'s interface. One HTTP request's prompts go to one
replica, chosen by its first prompt, so ``submit`` stays all-or-none. An engine call
(``call_core``: one embedding's pooling) goes to the least loaded replica. A replica that
dies fails its own requests only; the others keep serving and the router skips it.

The load counts: a request counts from its ``submit`` until its replica reports its end
(the observer's ``ended``, on that replica's reader thread), or until the replica is seen
dead or restarted (its core changed): everything it held failed with it. The event loop
and every reader thread change them, under one lock.

Replicas are started and stopped at once (``stop_all``): N stop within one bound, not N.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from paged_engine.engine.hashing import salt_block, sha256_block_hash, xxh64_block_hash
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.core_client import CoreClient
from paged_engine.entrypoints.core_process import CoreSpec
from paged_engine.entrypoints.dp_headless import cuda_visible
from paged_engine.entrypoints.loop_types import EngineSnapshot, EngineUnavailable, Event, Observer
from paged_engine.sampling_params import SamplingParams

INDEX_BLOCKS = 65536
"""Block hashes remembered per replica (8 bytes of key each, plus the dict's overhead)."""


def prompt_block_hashes(
    tokens: Sequence[int], block_size: int, algorithm: str, salt: str | None
) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the engine computes them."""
    block_hash = sha256_block_hash if algorithm == "sha256" else xxh64_block_hash
    prefix = None if salt is None else block_hash(salt_block(salt), None)
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prefix = block_hash(tokens[start : start + block_size], prefix)
        hashes.append(prefix)
    return hashes


class PrefixIndex:
    """The block hashes sent to one replica, least recently used first out."""

    def __init__(self, capacity: int = INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks this replica was sent."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


def _tokens_and_salt(prompt: object) -> tuple[Sequence[int] | None, str | None]:
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return (ids if isinstance(ids, list) else None), prompt.get("cache_salt")
    if isinstance(prompt, list):
        return prompt, None
    return None, None


class DPClient:
    """See the module docstring. ``replicas`` are launched ``CoreClient``\\s."""

    def __init__(self, replicas: list[CoreClient], *, max_imbalance: int = 8) -> None:
        if not replicas or any(r.info is None for r in replicas):
            raise ValueError("DPClient needs launched replicas")
        self.replicas = replicas
        self.max_imbalance = max_imbalance
        self.indexes = [PrefixIndex() for _ in replicas]
        self.in_flight = [0] * len(replicas)
        """Sequences submitted and not yet ended, per replica (under ``_lock``)."""
        self.routed = [0] * len(replicas)
        info = replicas[0].info
        assert info is not None
        self.info = info
        self._draining = False
        self._lock = threading.RLock()
        self._owner: dict[str, int] = {}
        """Request id -> its replica, until the replica reports its end (or is dead)."""
        self._owned: list[dict[str, int]] = [{} for _ in replicas]
        """Per replica: its requests' ids -> their sequences."""
        self._cores = [r.info for r in replicas]
        """Each replica's core when it was last seen: a new one (a restart) holds nothing."""
        self.observer = replicas[0].observer

    @property
    def observer(self) -> Observer:
        return self._observer

    @observer.setter
    def observer(self, observer: Observer) -> None:
        """Each replica reports to ``observer`` through a tee that also counts its load."""
        self._observer = observer
        for i, r in enumerate(self.replicas):
            r.observer = _LoadObserver(self, i, observer)

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def fatal(self) -> str | None:
        return None if self.alive else "; ".join(filter(None, (r.fatal for r in self.replicas)))

    @property
    def snapshot(self) -> EngineSnapshot | None:
        shots = [r.snapshot for r in self.replicas if r.snapshot is not None]
        if not shots:
            return None
        fields = [f.name for f in dataclasses.fields(EngineSnapshot)]
        return EngineSnapshot(**{f: sum(getattr(s, f) for s in shots) for f in fields})

    def start(self, loop: asyncio.AbstractEventLoop, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.start(loop, timeout)

    def loads(self) -> list[int]:
        """The sequences in flight per replica (a dead replica's released first)."""
        with self._lock:
            self._release_dead()
            return list(self.in_flight)

    def _release_dead(self) -> None:
        """Forget the requests of a replica that died or was restarted since: they failed
        (the client fails them, maybe without an ``ended`` each). Under ``_lock``."""
        for i, r in enumerate(self.replicas):
            if not r.alive or r.info is not self._cores[i]:
                for request_id in self._owned[i]:
                    self._owner.pop(request_id, None)
                self.in_flight[i] -= sum(self._owned[i].values())
                self._owned[i].clear()
                self._cores[i] = r.info if r.alive else self._cores[i]

    def choose(self, hashes: Sequence[int]) -> int:
        """The replica for a prompt with these block hashes (see the module docstring)."""
        with self._lock:
            self._release_dead()
            live = [i for i, r in enumerate(self.replicas) if r.alive]
            if not live:
                raise EngineUnavailable(self.fatal or "no engine core is alive")
            least = min(live, key=lambda i: (self.in_flight[i], self.routed[i]))
            best = max(
                live,
                key=lambda i: (self.indexes[i].match(hashes), -self.in_flight[i], -self.routed[i]),
            )
            if self.in_flight[best] - self.in_flight[least] > self.max_imbalance:
                return least
            return best

    async def submit(
        self, requests: list[tuple[str, object, SamplingParams]], arrival_time: float
    ) -> asyncio.Queue[Event]:
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        tokens, salt = _tokens_and_salt(requests[0][1]) if requests else (None, None)
        info = self.info
        hashes = (
            []
            if tokens is None
            else prompt_block_hashes(tokens, info.block_size, info.prefix_cache_hash, salt)
        )
        with self._lock:
            i = self.choose(hashes)
            for request_id, _, params in requests:  # before: a replica may end it at once
                self._owner[request_id] = i
                self._owned[i][request_id] = params.n
                self.in_flight[i] += params.n
        try:
            sink = await self.replicas[i].submit(requests, arrival_time)
        except BaseException:
            for request_id, _, _ in requests:
                self.ended(request_id)
            raise
        with self._lock:
            self.indexes[i].add(hashes)
            self.routed[i] += 1
        return sink

    async def call_core(self, name: str, *args: Any) -> Any:
        """An engine call (``core_calls``: pooling) on one live replica: ``choose`` with no
        prefix (a vector is the same everywhere), so the least loaded, ties to the one sent
        the fewest requests and calls so far (round robin when idle)."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        with self._lock:
            i = self.choose([])
            self.routed[i] += 1
        return await self.replicas[i].call_core(name, *args)

    def ended(self, request_id: str) -> None:
        """A replica reported the request's end (its reader thread): its load is gone."""
        with self._lock:
            i = self._owner.pop(request_id, None)
            if i is not None:
                self.in_flight[i] -= self._owned[i].pop(request_id)

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        for r in self.replicas:  # aborting an id a replica does not hold changes nothing
            r.abort(request_ids)

    def begin_shutdown(self, grace_s: float) -> None:
        self._draining = True
        for r in self.replicas:
            r.begin_shutdown(grace_s)

    def stop(self, timeout: float = 10.0) -> bool:
        return stop_all(self.replicas, timeout)


def stop_all(replicas: Sequence[CoreClient], timeout: float) -> bool:
    """Stop every replica at once (a thread each), so that they all end within one
    ``stop`` bound; True when each ended by itself. An error a stop raised is raised
    again once every stop has been tried."""
    if not replicas:
        return True
    with concurrent.futures.ThreadPoolExecutor(len(replicas), "dp-stop") as pool:
        futures = [pool.submit(r.stop, timeout) for r in replicas]
    return all([f.result() for f in futures])


class LocalCoreClient(CoreClient):
    """A core spawned here that sees only ``devices`` (its ``CUDA_VISIBLE_DEVICES``; None:
    this process's), restarts included, and whose launch ``give_up`` cuts short from
    another thread (``stop``: the core being loaded is ended, the launch fails at once)."""

    def __init__(self, spec: CoreSpec, devices: str | None = None, *, restarts: int = 0) -> None:
        super().__init__(spec, restarts=restarts)
        self.devices = devices

    def _spawn(self) -> tuple[Any, Any]:
        with cuda_visible(self.devices):
            return super()._spawn()

    def give_up(self) -> None:
        self.stop(0.0)


class _LoadObserver:
    """One replica's observer: the server's metrics, and the router's load count."""

    def __init__(self, router: DPClient, replica: int, inner: Observer) -> None:
        self._router = router
        self._inner = inner
        self.replica = replica

    def added(self, request_ids: list[str], arrival_time: float) -> None:
        self._inner.added(request_ids, arrival_time)

    def output(self, out: RequestOutput) -> None:
        self._inner.output(out)

    def ended(self, request_id: str, how: str) -> None:
        self._router.ended(request_id)
        self._inner.ended(request_id, how)
