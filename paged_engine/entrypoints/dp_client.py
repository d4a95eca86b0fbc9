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
replica, chosen by its first prompt, so ``submit`` stays all-or-none. A replica that
dies fails its own requests only; the others keep serving and the router skips it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from paged_engine.engine.hashing import salt_block, sha256_block_hash, xxh64_block_hash
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.core_client import CoreClient
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
        """Sequences submitted and not yet ended, per replica (event loop only)."""
        self.routed = [0] * len(replicas)
        info = replicas[0].info
        assert info is not None
        self.info = info
        self._draining = False
        self._owner: dict[str, tuple[int, int]] = {}
        """Request id -> (its replica, its sequences), until the replica reports its end."""
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

    def choose(self, hashes: Sequence[int]) -> int:
        """The replica for a prompt with these block hashes (see the module docstring)."""
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
        i = self.choose(hashes)
        for request_id, _, params in requests:  # before: a replica may end it at once
            self._owner[request_id] = (i, params.n)
            self.in_flight[i] += params.n
        try:
            sink = await self.replicas[i].submit(requests, arrival_time)
        except BaseException:
            for request_id, _, _ in requests:
                self.ended(request_id)
            raise
        self.indexes[i].add(hashes)
        self.routed[i] += 1
        return sink

    def ended(self, request_id: str) -> None:
        """A replica reported the request's end (its reader thread): its load is gone."""
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            self.in_flight[owner[0]] -= owner[1]

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        for r in self.replicas:  # aborting an id a replica does not hold changes nothing
            r.abort(request_ids)

    def begin_shutdown(self, grace_s: float) -> None:
        self._draining = True
        for r in self.replicas:
            r.begin_shutdown(grace_s)

    def stop(self, timeout: float = 10.0) -> bool:
        return all([r.stop(timeout) for r in self.replicas])


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
