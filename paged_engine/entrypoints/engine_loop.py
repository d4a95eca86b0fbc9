"""One background thread that owns an ``LLMEngine`` and steps it while work exists.

Why a thread of its own: ``LLMEngine`` is not thread-safe (nothing in it locks), and a
step is CPU or GPU work that must not block the HTTP event loop. So exactly one thread
touches the engine, and everything else talks to it through a ``queue.Queue`` of commands
(add, abort, drain, stop, call). Outputs go the other way: after each step the thread groups the
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

The requests in flight are ``routes``' table: every request runs in the engine with
``RequestOutputKind.DELTA``, one that was asked for ``FINAL_ONLY`` has its deltas merged
(``gather``) and delivered once, finished. So each step reports every request it
advanced, which is how the metrics measure every request's inter-token latency and how
the table knows which requests a step advanced.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.entrypoints.loop_types import (
    EngineCall,
    EngineSnapshot,
    EngineUnavailable,
    Event,
    NoObserver,
    Observer,
)
from paged_engine.entrypoints.routes import Batch, Routes
from paged_engine.sampling_params import SamplingParams

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


class EngineLoop:
    """See the module docstring. ``start(loop)`` binds it to the event loop that reads
    the outputs; ``submit``/``abort``/``begin_shutdown``/``stop`` may be called from any
    thread (``submit`` is a coroutine of that event loop)."""

    def __init__(
        self, engine: LLMEngine, *, max_step_failures: int = 3, observer: Observer | None = None
    ) -> None:
        self._engine = engine
        self.observer: Observer = observer or NoObserver()
        self._commands: queue.Queue[_Add | _Abort | EngineCall | _Drain | _Stop] = queue.Queue()
        self._routes = Routes(self._owned, self.observer, self._post, max_step_failures)
        """Engine thread only: the requests in flight."""
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
        return self._routes.quarantine.threshold

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

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps; its result, or raise."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._put(EngineCall(fn, done))
        return await asyncio.wrap_future(done)

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

    def _put(self, command: _Add | _Abort | EngineCall | _Drain | _Stop) -> None:
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
            self._routes.fail_all(self.fatal, 500)
        finally:
            with self._close_lock:
                self._closed = True
            self._ready.set()
            self._refuse_pending()

    def _serve(self) -> None:
        routes = self._routes
        while True:
            engine = self._owned()
            routes.release()
            idle = not engine.has_unfinished_requests() and not routes.parked
            if not self._take_commands(block=idle):
                routes.fail_all("the server is shutting down", 503)
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                routes.fail_all("the server is shutting down", 503)
            routes.release()
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:
                    routes.step_failed(exc)
                else:
                    routes.dispatch(outputs)
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
                self._routes.abort(command.request_ids)
            elif isinstance(command, EngineCall):
                self._call(command)
            elif self._deadline is None:
                self._deadline = command.deadline
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        routes, c = self._routes, command
        self._call(EngineCall(lambda _: routes.add(c.requests, c.arrival_time, c.sink), c.done))

    def _call(self, command: EngineCall) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # its caller has gone (the await was cancelled): nothing runs
        try:
            if self._deadline is not None:
                raise EngineUnavailable("the server is shutting down")
            command.done.set_result(command.fn(self._owned()))
        except Exception as exc:
            command.done.set_exception(exc)

    def _post(self, batch: Batch) -> None:
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
            if isinstance(command, _Add | EngineCall) and not command.done.done():
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


def _deliver(batch: Batch) -> None:
    for sink, event in batch:
        sink.put_nowait(event)
