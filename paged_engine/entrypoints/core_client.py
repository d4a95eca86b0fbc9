"""The API process's side of the engine core process (``core_process.py``): the same
interface as ``EngineLoop`` (``start``, ``submit``, ``abort``, ``begin_shutdown``,
``stop``, ``alive``, ``draining``, ``fatal``, ``snapshot``), so ``OpenAIServer`` serves
either without knowing which.

One reader thread receives everything the core sends: each step's token deltas become
text and outputs here (``core_streams``, ``core_outputs``), handed to the event loop with
one ``call_soon_threadsafe`` (as ``EngineLoop`` does); also the metrics' reports, the add
answers to the waiting ``submit``s, the answers to ``call_core`` (``core_calls``).

Faults: if the core process dies (its pipe closes or cannot be read, or its engine thread
died), every request in flight ends with a ``RequestFailed`` (500) naming it, pending adds
and calls are refused (503), ``alive`` turns False (``/health`` 503), and ``on_death`` is
called: the server exits, or, with restarts left, a new core serves once loaded (503 until
then). ``stop`` asks the core to finish, then terminates and kills it after a bound, a
core being restarted too: no process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from paged_engine.entrypoints.core_calls import PendingCalls
from paged_engine.entrypoints.core_process import (
    CoreInfo,
    CoreSpec,
    core_main,
    end_process,
    first_answer,
)
from paged_engine.entrypoints.core_streams import CoreStreams
from paged_engine.entrypoints.engine_loop import _deliver
from paged_engine.entrypoints.loop_types import (
    EngineSnapshot,
    EngineUnavailable,
    Event,
    NoObserver,
    Observer,
)
from paged_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

KILL_WAIT_S = 2.0
"""After ``stop``'s own timeout: how long a terminated core may take before SIGKILL."""


class CoreClient:
    """See the module docstring. ``launch`` starts the core and waits for its model (its
    ``CoreInfo``); ``start(loop)`` binds the event loop that reads outputs."""

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
        self.streams = CoreStreams()
        """The requests in flight; ``streams.use_tokenizer``: the engine's tokenizer."""
        self._adds = PendingCalls()
        self.calls = PendingCalls()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._draining = False
        self._stopping = False
        self._launching: Any = None  # a core being started, until it serves or is given up
        self._life = threading.Lock()
        """Orders ``launch`` (maybe on the reader thread: a restart) and ``stop``."""

    # ---- lifecycle ---------------------------------------------------------------------

    def launch(self) -> CoreInfo:
        """Start a core and wait for its model; raises what ``LLM(...)`` raised in the
        core (a ``ModelConfigError``, say), or RuntimeError if it died or timed out."""
        with self._life:
            if self._stopping:
                raise RuntimeError("the core client is stopping")
            process, parent = self._spawn()
            self._launching = process  # stop() ends it while it loads
        snapshot = None
        try:
            snapshot, message = first_answer(parent, self.load_timeout)
        except (EOFError, OSError):
            process.join(KILL_WAIT_S)
            message = ("failed", RuntimeError(self._died_why(process)))
        except BaseException:
            self._abandon(process, parent, 0.0)
            raise
        if message[0] != "ready":  # what refused the model, as LLM(...) would raise it
            self._abandon(process, parent, KILL_WAIT_S)
            raise message[1]
        with self._life:
            self._launching = None
            if self._stopping:  # stop() came while it loaded
                self._abandon(process, parent, 0.0)
                raise RuntimeError("the core client is stopping")
            self._process, self._conn, self.info, self.fatal = process, parent, message[1], None
            self.snapshot = snapshot or self.snapshot
        return self.info

    def _abandon(self, process: Any, conn: Any, timeout: float) -> None:
        """End a core that will not serve, and its pipe."""
        self._launching = None
        end_process(process, timeout)
        with contextlib.suppress(OSError):
            conn.close()

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
        key, done = self._adds.new()
        try:
            sent = self.streams.open(key, sink, requests)
            self._send(("add", key, sent, arrival_time))
            await asyncio.wrap_future(done)
        except BaseException:
            self.streams.close(key)
            self._adds.drop(key)
            raise
        return sink

    async def call_core(self, name: str, *args: Any) -> Any:
        """``core_calls.CALLS[name](engine, *args)`` run on the core's loop thread: its
        result, or raise its error (``EngineUnavailable`` if the core dies meanwhile)."""
        if self._draining or not self.alive:
            raise EngineUnavailable(self.fatal or "the server is shutting down")
        return await self.calls.call(self._send, name, args)

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
        """Ask the core to end (it fails what is in flight, 503), then make sure it did;
        a core being started meanwhile (a restart) is ended too."""
        with self._life:
            self._stopping = True
            process, launching = self._process, self._launching
        if launching is not None:
            end_process(launching, 0.0)
        if process is None:
            return True
        if process.is_alive():  # even with ``fatal`` set: the process may still read
            with contextlib.suppress(OSError, EngineUnavailable):
                self._send(("stop",))
        ended = end_process(process, timeout)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(KILL_WAIT_S)
        with contextlib.suppress(OSError):
            self._conn.close()
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
            except Exception as err:
                if not isinstance(err, EOFError | OSError):  # unreadable: the core is lost
                    log.error("the engine core's pipe is unreadable (%r): ending it", err)
                    self._process.terminate()
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
            batch, ended_here = self.streams.deliver(message[1], self.observer)
            self._post(batch)
            self.abort(ended_here)
        elif kind == "added":  # a refused add's stream is closed (a cancelled one's too)
            if message[2] is not None:
                self.streams.close(message[1])
            self._adds.answer(message[1], None, message[2])
        elif kind == "called":
            self.calls.answer(message[1], message[2], message[3])
        elif kind == "snapshot":
            self.snapshot = message[1]
        elif kind == "observe":
            if message[1] == "ended":
                request_id, how = message[2]
                self.streams.core_ended(request_id, how, self.observer)
            else:
                getattr(self.observer, message[1])(*message[2])
        elif kind == "fatal":  # the engine thread died: end the core (restart or exit)
            self.fatal = message[1]
            self._process.terminate()

    def _post(self, batch: list[tuple[asyncio.Queue[Event], Event]]) -> None:
        if batch and self._aloop is not None:  # RuntimeError: the event loop is closed
            with contextlib.suppress(RuntimeError):
                self._aloop.call_soon_threadsafe(_deliver, batch)

    def _core_died(self) -> bool:
        """The pipe closed. Fail what was in flight; True when a new core now serves."""
        process = self._process
        process.join(KILL_WAIT_S)
        with contextlib.suppress(OSError):
            self._conn.close()
        if self._stopping:
            return False
        why = self.fatal or self._died_why(process)
        self.fatal = why
        log.error("%s: failing every request in flight", why)
        self._adds.fail_all(EngineUnavailable(why))
        self.calls.fail_all(EngineUnavailable(why))
        self._post(self.streams.fail_all(why, self.observer))
        if self.restarts_left > 0 and not self._draining:
            self.restarts_left -= 1
            log.warning("restarting the engine core (%d restarts left)", self.restarts_left)
            try:
                self.launch()
                return True
            except Exception as err:
                self.fatal = f"{why}; its restart failed: {err}"
        if self.on_death is not None and not self._stopping:
            self.on_death(self.fatal)
        return False
