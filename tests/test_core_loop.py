"""The engine core process's loop (``core_process.CoreLoop``) over the fake model, its pipe
replaced by a list: what it sends for each request.

* a request's prompt (and prompt logprobs) travel once, with its first output; the final
  output does not repeat them (it did: the request's end was reported to the observer,
  which forgot it, before the final output was encoded);
* a ``FINAL_ONLY`` request is relayed step by step all the same (the API process merges)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from paged_engine.config import EngineConfig
from paged_engine.entrypoints.core_process import CoreLoop, _Sender
from paged_engine.entrypoints.core_wire import WireOutput, core_params
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_machine import VOCAB, CheckedRunner, build_engine

pytestmark = pytest.mark.timeout(60)
CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=64,
    kvcache_block_size=4,
    num_kvcache_blocks=64,
)


class ListPipe:
    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.changed = threading.Condition()

    def send(self, message: Any) -> None:
        with self.changed:
            self.messages.append(message)
            self.changed.notify_all()

    def outputs(self) -> list[tuple[int, WireOutput]]:
        with self.changed:
            return [
                item
                for m in self.messages
                if m[0] == "events"
                for item in m[1]
                if isinstance(item[1], WireOutput)
            ]


def relay(requests: list[tuple[str, list[int], SamplingParams]]) -> list[tuple[int, WireOutput]]:
    engine = build_engine(CONFIG, spec=False)
    engine.model_runner = CheckedRunner(CONFIG, VOCAB, 5_000)
    pipe = ListPipe()
    loop = CoreLoop(engine, _Sender(pipe), max_step_failures=3)
    loop.start(asyncio.new_event_loop())  # as core_main: events go through the pipe
    try:
        sent = [(r, p, core_params(params)) for r, p, params in requests]
        loop.add_remote(7, sent, time.time())
        deadline = time.monotonic() + 30
        with pipe.changed:
            while sum(w.finished for _, w in pipe.outputs()) < len(requests):
                assert time.monotonic() < deadline, "the requests did not finish"
                pipe.changed.wait(0.5)
    finally:
        assert loop.stop(10)
    return pipe.outputs()


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_the_prompt_travels_once_with_the_first_output(kind: RequestOutputKind) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1, output_kind=kind
    )
    prompts = {"a": [1, 2, 3], "b": [2, 3, 4, 1, 2]}
    outputs = relay([(r, p, params) for r, p in prompts.items()])
    for r, prompt in prompts.items():
        mine = [w for key, w in outputs if w.request_id == r]
        assert all(key == 7 for key, w in outputs)
        assert sum(len(w.completions[0].token_ids) for w in mine) == 5
        assert len(mine) == 5, "one output per token, FINAL_ONLY too (relayed)"
        assert mine[0].prompt_token_ids == prompt and mine[0].prompt_logprobs is not None
        assert [w.prompt_token_ids for w in mine[1:]] == [None] * 4
        assert [w.prompt_logprobs for w in mine[1:]] == [None] * 4
        assert [w.finished for w in mine] == [False] * 4 + [True]
