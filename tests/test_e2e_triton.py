"""Engine == transformers with the Triton attention backend: greedy float32 generation,
token for token (ties as in tests/hf_oracle.compare), on a plain run, a second run served
from the prefix cache, and a chunked-prefill run.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set below before anything imports
them), so the case is small: 4 prompts sharing a 37-token prefix, 10 new tokens each
(about 25 s on 2 cores). With CUDA and compiled kernels the same test runs on the GPU
(float32, the kernels' IEEE dots) under the ``gpu`` marker.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random
from pathlib import Path

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.kernels.paged_decode_attention import is_interpreted
from tests.hf_oracle import HFOracle, Reference, compare

INTERPRETED = is_interpreted()
CUDA = torch.cuda.is_available()
MAX_TOKENS = 10
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETED,
            reason="needs TRITON_INTERPRET=1 set before paged_engine.kernels is first imported",
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not CUDA or INTERPRETED, reason="needs CUDA and compiled kernels"),
        ],
    ),
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """4 prompts: a 37-token shared prefix (2 full blocks and a partial one) + 1-12 tokens."""
    rng = random.Random(11)
    prefix = [rng.randrange(3, 700) for _ in range(37)]
    return [prefix + [rng.randrange(3, 700) for _ in range(n)] for n in (1, 5, 11, 12)]


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, prompts: list[list[int]]) -> list[Reference]:
    oracle = HFOracle(tiny_model_dir)
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


def check(llm: LLM, prompts: list[list[int]], refs: list[Reference]) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    verdicts = [compare(o.outputs[0].token_ids, r) for o, r in zip(outs, refs, strict=True)]
    real = [v for v in verdicts if v not in ("same", "tie")]
    assert not real, real
    assert verdicts.count("tie") <= 1, f"too many ties: {verdicts}"


def make_llm(model_dir: Path, device: str, **config: object) -> LLM:
    llm = LLM(
        model_dir,
        attention_backend="triton",
        device=device,
        dtype="float32",
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=32,
        max_model_len=128,
        **config,
    )
    assert llm.model_runner.backend.name == "triton"
    return llm


@pytest.mark.parametrize("device", DEVICES)
def test_triton_plain_then_from_the_prefix_cache(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference], device: str
) -> None:
    llm = make_llm(tiny_model_dir, device)
    check(llm, prompts, references)
    first = llm.last_run_stats
    assert first is not None
    # The first request computes the shared prefix's two full blocks; prefix-aware
    # admission defers the other three a step, and they hit those blocks.
    assert first.cached_prompt_tokens == 3 * 2 * BLOCK_SIZE

    check(llm, prompts, references)  # served from the prefix cache this time
    stats = llm.last_run_stats
    assert stats is not None
    # Every prompt's full blocks but its last are cached from the first run.
    expected = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)
    assert stats.cached_prompt_tokens == expected > 0


@pytest.mark.parametrize("device", DEVICES)
def test_triton_chunked_prefill(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference], device: str
) -> None:
    # A 13-token budget: every prompt (38-49 tokens) is prefilled over several steps, its
    # chunks ending mid-block, with several sequences' chunks in one step.
    llm = make_llm(tiny_model_dir, device, max_num_batched_tokens=13)
    check(llm, prompts, references)
    stats = llm.last_run_stats
    assert stats is not None and stats.steps > stats.prefill_tokens // 13
    # Prompts admitted after the first one's early chunks hit its registered blocks.
    assert stats.cached_prompt_tokens > 0


@pytest.mark.parametrize("device", DEVICES)
def test_triton_serves_a_llama_with_every_bias_and_llama3_rope(
    tmp_path: Path, prompts: list[list[int]], device: str
) -> None:
    """Another family over the same kernels: Llama's q/k/v/o and MLP biases and its llama3
    rotary scaling all sit outside attention, so two prompts suffice."""
    from paged_engine.utils.tiny_model import make_tiny_model

    rope = {
        "rope_type": "llama3",
        "rope_theta": 1e4,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = make_tiny_model(
        tmp_path / "llama",
        seed=6,
        architecture="LlamaForCausalLM",
        rope_parameters=rope,
        config_overrides={"attention_bias": True, "mlp_bias": True},
    )
    oracle = HFOracle(model)
    chosen = prompts[1:3]
    check(make_llm(model, device), chosen, [oracle.greedy(p, MAX_TOKENS) for p in chosen])
