"""The server's latency metrics are measured, not derived: over the fake model, whose
runner sleeps a known, uneven time per decode step, the inter-token latency histogram of
a request holds one observation per step with the step's own duration, streamed or not
(a mean gap spread over the tokens would put them all in one bucket)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

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
SLEEPS = [0.6, 0.0, 0.6, 0.0, 0.6, 0.0]
"""Seconds each decode step sleeps: three gaps far above the 0.5 s bucket's bound, three
far below 0.25 s; their mean (0.3 s) lies between."""


class SleepingRunner(CheckedRunner):
    def __init__(self) -> None:
        super().__init__(CONFIG, VOCAB, 1_000)
        self.decodes = 0

    def run(self, seqs: list[Any], is_prefill: bool) -> list[int]:
        if not is_prefill:
            time.sleep(SLEEPS[self.decodes % len(SLEEPS)])
            self.decodes += 1
        return super().run(seqs, is_prefill)


def serve_one(kind: RequestOutputKind) -> dict[str, float]:
    """One request of ``len(SLEEPS) + 1`` tokens through an engine loop; the metrics."""
    engine = build_engine(CONFIG, spec=False)
    engine.model_runner = SleepingRunner()
    metrics = ServerMetrics()
    params = SamplingParams(
        temperature=0, max_tokens=len(SLEEPS) + 1, ignore_eos=True, output_kind=kind
    )

    async def main() -> None:
        loop = EngineLoop(engine, observer=metrics)
        metrics.bind(loop)
        loop.start(asyncio.get_running_loop())
        try:
            sink = await loop.submit([("r", [1, 2, 3], params)], time.time())
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
def test_inter_token_latency_is_each_steps_own_gap(kind: RequestOutputKind) -> None:
    m = serve_one(kind)
    bucket = 'inter_token_latency_seconds_bucket{le="%s"}'
    assert m["inter_token_latency_seconds_count"] == len(SLEEPS)
    # the three quick steps, and only they, are under 0.25 s; the slow ones above 0.5 s
    assert m[bucket % "0.25"] == 3 and m[bucket % "0.5"] == 3, m
    assert m[bucket % "+Inf"] == 6
    assert sum(SLEEPS) <= m["inter_token_latency_seconds_sum"] < sum(SLEEPS) + 0.6
    assert m["time_to_first_token_seconds_count"] == 1
