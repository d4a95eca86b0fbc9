"""Engine == transformers: greedy float32 generation on CPU, token for token, with prefix
hits, chunked prefill and preemption all happening."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.layers.attention import TorchAttentionBackend
from paged_engine.layers.cascade import CascadePlan
from tests.hf_oracle import HFOracle, Reference, compare

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    """20 prompts: 4 shared prefixes (37-90 tokens) x 5 suffixes (1-20 tokens)."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 700) for _ in range(n)] for n in (37, 52, 70, 90)]
    return [
        p + [rng.randrange(3, 700) for _ in range(rng.randrange(1, 21))]
        for p in prefixes
        for _ in range(5)
    ]


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, prompts: list[list[int]]) -> list[Reference]:
    oracle = HFOracle(tiny_model_dir)
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def check(llm: LLM, prompts: list[list[int]], refs: list[Reference]) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    verdicts = [compare(o.outputs[0].token_ids, r) for o, r in zip(outs, refs, strict=True)]
    real = [v for v in verdicts if v not in ("same", "tie")]
    ties = verdicts.count("tie")
    print(f"{verdicts.count('same')} identical, {ties} ties, {len(real)} differences")
    assert not real, real
    assert ties <= 2, "too many ties: the tiny model's logits are too flat to be a good oracle"


def test_plain_then_served_from_the_prefix_cache(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference]
) -> None:
    llm = LLM(tiny_model_dir, num_kvcache_blocks=256, max_model_len=256)
    # "auto" on CPU in float32: decode on the compiled kernel (test_cpu_kernel.py)
    assert llm.model_runner.backend.name == "cpu"
    check(llm, prompts, references)  # (a) plainly
    check(llm, prompts, references)  # (b) again: prompts now hit the prefix cache
    stats = llm.last_run_stats
    assert stats is not None
    # every prompt's full blocks but its last are cached from run (a)
    expected = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert stats.cached_prompt_tokens == expected > 0


def test_chunked_prefill(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference]
) -> None:
    # (c) a 19-token budget chunks every prompt (37-110 tokens) over several steps
    llm = LLM(tiny_model_dir, num_kvcache_blocks=256, max_model_len=256, max_num_batched_tokens=19)
    check(llm, prompts, references)
    stats = llm.last_run_stats
    assert stats is not None and stats.steps > stats.prefill_tokens // 19


def test_preemption(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference]
) -> None:
    # (d) 9 blocks of 16 tokens hold one 136-token sequence: requests preempt each other
    llm = LLM(tiny_model_dir, num_kvcache_blocks=9, max_model_len=136, kvcache_block_size=16)
    check(llm, prompts, references)
    stats = llm.last_run_stats
    assert stats is not None and stats.preemptions > 0


def test_small_blocks_and_prefix_caching_off(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference]
) -> None:
    llm = LLM(
        tiny_model_dir,
        num_kvcache_blocks=2048,
        kvcache_block_size=1,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    check(llm, prompts[::4], references[::4])
    assert llm.last_run_stats is not None and llm.last_run_stats.cached_prompt_tokens == 0


def test_shared_prefix_cascades(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference]
) -> None:
    # The default threshold leaves these short prefixes (2-5 blocks) to the plain decode
    # path; at 0 every decode step whose batch shares prefix blocks runs as a cascade.
    llm = LLM(tiny_model_dir, num_kvcache_blocks=256, max_model_len=256, attention_backend="torch")
    backend = llm.model_runner.backend
    assert type(backend) is TorchAttentionBackend
    backend.shared_prefix_min_tokens = 0
    plans: list[object] = []
    plan = backend._decode_plan

    def recording(*args: Any) -> object:
        plans.append(result := plan(*args))
        return result

    backend._decode_plan = recording  # type: ignore[method-assign]
    check(llm, prompts, references)
    assert any(isinstance(p, CascadePlan) for p in plans)
