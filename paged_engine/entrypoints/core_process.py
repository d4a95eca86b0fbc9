"""The engine core in a process of its own (``serve --engine-core process``): the child
side. The API process (``core_client.py``) keeps HTTP, tokenizing and streaming; this
process keeps the scheduler, the allocator and the model runner, and steps them.

Why a process: in one interpreter the HTTP stack and the engine share the GIL, so every
parsed request, every streamed chunk and every step wait for each other. Here the engine
thread runs the same ``EngineLoop`` as the in-process server (its fault isolation, its
draining, its snapshot), with two differences: a request's sink is a ``RemoteSink``, a
key the API process maps back to its stream, and a step's events, the snapshot and the
metrics observer's calls are sent over one pipe instead of being handed to an event loop.

The wire (``multiprocessing`` connections, pickled tuples of plain records):

* API → core: ``("add", key, requests, arrival_time)``, ``("abort", ids)``,
  ``("call", key, name, args)`` (a function of the engine, by name: ``core_calls``),
  ``("drain", grace_s)``, ``("stop",)``;
* core → API: ``("ready", info)`` once the model is loaded (or ``("failed", error)``),
  ``("added", key, error)`` for each add (``error`` None or the exception ``add_request``
  raised), ``("called", key, result, error)`` for each call, ``("events", [(key, item),
  ...])`` once per step (``item`` a
  ``core_wire.WireOutput``: token ids, no text; or a ``RequestFailed`` or ``Restarted``),
  ``("snapshot", s)`` when it changed, ``("observe", method, args)`` for the metrics
  (``added`` and ``ended``), and ``("fatal", message)`` if the engine thread dies.

The API process adds requests with ``core_wire.core_params`` (tokens only) and makes their
text itself (``core_outputs.py``); a stop string it finds ends the request there, and an
``abort`` here.

Lifetime: the core ignores SIGINT (the terminal's Ctrl-C is the API process's to handle:
it drains, then stops the core), and ends when its pipe closes, so an API process that dies
leaves no orphan core. A core on another host (``dp_headless``) speaks the same wire over
an authenticated TCP connection to the head, and ends when that connection closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.core_calls import answer_call, engine_function
from paged_engine.entrypoints.core_wire import encode
from paged_engine.entrypoints.engine_loop import EngineLoop, _Add
from paged_engine.entrypoints.loop_types import EngineCall, EngineSnapshot
from paged_engine.entrypoints.routes import Batch
from paged_engine.ray_support import end_ray

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """What a core needs to start: the model and ``LLM``'s keywords, picklable."""

    model: str
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    max_step_failures: int = 3


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the core reports once loaded (the API process loads no weights)."""

    max_model_len: int
    num_blocks: int
    pid: int
    block_size: int
    prefix_cache_hash: str


@dataclass(frozen=True, slots=True)
class RemoteSink:
    """A request's sink inside the core: the key of its stream in the API process."""

    key: int


