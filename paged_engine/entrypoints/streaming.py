"""Answering a request from its engine events: a whole response when every prompt has
finished (abandoned if the client disconnects first), or a server-sent-event stream.

Either way the caller's ``release`` runs exactly once however the answer ends (finished,
failed, cancelled by a disconnect, or never started), and aborts whatever of the request
is still in the engine: that is how a disconnect frees blocks at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from paged_engine.engine.request import RequestOutput
from paged_engine.entrypoints.formatters import ChatFormatter, CompletionFormatter
from paged_engine.entrypoints.loop_types import RequestFailed
from paged_engine.entrypoints.protocol import error_body
from paged_engine.entrypoints.serving import RequestError, sse

DONE = "data: [DONE]\n\n"


async def collect(
    sink: asyncio.Queue[RequestOutput | RequestFailed], pending: set[str], ids: list[str]
) -> list[RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while pending:
        event = await sink.get()
        if isinstance(event, RequestFailed):
            raise RequestError(event.message, status=event.status)
        if event.finished:
            finals[event.request_id] = event
            pending.discard(event.request_id)
    return [finals[r] for r in ids]


async def until_disconnect(request: Request, work: Any) -> list[RequestOutput] | None:
    """``work``'s result, or None (``work`` cancelled, and awaited) if the client
    disconnects first. Cancelled itself, it cancels both and waits for them."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # cancel() only asks: a task is cancelled once it has run again, so each is
        # awaited before its state is read.
        for t in (watcher, task):
            if not t.done():
                t.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        return None
    result: list[RequestOutput] = task.result()
    return result


async def stream_events(
    sink: asyncio.Queue[RequestOutput | RequestFailed],
    pending: set[str],
    fmt: CompletionFormatter | ChatFormatter,
    include_usage: bool,
) -> AsyncIterator[str]:
    while pending:
        event = await sink.get()
        if isinstance(event, RequestFailed):
            pending.clear()
            type_ = "server_error"
            yield sse(error_body(event.message, type_, None, event.status))
            yield DONE
            return
        for chunk in fmt.chunks(event):
            yield chunk
        if event.finished:
            pending.discard(event.request_id)
    if include_usage:
        yield fmt.usage_chunk()
    yield DONE


class EngineStream(StreamingResponse):
    """An SSE response that releases its requests however it ends: finished, cancelled by
    a disconnect (Starlette cancels the stream on ``http.disconnect``), or never started."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
