"""The engine thread's table of the requests in flight: where each one's outputs go (merged
into one output for a whole response), and the fault isolation that parks, re-adds and
fails them one by one (``isolation`` decides, this table carries it out).

Why apart from ``engine_loop``: the loop is about the thread (commands, lifecycle, the
snapshot); this is about requests. It is used by the engine thread alone: ``owned``
returns the engine, checking the caller's thread, and ``post`` hands a batch of events
to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.core_wire import Restarted
from paged_engine.entrypoints.gather import Gathered
from paged_engine.entrypoints.isolation import Quarantine, Suspect
from paged_engine.entrypoints.loop_types import Event, Observer, RequestFailed
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("paged_engine.entrypoints.engine_loop")

Batch = list[tuple[asyncio.Queue[Event], Event]]


@dataclass(slots=True)
class _Route:
    """One request: where its outputs go, and what it takes to add it again after
    ``isolation`` parked it."""

    sink: asyncio.Queue[Event]
    prompt: object
    params: SamplingParams
    """As the engine runs it (``DELTA``)."""
    arrival_time: float
    gather: Gathered | None
    """Set when the client wants one final output (the deltas are merged here)."""
    seen: bool = False
    """Its client has received an output (a stream cannot be taken back)."""
    hidden: bool = False
    """Its client sees nothing before it ends (asked for ``FINAL_ONLY``)."""
    confirmed: bool = False
    """It produced a token in a successful step since it was (re-)added."""
    parked: bool = False
    """Taken out of the engine by ``isolation``, to be added again."""


class Routes:
    """See the module docstring."""

    def __init__(
        self,
        owned: Callable[[], LLMEngine],
        observer: Observer,
        post: Callable[[Batch], None],
        max_step_failures: int,
    ) -> None:
        self._owned = owned
        self.observer = observer
        self._post = post
        self._routes: dict[str, _Route] = {}
        """Every request in flight (parked too), in admission order."""
        self.quarantine = Quarantine(max_step_failures)
        self.relay = False
        """Set by the engine core process (``core_process.py``): every request's deltas are
        posted as they come, a ``FINAL_ONLY`` one's too (the API process merges them), and
        a hidden request that is parked posts ``Restarted`` (its deltas so far are void)."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._routes

    def add(
        self,
        requests: list[tuple[str, object, SamplingParams]],
        arrival_time: float,
        sink: asyncio.Queue[Event],
    ) -> None:
        """Add one HTTP request's prompts, all or none (raises what ``add_request``
        raised, having aborted those it added)."""
        engine = self._owned()
        routes: dict[str, _Route] = {}
        try:
            for request_id, prompt, params in requests:
                final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
                if final_only:
                    params = replace(params, output_kind=RequestOutputKind.DELTA)
                gather = Gathered() if final_only and not self.relay else None
                route = _Route(sink, prompt, params, arrival_time, gather, hidden=final_only)
                engine.add_request(request_id, prompt, params, arrival_time=arrival_time)
                routes[request_id] = route
        except Exception:
            engine.abort_request(list(routes))  # nothing of this request stays queued
            raise
        self._routes.update(routes)
        self.observer.added(list(routes), arrival_time)

    def abort(self, request_ids: tuple[str, ...]) -> None:
        for r in request_ids:
            route = self._routes.pop(r, None)
            if route is None:
                continue
            if not route.parked:
                self._owned().abort_request([r])
            self._gone(r, "aborted")

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """A successful step's outputs, to their requests' queues (in one batch)."""
        batch: Batch = []
        for out in outputs:
            rid = out.request_id
            route = self._routes.get(rid)
            if route is None:
                continue
            route.confirmed = True
            self.observer.output(out)
            if out.finished:
                del self._routes[rid]
                self._gone(rid, "finished")
            if route.gather is None:
                route.seen = route.seen or not route.hidden
                batch.append((route.sink, out))
            else:
                route.gather.add(out)
                if out.finished:
                    batch.append((route.sink, route.gather.result()))
        self.quarantine.succeeded()
        self._post(batch)

    def step_failed(self, exc: Exception) -> None:
        """A step raised (the engine has recovered): retry, park, or fail, as
        ``isolation`` says."""
        q = self.quarantine
        log.exception("engine step failed (%d in a row)", q.failures + 1)
        suspects = [
            Suspect(r, route.gather is not None or not route.seen, route.confirmed)
            for r, route in self._routes.items()
            if not route.parked
        ]
        verdict = q.failed(suspects)
        for r in verdict.park:
            route = self._routes[r]
            self._owned().abort_request([r])
            route.parked, route.confirmed = True, False
            if route.gather is not None:
                route.gather.reset()
            elif route.hidden:  # relayed: the API process drops what it built of it
                self._post([(route.sink, cast(Event, Restarted(r)))])
        if verdict.park:
            log.warning("engine steps keep failing: %d request(s) set aside", len(verdict.park))
        message = (
            f"the engine failed {q.threshold} steps in a row with this request in the "
            f"batch: {exc!r}"
        )
        for r in verdict.fail:
            self.fail(r, message, 500)

    @property
    def parked(self) -> bool:
        """Requests wait, parked, to be added again."""
        return bool(self.quarantine.parked)

    def release(self) -> None:
        """Add back the parked requests ``isolation`` clears for a probe."""
        q = self.quarantine
        if not q.parked:
            return
        engine = self._owned()
        for r in q.release(idle=not engine.has_unfinished_requests()):
            route = self._routes[r]
            try:
                engine.add_request(r, route.prompt, route.params, arrival_time=route.arrival_time)
            except Exception as exc:  # it was accepted once; fail it rather than the loop
                self.fail(r, f"the request could not be resumed: {exc!r}", 500)
            else:
                route.parked = False

    def fail(self, request_id: str, message: str, status: int) -> None:
        route = self._routes.pop(request_id)
        if not route.parked:
            self._owned().abort_request([request_id])
        self._post([(route.sink, RequestFailed(request_id, message, status))])
        self._gone(request_id, "failed")

    def fail_all(self, message: str, status: int) -> None:
        routes, self._routes = self._routes, {}
        self.quarantine.clear()
        if not routes:
            return
        try:
            self._owned().abort_request([r for r, route in routes.items() if not route.parked])
        finally:
            batch: Batch = []
            for r, route in routes.items():
                batch.append((route.sink, RequestFailed(r, message, status)))
                self.observer.ended(r, "failed")
            self._post(batch)

    def _gone(self, request_id: str, how: str) -> None:
        self.observer.ended(request_id, how)
        self.quarantine.gone(request_id)