class _Sender:
    """One pipe written from several threads (the engine thread, the command reader)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def __call__(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(message)


class _ForwardingObserver:
    """The metrics observer, called on the engine thread, forwarded to the API process;
    but for ``output``: the API process sees every output as it builds its text."""

    def __init__(self, send: _Sender, introduced: set[str]) -> None:
        self._send = send
        self._introduced = introduced

    def added(self, request_ids: list[str], arrival_time: float) -> None:
        self._send(("observe", "added", (request_ids, arrival_time)))

    def output(self, out: RequestOutput) -> None:
        return None

    def ended(self, request_id: str, how: str) -> None:
        if how != "finished":  # a finished one's last output is still to be posted
            self._introduced.discard(request_id)
        self._send(("observe", "ended", (request_id, how)))


class CoreLoop(EngineLoop):
    """``EngineLoop`` whose events, snapshots and death are sent over the pipe."""

    def __init__(self, engine: LLMEngine, send: _Sender, max_step_failures: int) -> None:
        introduced: set[str] = set()
        super().__init__(
            engine,
            max_step_failures=max_step_failures,
            observer=_ForwardingObserver(send, introduced),
        )
        self._routes.relay = True
        self._send = send
        self._sent_snapshot: EngineSnapshot | None = None
        self._introduced = introduced
        """Requests whose first output (the one with the prompt) has been sent."""

    def _post(self, batch: Batch) -> None:
        if not batch:
            return
        items: list[tuple[int, Any]] = []
        for sink, event in batch:
            if isinstance(event, RequestOutput):
                rid = event.request_id
                first = rid not in self._introduced
                if event.finished:
                    self._introduced.discard(rid)
                elif first:
                    self._introduced.add(rid)
                items.append((sink.key, encode(event, first)))  # type: ignore[attr-defined]
            else:  # RequestFailed, Restarted
                items.append((sink.key, event))  # type: ignore[attr-defined]
        self._send(("events", items))

    def _run(self) -> None:
        super()._run()
        if self.fatal is not None:  # the thread died: every waiter was failed (events)
            self._send(("fatal", self.fatal))

    def _publish(self) -> None:
        super()._publish()
        if self.snapshot != self._sent_snapshot:
            self._sent_snapshot = self.snapshot
            self._send(("snapshot", self.snapshot))

    def add_remote(self, key: int, requests: list[Any], arrival_time: float) -> None:
        """Queue an add whose outcome is answered over the pipe (any thread)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def answer(f: concurrent.futures.Future[None]) -> None:
            error = f.exception()
            try:
                self._send(("added", key, error))
            except (pickle.PicklingError, TypeError, AttributeError):  # an unpicklable error
                self._send(("added", key, ValueError(str(error))))

        done.add_done_callback(answer)
        sink: Any = RemoteSink(key)
        try:
            self._put(_Add(requests, arrival_time, sink, done))
        except Exception as exc:  # the loop has stopped: refused like any closed loop
            if not done.done():
                done.set_exception(exc)

    def call_remote(self, key: int, name: str, args: tuple[Any, ...]) -> None:
        """Run the engine call ``name`` on the loop's thread (``EngineLoop.call``'s way),
        its outcome answered over the pipe (the command reader's thread)."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        done.add_done_callback(lambda f: answer_call(self._send, key, f))
        try:
            self._put(EngineCall(engine_function(name, args), done))
        except Exception as exc:  # an unknown name, or the loop has stopped
            done.set_exception(exc)


def core_main(spec: CoreSpec, conn: Any) -> None:
    """The core process's entry point (``multiprocessing`` spawn target). ``conn`` is the
    pipe from ``CoreClient`` or a headless core's TCP connection to the head: both are
    ``multiprocessing`` connections, so one protocol serves a local and a remote replica."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send = _Sender(conn)
    try:  # what LLM(model, **llm_kwargs) builds, never in a process of its own again
        from paged_engine.engine_args import engine_args_from_kwargs
        from paged_engine.llm_engine import LLMEngine as ModelEngine  # torch: the core's

        kwargs = dict(spec.llm_kwargs)
        tokenizer = kwargs.pop("tokenizer", None)
        args = engine_args_from_kwargs(spec.model, tokenizer, kwargs)
        engine = ModelEngine.from_engine_args(args)
    except BaseException as exc:  # refused (a ModelConfigError, say): raised again there
        try:
            send(("failed", exc))
        except (pickle.PicklingError, TypeError, AttributeError):
            send(("failed", RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    loop = CoreLoop(engine, send, spec.max_step_failures)
    loop.start(asyncio.new_event_loop())  # never run: events go through _post
    config = engine.config
    info = CoreInfo(
        config.max_model_len,
        engine.num_blocks,
        os.getpid(),
        config.kvcache_block_size,
        config.prefix_cache_hash,
    )
    send(("ready", info))
    try:
        _read_commands(conn, loop)
    finally:
        stopped = loop.stop(10.0)
        engine.close()
        end_ray()  # a local Ray its tensor-parallel ranks started (os._exit skips Ray's)
        conn.close()
        logging.shutdown()
        os._exit(0 if stopped else 1)


def _read_commands(conn: Any, loop: CoreLoop) -> None:
    """Apply the API process's commands until ``stop`` or the pipe closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the API process is gone
            return
        kind = message[0]
        if kind == "add":
            loop.add_remote(message[1], message[2], message[3])
        elif kind == "call":
            loop.call_remote(message[1], message[2], message[3])
        elif kind == "abort":
            loop.abort(message[1])
        elif kind == "drain":
            loop.begin_shutdown(message[1])
        elif kind == "stop":
            return
        else:
            log.error("unknown command %r from the API process", kind)


def first_answer(conn: Any, timeout: float) -> tuple[EngineSnapshot | None, tuple[Any, ...]]:
    """A starting core's last snapshot and its ``ready`` (or ``failed``) message: the
    engine thread publishes its first snapshot before ``ready``. ``EOFError``/``OSError``
    if it died; ``RuntimeError`` if it did not load within ``timeout``."""
    deadline = time.monotonic() + timeout
    snapshot = None
    while True:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"the engine core did not load in {timeout} s")
        message = conn.recv()
        if message[0] != "snapshot":
            return snapshot, message
        snapshot = message[1]


def end_process(process: Any, timeout: float, kill_wait_s: float = 2.0) -> bool:
    """Wait for ``process``; terminate, then kill it after the bound. True if it ended
    within ``timeout`` by itself."""
    process.join(timeout)
    if not process.is_alive():
        return True
    process.terminate()
    process.join(kill_wait_s)
    if process.is_alive():
        process.kill()
        process.join(kill_wait_s)
    return False
