"""Scheduler + allocator throughput: the whole ``LLMEngine`` loop with a scripted fake model.

The allocator suite's wave trace and scenarios (``bench.scenarios``), run through the real
``LLMEngine``: ``add_request`` (validation included), ``step()`` (schedule, the fake
model, postprocess: hash_blocks, stop conditions, release) until each wave drains. The
fake model "samples" each request's scripted output, O(1) per sequence, so the figure is
the engine's own cost: microseconds per sequence-step (one sequence scheduled in one
step). Target (reported by bench/report.py, not asserted): <= 10 us per sequence-step.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from bench.scenarios import SCENARIOS, TRACE, Scenario, trace
from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.sequence import Sequence
from paged_engine.sampling_params import RequestOutputKind, SamplingParams

TARGET_US = 10.0


class ScriptedModel:
    """Returns each request's next scripted token; nothing for an unfinished chunk."""

    def __init__(self) -> None:
        self.scripts: dict[int, tuple[int, ...]] = {}
        self.seq_steps = 0

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        self.seq_steps += len(seqs)
        scripts = self.scripts
        return [
            None
            if s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens
            else scripts[s.seq_id][s.num_tokens - s.num_prompt_tokens]
            for s in seqs
        ]


def run_engine(scenario: Scenario) -> tuple[ScriptedModel, LLMEngine]:
    model = ScriptedModel()
    config = EngineConfig(
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        max_num_seqs=scenario.max_num_seqs,
        max_model_len=4096,
        kvcache_block_size=scenario.block_size,
        num_kvcache_blocks=scenario.num_blocks,
    )
    engine = LLMEngine(model, config, vocab_size=TRACE.vocab_size)
    ids = itertools.count()
    for wave in trace(TRACE):
        for req in wave:
            # FINAL_ONLY: step() reports each request once, when it finishes, as the loop
            # measured here always did (CUMULATIVE would add a per-step snapshot of each).
            params = SamplingParams(
                temperature=0,
                max_tokens=len(req.output),
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            rid = str(next(ids))
            engine.add_request(rid, list(req.prompt), params)
            # the fake model sees sequences: script the request's one sequence
            model.scripts[engine._requests[rid].completions[0].seq.seq_id] = req.output
        while engine.has_unfinished_requests():
            engine.step()
    return model, engine


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(s, id=s.name, marks=pytest.mark.benchmark(group=f"engine-{s.name}"))
        for s in SCENARIOS
    ],
)
def test_engine_loop(benchmark: Any, scenario: Scenario) -> None:
    model, engine = benchmark.pedantic(run_engine, args=(scenario,), rounds=5, iterations=1)
    stats = engine.scheduler.stats
    assert engine.block_manager.num_free_blocks == scenario.num_blocks  # drained
    assert model.seq_steps > 50_000
    info = benchmark.extra_info
    info.update(
        suite="scheduler",
        scenario=scenario.name,
        seq_steps=model.seq_steps,
        us_per_seq_step_min=benchmark.stats.stats.min / model.seq_steps * 1e6,
        us_per_seq_step_median=benchmark.stats.stats.median / model.seq_steps * 1e6,
        target_us=TARGET_US,
        preemptions=stats.preemptions,
        prefix_hit_rate=stats.cached_prompt_tokens / stats.prompt_tokens,
    )
