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
never ran changes nothing else), so nothing is queued. Prompts given as callables (chat
templates) are rendered here too, so the tokenizer is used by this thread alone.

Faults: ``LLMEngine.step()`` recovers before it re-raises (every sequence committed or
preempted), so the loop simply steps again. After ``max_step_failures`` consecutive
failures it gives up on the requests in flight: they are aborted (blocks freed) and their
streams get a ``RequestFailed`` (status 500); the engine goes on serving new requests.
If the thread itself dies (a ``BaseException``), every waiter is failed and ``alive``
turns False (``/health`` reports it).

Costs: one queue put per HTTP request and per abort, one ``call_soon_threadsafe`` per step,
a small ``EngineSnapshot`` per loop iteration (read by ``/metrics`` without touching the
engine), and tokenisation on the engine thread, which delays the next step by its time.
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
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.loop_types import (
    EngineSnapshot,
    EngineUnavailable,
    Event,
    NoObserver,
    Observer,
    PromptError,
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


class EngineLoop:
    """See the module docstring. ``start(loop)`` binds it to the event loop that reads
    the outputs; ``submit``/``abort``/``begin_shutdown``/``stop`` may be called from any
    thread (``submit`` is a coroutine of that event loop)."""

    def __init__(
        self, engine: LLMEngine, *, max_step_failures: int = 3, observer: Observer | None = None
    ) -> None:
        self._engine = engine
        self.max_step_failures = max_step_failures
        self.observer: Observer = observer or NoObserver()
        self._commands: queue.Queue[_Add | _Abort | _Drain | _Stop] = queue.Queue()
        self._routes: dict[str, asyncio.Queue[Event]] = {}
        """Engine thread only: where each request's outputs go."""
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
    def draining(self) -> bool:
        return self._deadline is not None

    async def submit(
        self, requests: list[tuple[str, object, SamplingParams]], arrival_time: float
    ) -> asyncio.Queue[Event]:
        """Add one HTTP request's prompts, all or none; their outputs arrive on the
        returned queue, each request's last one ``finished`` or a ``RequestFailed``.
        Raises what ``add_request`` raised (nothing was queued), ``PromptError``, or
        ``EngineUnavailable``."""
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
        failures = 0
        while True:
            engine = self._owned()
            if not self._take_commands(block=not engine.has_unfinished_requests()):
                self._fail_all("the server is shutting down", 503)
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._fail_all("the server is shutting down", 503)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:
                    failures += 1
                    log.exception("engine step failed (%d in a row)", failures)
                    if failures >= self.max_step_failures:
                        self._fail_all(f"the engine failed {failures} steps in a row: {exc!r}", 500)
                        failures = 0
                else:
                    failures = 0
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
        added: list[str] = []
        try:
            for request_id, prompt, params in command.requests:
                if callable(prompt):
                    prompt = _render(prompt)
                engine.add_request(request_id, prompt, params, arrival_time=command.arrival_time)
                added.append(request_id)
        except Exception as exc:
            engine.abort_request(added)  # nothing of this request stays queued
            command.done.set_exception(exc)
            return
        for request_id in added:
            self._routes[request_id] = command.sink
        streamed = command.requests[0][2].output_kind is RequestOutputKind.DELTA
        self.observer.added(added, command.arrival_time, streamed)
        command.done.set_result(None)

    def _abort(self, request_ids: tuple[str, ...]) -> None:
        mine = [r for r in request_ids if self._routes.pop(r, None) is not None]
        if mine:
            self._owned().abort_request(mine)
            for r in mine:
                self.observer.ended(r, "aborted")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batch: list[tuple[asyncio.Queue[Event], Event]] = []
        for out in outputs:
            sink = self._routes.get(out.request_id)
            if sink is None:
                continue
            self.observer.output(out)
            if out.finished:
                del self._routes[out.request_id]
                self.observer.ended(out.request_id, "finished")
            batch.append((sink, out))
        self._post(batch)

    def _fail_all(self, message: str, status: int) -> None:
        ids = list(self._routes)
        if not ids:
            return
        try:
            self._owned().abort_request(ids)
        finally:
            batch: list[tuple[asyncio.Queue[Event], Event]] = []
            for r in ids:
                batch.append((self._routes.pop(r), RequestFailed(r, message, status)))
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


def _render(prompt: Callable[[], Any]) -> object:
    try:
        return prompt()
    except Exception as exc:
        raise PromptError(f"the prompt could not be rendered: {exc}") from exc


def _deliver(batch: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for sink, event in batch:
        sink.put_nowait(event)
