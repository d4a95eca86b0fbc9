"""Engine calls across the core's pipe: what ``EngineLoop.call(fn)`` does in one process,
for an engine core in another (``serve --engine-core process``, data parallelism).

Why names, not functions: a function does not pickle (a lambda, a closure), and running
whatever the peer names would let it run anything. So the API process sends
``("call", key, name, args)`` with ``name`` one of ``CALLS``, plain data as ``args``; the
core builds the function of the engine from the name and runs it on its loop's thread
between two steps (``EngineLoop.call``'s way), and answers ``("called", key, result,
error)``: the result (plain data: a pooled vector as its float32 bytes, cheap to pickle)
or the exception. An exception that would not come back whole (it does not pickle, or
does not unpickle: the reader would take the pipe for broken) comes as ``ValueError(str)``,
as ``add_remote`` answers an unpicklable add error.

The API side (``PendingCalls``) waits for each answer by its key; a core that dies or is
restarted fails every call still waiting (``fail_all``, ``EngineUnavailable``: 503), as
its pending adds are failed: no caller waits forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import pickle
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from paged_engine.pooling import PoolingParams, checked_ids, pool_now

if TYPE_CHECKING:
    from paged_engine.engine.llm_engine import LLMEngine as CoreEngine
    from paged_engine.llm_engine import LLMEngine

Send = Callable[[tuple[Any, ...]], None]


def check_inputs(engine: LLMEngine, ids: list[list[int]]) -> None:
    """Every input refused (``InvalidRequestError`` naming ``input i``) or kept, before
    any is pooled: one call for the whole request, as the in-process route checks."""
    for i, one in enumerate(ids):
        checked_ids(engine, {"prompt_token_ids": one}, f"input {i}")


def pool_bytes(engine: LLMEngine, ids: list[int], normalize: bool, pooling_type: str) -> bytes:
    """``pool_now``'s vector as little-endian float32 bytes: 4 bytes a dimension over the
    pipe, not a pickled tensor (float32 holds a bfloat16 or float16 vector exactly)."""
    vector = pool_now(engine, ids, PoolingParams(normalize, pooling_type))
    return np.asarray(vector.float().numpy(), dtype="<f4").tobytes()


CALLS: dict[str, Callable[..., Any]] = {"check_inputs": check_inputs, "pool": pool_bytes}
"""What the API process may ask a core to run on its engine, by name."""


def engine_function(name: str, args: tuple[Any, ...]) -> Callable[[CoreEngine], Any]:
    """The function of the engine that ``("call", key, name, args)`` asks for (the core);
    an unknown name is a ``ValueError`` answered to the caller."""
    fn = CALLS.get(name)
    if fn is None:
        raise ValueError(f"unknown engine call {name!r}")
    return lambda engine: fn(engine, *args)


def answer_call(send: Send, key: int, done: concurrent.futures.Future[Any]) -> None:
    """Send a finished call's outcome (a done callback, the core's engine thread)."""
    error = done.exception()
    result = None if error is not None else done.result()
    if error is not None:
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:  # it would not come back whole: its message does
            error = ValueError(str(error))
    try:
        send(("called", key, result, error))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an odd result
        send(("called", key, None, ValueError(f"the call's result does not pickle: {exc}")))


class PendingCalls(dict[int, concurrent.futures.Future[Any]]):
    """The API side: what waits for one core's answers, by key (a dict, key -> future):
    its calls, and the ``CoreClient``'s adds (answered ``("added", key, error)``). The
    event loop adds and drops, the reader thread answers and fails: under one lock."""

    def __init__(self) -> None:
        super().__init__()
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def new(self) -> tuple[int, concurrent.futures.Future[Any]]:
        """A fresh key and its future, waiting (registered before its message is sent:
        the answer may come at once)."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            key = next(self._keys)
            self[key] = done
        return key, done

    def drop(self, key: int) -> None:
        """Forget ``key`` (its caller is done or gone: a late answer is then skipped)."""
        with self._lock:
            self.pop(key, None)

    async def call(self, send: Send, name: str, args: tuple[Any, ...]) -> Any:
        """Send ``("call", key, name, args)`` and wait: its result, or its error raised."""
        key, done = self.new()
        try:
            send(("call", key, name, args))
            return await asyncio.wrap_future(done)
        finally:
            self.drop(key)

    def answer(self, key: int, result: Any, error: BaseException | None) -> None:
        """An answer (the reader thread); one whose caller was cancelled is skipped."""
        with self._lock:
            done = self.pop(key, None)
        if done is None or done.done():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def fail_all(self, error: BaseException) -> None:
        """The core died: everything still waiting raises ``error``."""
        with self._lock:
            futures = list(self.values())
            self.clear()
        for done in futures:
            if not done.done():
                done.set_exception(error)
