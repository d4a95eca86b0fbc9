"""``bench/floor.py``: the rows it records and the work it replays (run by ``tox -e py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from bench.floor import StepShapes, record, replay
from paged_engine import LLM, SamplingParams
from paged_engine.utils.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("floor") / "m", seed=0)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        num_threads=1,
        kvcache_block_size=16,
        num_kvcache_blocks=64,
        max_model_len=256,
    )


def test_record_logs_each_step_rows_and_the_hooks_come_off(llm: LLM) -> None:
    model = llm.model_runner.model
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with record(model) as shapes:
        llm.generate([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]], params, use_tqdm=False)
    # One prefill step of both prompts (5 + 7 tokens, well inside the budget; no shared
    # prefix), then two decode steps of one token per sequence; every step samples both.
    assert shapes.tokens == [12, 2, 2]
    assert shapes.logits == [2, 2, 2]
    llm.generate([[31, 32]], params, use_tqdm=False)
    assert shapes.tokens == [12, 2, 2]  # unchanged: the hooks were removed
    assert not model.model._forward_pre_hooks and not model.lm_head._forward_pre_hooks


def test_replay_counts_the_architectures_flops(llm: LLM, model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, hd, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    # Per token and layer: q/k/v, o, gate and up, down; then the LM head per sampled row.
    per_row = cfg["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + h * 2 * i + i * h)
    shapes = StepShapes(tokens=[12, 2, 2], logits=[2, 2, 2])
    floor = replay(llm.model_runner.model, shapes, repeats=1)
    assert floor.flops == 2 * (per_row * 16 + h * cfg["vocab_size"] * 6)
    assert floor.seconds > 0.0


def test_replay_refuses_mismatched_or_empty_shapes(llm: LLM) -> None:
    model = llm.model_runner.model
    with pytest.raises(ValueError, match="3 decoder forwards but 2 LM-head ones"):
        replay(model, StepShapes(tokens=[1, 1, 1], logits=[1, 1]))
    with pytest.raises(ValueError, match="no steps were recorded"):
        replay(model, StepShapes())
    with pytest.raises(TypeError, match=r"has no \.model and \.lm_head"):
        replay(nn.Linear(2, 2), StepShapes(tokens=[1], logits=[1]))
