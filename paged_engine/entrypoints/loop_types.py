"""What the engine loop and its users exchange: the events a request's queue receives, the
error ``submit`` raises when it takes nothing, a function to run on the engine's thread
(``EngineCall``), the snapshot ``/metrics`` reads, and the observer the loop reports to.
No dependency beyond the engine's outputs (and its type, for ``EngineCall``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from paged_engine.engine.request import RequestOutput

if TYPE_CHECKING:
    from paged_engine.engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The end of a request that will not complete: ``status`` 500 (the engine failed) or
    503 (the server is shutting down); it has been aborted in the engine."""

    request_id: str
    message: str
    status: int


Event = RequestOutput | RequestFailed


@dataclass(slots=True)
class EngineCall:
    """A function of the engine that the loop runs on its thread between two steps, its
    result or exception set on ``done`` (``EngineLoop.call``)."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


class EngineUnavailable(RuntimeError):
    """``submit`` refused: the loop is draining for shutdown or has stopped (503)."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's counters, published by the loop after every iteration; ``running``
    and ``waiting`` count sequences (each of a request's ``n`` completions), as vLLM's
    engine counts its child requests."""

    running: int
    waiting: int
    blocks_in_use: int
    num_blocks: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    preemptions: int
    steps: int
    failed_steps: int


class Observer(Protocol):
    """What the loop reports as it goes (the metrics); called on the engine thread."""

    def added(self, request_ids: list[str], arrival_time: float) -> None: ...
    def output(self, out: RequestOutput) -> None: ...
    def ended(self, request_id: str, how: str) -> None: ...


class NoObserver:
    """Reports to nobody."""

    def added(self, request_ids: list[str], arrival_time: float) -> None:
        return None

    def output(self, out: RequestOutput) -> None:
        return None

    def ended(self, request_id: str, how: str) -> None:
        return None
