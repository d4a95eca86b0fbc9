"""Threads that tokenize prompts and render chat templates for the server, so that neither
the HTTP event loop nor the engine thread waits for a long text.

Why threads: a fast (Rust) tokenizer releases the GIL while it encodes, so a long prompt
tokenizes beside the event loop and the engine's steps instead of stopping them. Why not
``concurrent.futures.ThreadPoolExecutor``: its threads are joined when the interpreter
exits, so one long tokenization would hold the process past its shutdown bound; these are
daemon threads, and a job whose caller has gone is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from paged_engine.entrypoints.serving import RequestError

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class TokenizePool:
    """``threads`` daemon workers taking jobs in arrival order; ``run`` awaits one job."""

    def __init__(self, threads: int) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"tokenize-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker; its exception is raised here. Cancelled, the job is
        skipped if it has not started (a started one runs to its end, unread)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, loop, future))
        return await future

    async def prepared(self, job: Callable[[], list[object]], param: str) -> list[object]:
        """``job``'s prompts for the engine (tokenized, a chat template rendered); a
        tokenizer or template that raises is the input's fault: a 400 naming ``param``."""
        try:
            return await self.run(job)
        except RequestError:
            raise
        except Exception as exc:
            raise RequestError(f"the prompt could not be tokenized: {exc}", param=param) from exc

    def close(self) -> None:
        """Let the workers end once the queued jobs are done (returns at once)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, loop, future = job
            if future.cancelled():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, whatever it is
                _hand(loop, future, None, exc)
            else:
                _hand(loop, future, result, None)


def _hand(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: object,
    exc: BaseException | None,
) -> None:
    def settle() -> None:
        if future.done():  # cancelled meanwhile
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody waits
        loop.call_soon_threadsafe(settle)


def encoder(tokenizer: Any, prompts: list[Any]) -> Callable[[], list[object]]:
    """A job giving the engine's form of ``prompts``: each text with its token ids (as
    the engine would tokenize it), token ids as they are. Without a tokenizer the texts
    go as they are, for the engine to refuse by name."""

    def encode() -> list[object]:
        if tokenizer is None:
            return list(prompts)
        return [
            {"prompt": p, "prompt_token_ids": list(tokenizer.encode(p))}
            if isinstance(p, str)
            else p
            for p in prompts
        ]

    return encode
