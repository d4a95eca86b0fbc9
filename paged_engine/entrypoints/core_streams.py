"""The API process's table of the streams one engine core feeds: which ``submit`` each
request belongs to, its text (``core_outputs.TextOutputs``), and the metrics' view of it.

Why apart from ``core_client``: the client is about the core's process (launch, pipe,
death, restart); this is about requests, and it is what the reader thread runs on every
step's events. Two threads use it: the event loop opens and closes streams (``submit``),
the reader thread delivers, forgets and fails them; the table is changed under one lock,
the text is made outside it.

The metrics observer sees, as with the in-process loop: ``added`` (forwarded from the
core), every output (from here: the core sends no text), and one ``ended`` per request.
A request that ends here (a stop string, or its text could not be made) is reported here
and aborted in the core, whose own later report of it is dropped; the core's ``finished``
is always dropped, as the final output, built here, reports it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from paged_engine.entrypoints.core_outputs import TextOutputs
from paged_engine.entrypoints.core_wire import Restarted, WireOutput
from paged_engine.entrypoints.loop_types import Event, Observer, RequestFailed
from paged_engine.sampling_params import SamplingParams

log = logging.getLogger("paged_engine.entrypoints.core_client")

Batch = list[tuple[asyncio.Queue[Event], Event]]
Requests = list[tuple[str, object, SamplingParams]]


@dataclass(slots=True)
class _Stream:
    """One ``submit``: its queue, and its requests not yet ended."""

    sink: asyncio.Queue[Event]
    open_ids: set[str]


class CoreStreams:
    """See the module docstring."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.text = TextOutputs(tokenizer)
        self._streams: dict[int, _Stream] = {}
        self._key_of: dict[str, int] = {}
        self._ended_here: set[str] = set()
        """Requests ended here and aborted in the core, whose report is still to come."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._streams)

    def use_tokenizer(self, tokenizer: Any | None) -> None:
        """The tokenizer the text is made with (the engine's); before any request."""
        if self._streams:
            raise RuntimeError("the tokenizer cannot change while requests are in flight")
        self.text = TextOutputs(tokenizer)

    def open(self, key: int, sink: asyncio.Queue[Event], requests: Requests) -> Requests:
        """Track one ``submit``'s requests; returns them as the core runs them."""
        ids = [r[0] for r in requests]
        with self._lock:
            sent = [(r, prompt, self.text.add(r, params)) for r, prompt, params in requests]
            self._streams[key] = _Stream(sink, set(ids))
            for r in ids:
                self._key_of[r] = key
        return sent

    def close(self, key: int) -> None:
        """Forget a ``submit`` the core refused or that was cancelled."""
        with self._lock:
            stream = self._streams.pop(key, None)
            for r in () if stream is None else stream.open_ids:
                self._key_of.pop(r, None)
                self.text.forget(r)

    def deliver(self, pairs: list[tuple[int, Any]], observer: Observer) -> tuple[Batch, list[str]]:
        """One step's events from the core: the batch for the event loop, and the requests
        that ended here, to abort in the core."""
        batch: Batch = []
        ended_here: list[str] = []
        for key, item in pairs:
            stream = self._streams.get(key)
            if stream is None or self._key_of.get(item.request_id) != key:
                continue  # its stream ended (here, say, by a stop string): news too late
            if isinstance(item, Restarted):
                self.text.restart(item.request_id)
                continue
            event = self._event(item, observer, ended_here)
            if event is not None:
                batch.append((stream.sink, event))
                if isinstance(event, RequestFailed) or event.finished:
                    self._close_id(event.request_id)
        return batch, ended_here

    def _event(
        self, item: WireOutput | RequestFailed, observer: Observer, ended_here: list[str]
    ) -> Event | None:
        rid = item.request_id
        if isinstance(item, RequestFailed):
            self.text.forget(rid)
            return item
        try:
            built = self.text.build(item)
        except Exception as exc:  # this request's text alone: it fails, the step goes on
            log.exception("the output of request %s could not be made", rid)
            self.text.forget(rid)
            if item.finished:  # the core has ended it too, and said so already
                observer.ended(rid, "failed")
            else:
                self._end_here(rid, "failed", observer, ended_here)
            return RequestFailed(rid, f"its output could not be made: {exc!r}", 500)
        if built is None:
            return None
        observer.output(built.delta)
        if built.delta.finished:
            if built.ended_here:
                self._end_here(rid, "finished", observer, ended_here)
            else:
                observer.ended(rid, "finished")
        return built.client

    def _end_here(self, rid: str, how: str, observer: Observer, ended_here: list[str]) -> None:
        with self._lock:
            self._ended_here.add(rid)
        ended_here.append(rid)
        observer.ended(rid, how)

    def _close_id(self, rid: str) -> None:
        with self._lock:
            key = self._key_of.pop(rid, None)
            stream = None if key is None else self._streams.get(key)
            if stream is not None:
                stream.open_ids.discard(rid)
                if not stream.open_ids:
                    del self._streams[key]  # type: ignore[arg-type]

    def core_ended(self, rid: str, how: str, observer: Observer) -> None:
        """The core's report that a request left it (``observe ended``)."""
        with self._lock:
            here = rid in self._ended_here
            self._ended_here.discard(rid)
        if here or how == "finished":  # reported already, or by its final output
            return
        if how == "aborted":  # a disconnect: no event ends its stream
            self.text.forget(rid)
            self._close_id(rid)
        observer.ended(rid, how)

    def fail_all(self, why: str, observer: Observer) -> Batch:
        """The core is gone: every request in flight ends with a ``RequestFailed``."""
        with self._lock:
            streams, self._streams = self._streams, {}
            self._key_of.clear()
            self._ended_here.clear()
        self.text.clear()
        batch: Batch = []
        for s in streams.values():
            for r in s.open_ids:
                batch.append((s.sink, RequestFailed(r, why, 500)))
                observer.ended(r, "failed")
        return batch
