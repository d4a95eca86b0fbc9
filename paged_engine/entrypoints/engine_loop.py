"""One background thread that owns an ``LLMEngine`` and steps it while work exists.

Why a thread of its own: ``LLMEngine`` is not thread-safe (nothing in it locks), and a
step is CPU or GPU work that must not block the HTTP event loop. So exactly one thread
touches the engine, and everything else talks to it through a ``queue.Queue`` of commands
(add, abort, drain, stop). Outputs go the other way: after each step the thread groups the
``RequestOutput``s by the asyncio queue of the request they belong to and hands the batch
to the event loop with one ``loop.call_soon_threadsafe`` (one wake-up per step, however
many streams). Every engine access goes through ``_owned()``, which raises if the calling
thread is not the loop's: the rule is checked, not just documented.

Adding is synchronous for the caller: ``submit`` resolves only once the engine thread has
run ``add_request`` for every prompt of the HTTP request, so a refused one (``ValueError``
/``TypeError``, naming the field) comes back as an exception before anything is streamed,
and the prompts of that request that were added are aborted again (abort of a request that
never ran changes nothing else), so nothing is queued. Prompts come tokenized (the server
tokenizes in its own threads), so this thread spends its time on steps.

Every request runs in the engine with ``RequestOutputKind.DELTA``: one that was asked for
``FINAL_ONLY`` has its deltas merged here (``gather``) and delivered once, finished. So
each step reports every request it advanced, which is how the metrics measure every
request's inter-token latency and how the loop knows which requests a step advanced.

Faults: ``LLMEngine.step()`` recovers before it re-raises (every sequence committed or
preempted), so the loop steps again. Failures in a row make ``isolation`` look for the
request at fault (parking and re-adding the requests whose client has seen nothing, by
bisection); the one found ends alone with a ``RequestFailed`` (500) and the others go on.
If the thread itself dies (a ``BaseException``), every waiter is failed and ``alive``
turns False (``/health`` reports it).

Costs: one queue put per HTTP request and per abort, one ``call_soon_threadsafe`` per step,
one output per advanced request per step, and a small ``EngineSnapshot`` per loop
iteration (read by ``/metrics`` without touching the engine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.gather import Gathered
from paged_engine.entrypoints.isolation import Quarantine, Suspect
from paged_engine.entrypoints.loop_types import (
    EngineSnapshot,
    EngineUnavailable,
    Event,
    NoObserver,
    Observer,
    RequestFailed,
)
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    requests: list[tuple[str, object, SamplingParams]]
    arrival_time: float
    sink: asyncio.Queue[Event]
    done: concurrent.futures.Future[None]


@dataclass(slots=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(slots=True)
class _Drain:
    deadline: float


class _Stop:
    pass


@dataclass(slots=True)
class _Route:
    """The engine thread's record of one request: where its outputs go, and what it takes
    to add it again after ``isolation`` parked it."""

    sink: asyncio.Queue[Event]
    prompt: object
    params: SamplingParams
    """As the engine runs it (``DELTA``)."""
    arrival_time: float
    gather: Gathered | None
    """Set when the client wants one final output (the deltas are merged here)."""
    seen: bool = False
    """Its client has received an output (a stream cannot be taken back)."""
    confirmed: bool = False
    """It produced a token in a successful step since it was (re-)added."""
    parked: bool = False
    """Taken out of the engine by ``isolation``, to be added again."""


class EngineLoop:
    """See the module docstring. ``start(loop)`` binds it to the event loop that reads
    the outputs; ``submit``/``abort``/``begin_shutdown``/``stop`` may be called from any
    thread (``submit`` is a coroutine of that event loop)."""

    def __init__(
        self, engine: LLMEngine, *, max_step_failures: int = 3, observer: Observer | None = None
    ) -> None:
        self._engine = engine
        self.observer: Observer = observer or NoObserver()
        self._commands: queue.Queue[_Add | _Abort | _Drain | _Stop] = queue.Queue()
        self._routes: dict[str, _Route] = {}
        """Engine thread only: every request in flight (parked too), in admission order."""
        self._quarantine = Quarantine(max_step_failures)
        """Engine thread only: the search for a request that makes every step fail."""
        self._deadline: float | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._owner: int | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._ready = threading.Event()
        self.snapshot: EngineSnapshot | None = None
        self.fatal: str | None = None
        """Why the loop's thread died, if it did."""

    # ---- any thread ------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, timeout: float = 30.0) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._aloop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the engine loop did not start")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def thread_id(self) -> int | None:
        """The identity of the one thread that touches the engine."""
        return self._owner

    @property
    def max_step_failures(self) -> int:
        """Failed steps in a row before the loop looks for the request at fault."""
        return self._quarantine.threshold

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    async def submit(
        self, requests: list[tuple[str, object, SamplingParams]], arrival_time: float
    ) -> asyncio.Queue[Event]:
        """Add one HTTP request's prompts, all or none; their outputs arrive on the
        returned queue, each request's last one ``finished`` or a ``RequestFailed``.
        Raises what ``add_request`` raised (nothing was queued) or ``EngineUnavailable``."""
        sink: asyncio.Queue[Event] = asyncio.Queue()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._put(_Add(requests, arrival_time, sink, done))
        await asyncio.wrap_future(done)
        return sink

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        """Abort these requests (any already finished are skipped); returns at once."""
        if request_ids:
            with contextlib.suppress(EngineUnavailable):
                self._put(_Abort(tuple(request_ids)))

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests from now on; abort those still running after ``grace_s``."""
        with contextlib.suppress(EngineUnavailable):
            self._put(_Drain(time.monotonic() + grace_s))

    def stop(self, timeout: float = 10.0) -> bool:
        """Fail what is in flight (503), end the thread; True if it ended in time."""
        with contextlib.suppress(EngineUnavailable):
            self._put(_Stop())
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _put(self, command: _Add | _Abort | _Drain | _Stop) -> None:
        with self._close_lock:
            if self._closed:
                raise EngineUnavailable(self.fatal or "the engine loop has stopped")
            self._commands.put(command)

    # ---- the engine thread ---------------------------------------------------------------

    def _owned(self) -> LLMEngine:
        """The engine, to the loop's own thread only."""
        if threading.get_ident() != self._owner:
            raise RuntimeError("the engine is touched from a thread other than the engine loop's")
        return self._engine

    def _run(self) -> None:
        self._owner = threading.get_ident()
        try:
            self._publish()
            self._ready.set()
            self._serve()
        except BaseException as exc:
            self.fatal = f"the engine loop died: {exc!r}"
            log.exception("the engine loop died")
            self._fail_all(self.fatal, 500)
        finally:
            with self._close_lock:
                self._closed = True
            self._ready.set()
            self._refuse_pending()

    def _serve(self) -> None:
        while True:
            engine = self._owned()
            self._release()
            idle = not engine.has_unfinished_requests() and not self._quarantine.parked
            if not self._take_commands(block=idle):
                self._fail_all("the server is shutting down", 503)
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._fail_all("the server is shutting down", 503)
            self._release()
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:
                    self._step_failed(exc)
                else:
                    self._dispatch(outputs)
            self._publish()

    def _take_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when ``block``); False on stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_ids)
            elif self._deadline is None:
                self._deadline = command.deadline
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        if self._deadline is not None:
            command.done.set_exception(EngineUnavailable("the server is shutting down"))
            return
        engine = self._owned()
        routes: dict[str, _Route] = {}
        try:
            for request_id, prompt, params in command.requests:
                final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
                if final_only:
                    params = replace(params, output_kind=RequestOutputKind.DELTA)
                route = _Route(
                    command.sink,
                    prompt,
                    params,
                    command.arrival_time,
                    Gathered() if final_only else None,
                )
                engine.add_request(request_id, prompt, params, arrival_time=command.arrival_time)
                routes[request_id] = route
        except Exception as exc:
            engine.abort_request(list(routes))  # nothing of this request stays queued
            command.done.set_exception(exc)
            return
        self._routes.update(routes)
        self.observer.added(list(routes), command.arrival_time)
        command.done.set_result(None)

    def _abort(self, request_ids: tuple[str, ...]) -> None:
        for r in request_ids:
            route = self._routes.pop(r, None)
            if route is None:
                continue
            if not route.parked:
                self._owned().abort_request([r])
            self._gone(r, "aborted")

    def _gone(self, request_id: str, how: str) -> None:
        self.observer.ended(request_id, how)
        self._quarantine.gone(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batch: list[tuple[asyncio.Queue[Event], Event]] = []
        produced: set[str] = set()
        for out in outputs:
            rid = out.request_id
            route = self._routes.get(rid)
            if route is None:
                continue
            produced.add(rid)
            route.confirmed = True
            self.observer.output(out)
            if out.finished:
                del self._routes[rid]
                self._gone(rid, "finished")
            if route.gather is None:
                route.seen = True
                batch.append((route.sink, out))
            else:
                route.gather.add(out)
                if out.finished:
                    batch.append((route.sink, route.gather.result()))
        self._quarantine.succeeded(produced)
        self._post(batch)

    # ---- faults --------------------------------------------------------------------------

    def _step_failed(self, exc: Exception) -> None:
        q = self._quarantine
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
        if verdict.park:
            log.warning("engine steps keep failing: %d request(s) set aside", len(verdict.park))
        message = (
            f"the engine failed {q.threshold} steps in a row with this request in the "
            f"batch: {exc!r}"
        )
        for r in verdict.fail:
            self._fail(r, message, 500)

    def _release(self) -> None:
        """Add back the parked requests ``isolation`` clears for a probe."""
        q = self._quarantine
        if not q.parked:
            return
        engine = self._owned()
        for r in q.release(idle=not engine.has_unfinished_requests()):
            route = self._routes[r]
            try:
                engine.add_request(r, route.prompt, route.params, arrival_time=route.arrival_time)
            except Exception as exc:  # it was accepted once; fail it rather than the loop
                self._fail(r, f"the request could not be resumed: {exc!r}", 500)
            else:
                route.parked = False

    def _fail(self, request_id: str, message: str, status: int) -> None:
        route = self._routes.pop(request_id)
        if not route.parked:
            self._owned().abort_request([request_id])
        self._post([(route.sink, RequestFailed(request_id, message, status))])
        self._gone(request_id, "failed")

    def _fail_all(self, message: str, status: int) -> None:
        routes, self._routes = self._routes, {}
        self._quarantine.clear()
        if not routes:
            return
        try:
            self._owned().abort_request([r for r, route in routes.items() if not route.parked])
        finally:
            batch: list[tuple[asyncio.Queue[Event], Event]] = []
            for r, route in routes.items():
                batch.append((route.sink, RequestFailed(r, message, status)))
                self.observer.ended(r, "failed")
            self._post(batch)

    def _post(self, batch: list[tuple[asyncio.Queue[Event], Event]]) -> None:
        if batch and self._aloop is not None:
            # RuntimeError: the event loop is closed, nobody is listening any more
            with contextlib.suppress(RuntimeError):
                self._aloop.call_soon_threadsafe(_deliver, batch)

    def _refuse_pending(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and not command.done.done():
                command.done.set_exception(EngineUnavailable("the engine loop has stopped"))

    def _publish(self) -> None:
        engine = self._owned()
        sched = engine.scheduler
        stats = sched.stats
        self.snapshot = EngineSnapshot(
            running=len(sched.running),
            waiting=len(sched.waiting),
            blocks_in_use=engine.num_blocks - engine.block_manager.num_free_blocks,
            num_blocks=engine.num_blocks,
            prompt_tokens=stats.prompt_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
            output_tokens=stats.output_tokens,
            preemptions=stats.preemptions,
            steps=stats.steps,
            failed_steps=stats.failed_steps,
        )


def _deliver(batch: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for sink, event in batch:
        sink.put_nowait(event)
