"""The per-device token budget (``EngineConfig.max_num_batched_tokens`` None): what the
engine schedules with when the config leaves it to the device.

Expected values are the documented defaults, written out: 1,024 tokens a step on CPU,
8,192 on CUDA, and an explicit budget kept as given.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from tests.engine_machine import VOCAB
from tests.fake_model import FakeModelRunner

POOL = 16


def _engine(device_type: str | None, budget: int | None = None) -> LLMEngine:
    config = EngineConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        max_model_len=40,
        kvcache_block_size=4,
        num_kvcache_blocks=POOL,
    )
    runner = FakeModelRunner(POOL, 4, VOCAB)
    if device_type is not None:
        runner.device = SimpleNamespace(type=device_type)  # what ModelRunner.device offers
    return LLMEngine(runner, config, vocab_size=VOCAB)


def test_the_config_leaves_the_budget_to_the_device() -> None:
    assert EngineConfig().max_num_batched_tokens is None
    assert EngineConfig().for_device("cpu").max_num_batched_tokens == 1024
    assert EngineConfig().for_device("cuda").max_num_batched_tokens == 8192
    given = EngineConfig(max_num_batched_tokens=300)
    assert given.for_device("cuda") is given  # nothing left to fill in


@pytest.mark.parametrize(
    ("device_type", "expected"),
    [(None, 1024), ("cpu", 1024), ("cuda", 8192)],  # no device: a CPU-side runner
)
def test_the_engine_schedules_with_its_runners_device_budget(
    device_type: str | None, expected: int
) -> None:
    engine = _engine(device_type)
    assert engine.scheduler.max_num_batched_tokens == expected
    assert engine.config.max_num_batched_tokens == expected


def test_an_explicit_budget_is_kept_on_any_device() -> None:
    assert _engine("cuda", 48).scheduler.max_num_batched_tokens == 48
    assert _engine(None, 48).scheduler.max_num_batched_tokens == 48


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_budget_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int >= 1"):
        EngineConfig(max_num_batched_tokens=bad)  # type: ignore[arg-type]
