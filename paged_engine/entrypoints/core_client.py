"""The API process's side of the engine core process (``core_process.py``): the same
interface as ``EngineLoop`` (``start``, ``submit``, ``abort``, ``begin_shutdown``,
``stop``, ``alive``, ``draining``, ``fatal``, ``snapshot``), so ``OpenAIServer`` serves
either without knowing which.

One reader thread receives everything the core sends and hands each step's events to the
event loop with one ``call_soon_threadsafe`` (as ``EngineLoop`` does), the observer's calls
to the metrics, and the add answers to the waiting ``submit``s.

Faults: if the core process dies (its pipe closes), every request in flight ends with a
``RequestFailed`` (500) naming the exit, pending adds are refused, ``alive`` turns False
(``/health`` 503), and ``on_death`` is called: the server then exits, or, with restarts
left, a new core serves once loaded (503 until then). ``stop`` asks the core to finish,
then terminates and kills it after a bound: no process is left behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_engine.entrypoints.core_process import CoreInfo, CoreSpec, core_main, end_process
from paged_engine.entrypoints.engine_loop import _deliver
from paged_engine.entrypoints.loop_types import (
    EngineSnapshot,
    EngineUnavailable,
    Event,
    NoObserver,
    Observer,
    RequestFailed,
)
from paged_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

KILL_WAIT_S = 2.0
"""After ``stop``'s own timeout: how long a terminated core may take before SIGKILL."""


@dataclass(slots=True)
class _Stream:
    """One ``submit``: its queue, and its requests not yet ended."""

    sink: asyncio.Queue[Event]
    open_ids: set[str]


