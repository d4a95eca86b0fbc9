"""Mixed steps (``mixed_steps=True``, docs/design.md S2m) through the real model: steps do
hold decodes and prefill chunks together, and every request's greedy tokens are those of
the default policy (a step prefills, or else decodes), in one process and over two
tensor-parallel ranks (a decoding sequence reaches a worker without its token ids, so the
batch builder must read each row as what it is). The policy itself is checked against
``spec/scheduler.py`` in lockstep (tests/scheduler_machine.py draws ``mixed_steps``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams

PROMPTS = [
    "The KV cache",
    "Paged attention keeps every sequence's keys and values in fixed-size blocks",
    "A block table maps a sequence's positions to the blocks that hold them, so",
    "Chunked prefill splits",
    "Prefix caching",
]
PARAMS = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(5)]
ENGINE: dict[str, Any] = dict(block_size=8, num_threads=1, max_num_batched_tokens=16)


def generate(model: Path, **overrides: Any) -> tuple[list[list[int]], list[tuple[bool, bool]]]:
    """Token ids per prompt, and per step (holds a chunk, holds a decode)."""
    llm = LLM(model, **ENGINE, **overrides)
    steps: list[tuple[bool, bool]] = []
    runner = llm.llm_engine.model_runner
    real = runner.run

    def run(seqs: list[Any], is_prefill: bool) -> Any:
        steps.append((any(s.is_prefill for s in seqs), any(not s.is_prefill for s in seqs)))
        return real(seqs, is_prefill)

    runner.run = run  # type: ignore[method-assign]
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.close()
    return [o.outputs[0].token_ids for o in outs], steps


@pytest.fixture(scope="module")
def default_tokens(tiny_model_dir: Path) -> list[list[int]]:
    tokens, steps = generate(tiny_model_dir)
    assert (True, True) not in steps  # the default policy never mixes
    return tokens


def test_mixed_steps_mix_and_change_no_token(
    tiny_model_dir: Path, default_tokens: list[list[int]]
) -> None:
    tokens, steps = generate(tiny_model_dir, mixed_steps=True)
    assert (True, True) in steps
    assert tokens == default_tokens


@pytest.mark.slow
def test_mixed_steps_over_two_ranks(tiny_model_dir: Path, default_tokens: list[list[int]]) -> None:
    tokens, steps = generate(tiny_model_dir, mixed_steps=True, tensor_parallel_size=2)
    assert (True, True) in steps
    assert tokens == default_tokens
