"""The server's latency metrics are measured, not derived: over the fake model, with the
engine's clock controlled (each decode step advances it by a known, uneven time), the
inter-token latency histogram of a request holds one observation per step with the
step's own duration, streamed or not (a mean gap spread over the tokens would put them
all in one bucket)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import paged_engine.engine.output_processor as output_processor
from paged_engine.config import EngineConfig
from paged_engine.entrypoints.engine_loop import EngineLoop
from paged_engine.entrypoints.loop_types import RequestFailed
from paged_engine.entrypoints.metrics import ServerMetrics
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_machine import VOCAB, CheckedRunner, build_engine
from tests.test_server_support import parse_metrics

pytestmark = pytest.mark.timeout(60)
CONFIG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=4,
    max_model_len=64,
    kvcache_block_size=4,
    num_kvcache_blocks=64,
)
STEPS = [0.6, 0.01, 0.6, 0.01, 0.6, 0.01]
"""Seconds each decode step takes on the engine's clock: three gaps above the 0.5 s
bucket's bound, three below 0.25 s; their mean (0.305 s) lies between."""


class Clock:
    """The engine's wall clock (``time.time`` where it stamps token times), moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0  # small: gaps exact to 1e-13

    def time(self) -> float:
        return self.now


class TimedRunner(CheckedRunner):
    """The fake model, each decode step advancing ``clock`` by the next of ``STEPS``."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(CONFIG, VOCAB, 1_000)
        self.clock = clock
        self.decodes = 0

    def run(self, seqs: list[Any], is_prefill: bool) -> list[int]:
        if not is_prefill:
            self.clock.now += STEPS[self.decodes % len(STEPS)]
            self.decodes += 1
        return super().run(seqs, is_prefill)


def serve_one(kind: RequestOutputKind, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """One request of ``len(STEPS) + 1`` tokens through an engine loop; the metrics."""
    clock = Clock()
    monkeypatch.setattr(output_processor, "time", clock)
    engine = build_engine(CONFIG, spec=False)
    engine.model_runner = TimedRunner(clock)
    metrics = ServerMetrics()
    params = SamplingParams(
        temperature=0, max_tokens=len(STEPS) + 1, ignore_eos=True, output_kind=kind
    )

    async def main() -> None:
        loop = EngineLoop(engine, observer=metrics)
        metrics.bind(loop)
        loop.start(asyncio.get_running_loop())
        try:
            sink = await loop.submit([("r", [1, 2, 3], params)], clock.now)
            while True:
                event = await asyncio.wait_for(sink.get(), 30)
                assert not isinstance(event, RequestFailed), event
                if event.finished:
                    return
        finally:
            await asyncio.to_thread(loop.stop, 10)

    asyncio.run(main())
    return parse_metrics(metrics.render().decode())


@pytest.mark.parametrize(
    "kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA], ids=["whole", "streamed"]
)
def test_inter_token_latency_is_each_steps_own_gap(
    kind: RequestOutputKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = serve_one(kind, monkeypatch)
    bucket = 'inter_token_latency_seconds_bucket{le="%s"}'
    assert m["inter_token_latency_seconds_count"] == len(STEPS)
    # the three quick steps, and only they, are under 0.25 s; the slow ones above 0.5 s
    assert m[bucket % "0.025"] == 3 and m[bucket % "0.25"] == 3 and m[bucket % "0.5"] == 3, m
    assert m[bucket % "0.75"] == 6
    assert m["inter_token_latency_seconds_sum"] == pytest.approx(sum(STEPS))
    assert m["time_to_first_token_seconds_count"] == 1