class CoreClient:
    """See the module docstring. ``launch`` starts the core and waits until its model is
    loaded (its ``CoreInfo``); ``start(loop)`` binds the event loop that reads outputs."""

    def __init__(
        self,
        spec: CoreSpec,
        *,
        observer: Observer | None = None,
        restarts: int = 0,
        on_death: Callable[[str], None] | None = None,
        load_timeout: float = 600.0,
    ) -> None:
        self.spec = spec
        self.observer: Observer = observer or NoObserver()
        self.restarts_left = restarts
        self.on_death = on_death
        self.load_timeout = load_timeout
        self.snapshot: EngineSnapshot | None = None
        self.fatal: str | None = None
        self.info: CoreInfo | None = None
        self._ctx = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._adds: dict[int, concurrent.futures.Future[None]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._draining = False
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------

    def launch(self) -> CoreInfo:
        """Start a core and wait for its model; raises what ``LLM(...)`` raised in the
        core (a ``ModelConfigError``, say), or RuntimeError if it died or timed out."""
        process, parent = self._spawn()
        deadline = time.monotonic() + self.load_timeout
        try:
            while True:  # the engine thread publishes its first snapshot before "ready"
                if not parent.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"the engine core did not load in {self.load_timeout} s")
                message = parent.recv()
                if message[0] != "snapshot":
                    break
                self.snapshot = message[1]
        except (EOFError, OSError):
            process.join(KILL_WAIT_S)
            message = ("failed", RuntimeError(self._died_why(process)))
        except BaseException:
            end_process(process, 0.0)
            raise
        if message[0] != "ready":  # what refused the model, as LLM(...) would raise it
            end_process(process, KILL_WAIT_S)
            raise message[1]
        self._process, self._conn, self.info, self.fatal = process, parent, message[1], None
        return self.info

    def _spawn(self) -> tuple[Any, Any]:
        """A new core process and this side's end of its pipe (``dp_remote``: a remote's)."""
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=core_main, args=(self.spec, child), name="engine-core", daemon=False
        )
        process.start()
        child.close()
        return process, parent

    def _died_why(self, process: Any) -> str:
        return f"the engine core process died (exit code {process.exitcode})"

    def start(self, loop: asyncio.AbstractEventLoop, timeout: float = 30.0) -> None:
        if self._reader is not None:
            raise RuntimeError("the core client is already started")
        if self._process is None:
            self.launch()
        self._aloop = loop
        self._reader = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and self.fatal is None

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def submit(
        self, requests: list[tuple[str, object, SamplingParams]], arrival_time: float
    ) -> asyncio.Queue[Event]:
        """As ``EngineLoop.submit``: all of one HTTP request's prompts, or none."""
        if self._draining or not self.alive:
            raise EngineUnavailable(self.fatal or "the server is shutting down")
        sink: asyncio.Queue[Event] = asyncio.Queue()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        key = next(self._keys)
        with self._lock:
            self._streams[key] = _Stream(sink, {r[0] for r in requests})
            self._adds[key] = done
        try:
            self._send(("add", key, requests, arrival_time))
            await asyncio.wrap_future(done)
        except BaseException:
            with self._lock:
                self._streams.pop(key, None)
                self._adds.pop(key, None)
            raise
        return sink

    def abort(self, request_ids: list[str] | tuple[str, ...]) -> None:
        if request_ids and self.alive:  # a core gone meanwhile: nothing is left to abort
            with contextlib.suppress(EngineUnavailable):
                self._send(("abort", tuple(request_ids)))

    def begin_shutdown(self, grace_s: float) -> None:
        self._draining = True
        if self.alive:
            with contextlib.suppress(EngineUnavailable):
                self._send(("drain", grace_s))

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the core to end (it fails what is in flight, 503), then make sure it did."""
        self._stopping = True
        if self._process is None:
            return True
        if self.alive:
            with contextlib.suppress(OSError, EngineUnavailable):
                self._send(("stop",))
        ended = end_process(self._process, timeout)
        if self._reader is not None:
            self._reader.join(KILL_WAIT_S)
        return ended

    # ---- the reader thread -----------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as err:  # the pipe is closed: the core is gone
                raise EngineUnavailable(self.fatal or f"the engine core is gone: {err}") from None

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._core_died():
                    continue  # a new core serves
                return
            try:  # the reader must outlive any one bad message, or every stream hangs
                self._handle(message)
            except Exception:
                log.exception("the engine core's message %r could not be handled", message[0])

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "events":
            self._deliver(message[1])
        elif kind == "added":
            with self._lock:
                done = self._adds.pop(message[1], None)
            if done is not None and not done.done():  # done: its submit was cancelled
                if message[2] is None:
                    done.set_result(None)
                else:
                    with self._lock:
                        self._streams.pop(message[1], None)
                    done.set_exception(message[2])
        elif kind == "snapshot":
            self.snapshot = message[1]
        elif kind == "observe":
            if message[1:2] == ("ended",) and message[2][1] == "aborted":  # no event ends it
                self._forget(message[2][0])
            getattr(self.observer, message[1])(*message[2])
        elif kind == "fatal":
            self.fatal = message[1]

    def _deliver(self, pairs: list[tuple[int, Event]]) -> None:
        batch: list[tuple[asyncio.Queue[Event], Event]] = []
        with self._lock:
            for key, event in pairs:
                stream = self._streams.get(key)
                if stream is None:
                    continue
                batch.append((stream.sink, event))
                if isinstance(event, RequestFailed) or event.finished:
                    stream.open_ids.discard(event.request_id)
                    if not stream.open_ids:
                        del self._streams[key]
        self._post(batch)

    def _forget(self, request_id: str) -> None:
        with self._lock:  # an aborted request's stream, once none of its requests is left
            for key in [k for k, st in self._streams.items() if request_id in st.open_ids]:
                self._streams[key].open_ids.discard(request_id)
                if not self._streams[key].open_ids:
                    del self._streams[key]

    def _post(self, batch: list[tuple[asyncio.Queue[Event], Event]]) -> None:
        if batch and self._aloop is not None:
            # RuntimeError: the event loop is closed, nobody listens any more
            with contextlib.suppress(RuntimeError):
                self._aloop.call_soon_threadsafe(_deliver, batch)

    def _core_died(self) -> bool:
        """The pipe closed. Fail what was in flight; True when a new core now serves."""
        process = self._process
        process.join(KILL_WAIT_S)
        if self._stopping:
            return False
        why = self.fatal or self._died_why(process)
        self.fatal = why
        log.error("%s: failing every request in flight", why)
        with self._lock:
            streams, self._streams = self._streams, {}
            adds, self._adds = self._adds, {}
        for done in adds.values():
            if not done.done():
                done.set_exception(EngineUnavailable(why))
        self._post(
            [(s.sink, RequestFailed(r, why, 500)) for s in streams.values() for r in s.open_ids]
        )
        if self.restarts_left > 0 and not self._draining:
            self.restarts_left -= 1
            log.warning("restarting the engine core (%d restarts left)", self.restarts_left)
            try:
                self.launch()
                return True
            except Exception as err:
                self.fatal = f"{why}; its restart failed: {err}"
        if self.on_death is not None:
            self.on_death(self.fatal)
        return False
