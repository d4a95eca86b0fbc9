"""bfloat16 on the CPU: the "cpu" backend's bfloat16 decode kernel against the torch
backend in bfloat16 and against the "cpu" backend in float32, at one torch thread.

Two measurements, each alternating its settings round by round in one process (so all
see the same machine), on two models: ``tiny`` (``make_tiny_model``'s default, the test
model: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16) and ``qwen3-29m`` (hidden
512, 8 layers, 8 heads / 4 KV heads, head_dim 64, intermediate 1792: issue 13's
Qwen3-shaped 28.7M-parameter model).

* ``decode step``: ``LLMEngine.step()`` wall time of a decode step (model, attention,
  sampling, scheduling: everything a user waits for) with ``BATCH`` sequences of
  ``PROMPT`` tokens (``SHARED`` of them a common prefix) and ``STEPS`` decode steps per
  round, contexts ``PROMPT + 1 .. PROMPT + STEPS``.
* ``decode attention``: one layer's ``backend.attend`` for the same batch at
  ``ATTN_CONTEXT`` tokens of context, with the kernel's bfloat16 variants named
  explicitly too (``-portable``, ``-avx512bf16``: AVX512-BF16 dot products) beside
  "auto"'s choice (``cpu-bf16``), which takes AVX512-BF16 only for head_dim >= 32.

Figures (``extra_info`` and printed): per setting the min and median over every timed step
or call, in milliseconds, and the ratios of each against ``cpu-bf16`` (above 1: slower than
the bfloat16 kernel), from the fastest and from the median runs. pytest-benchmark's own time
is the whole measurement, not a figure.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.models import MODELS as SHARED_MODELS
from paged_engine import LLM, SamplingParams
from paged_engine.kernels.paged_decode_cpu import bf16_variants
from paged_engine.layers.attention import TorchAttentionBackend, make_attention_metadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.utils.tiny_model import make_tiny_model

MODELS: dict[str, dict[str, int]] = {"tiny": {}, "qwen3-29m": SHARED_MODELS["qwen3-29m"]}
"""The end-to-end tiny model (head_dim 16) and the 29M model of ``bench/models.py``."""
SETTINGS: dict[str, tuple[str, str]] = {
    "cpu-bf16": ("cpu", "bfloat16"),
    "torch-bf16": ("torch", "bfloat16"),
    "cpu-fp32": ("cpu", "float32"),
}
"""name -> (attention_backend, dtype)."""
BATCH, PROMPT, SHARED, STEPS, ROUNDS = 32, 192, 128, 16, 5
ATTN_CONTEXT, ATTN_CALLS = 512, 20


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpu-bf16-models")
    return {name: make_tiny_model(root / name, seed=0, **kw) for name, kw in MODELS.items()}


def summarise(times: dict[str, list[float]], base: str = "cpu-bf16") -> dict[str, Any]:
    mins = {k: min(v) for k, v in times.items()}
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ms_min": {k: round(v * 1e3, 4) for k, v in mins.items()},
        "ms_median": {k: round(v * 1e3, 4) for k, v in medians.items()},
        f"ratio_to_{base}_min": {k: round(v / mins[base], 3) for k, v in mins.items()},
        f"ratio_to_{base}_median": {k: round(v / medians[base], 3) for k, v in medians.items()},
        "samples": {k: len(v) for k, v in times.items()},
    }


def decode_steps(llm: LLM, rng: random.Random, prefix: list[int], vocab: int) -> list[float]:
    """One round: BATCH fresh requests, their prefill step (untimed), STEPS timed decode
    steps; the requests finish on the last one."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
    for _ in range(BATCH):
        suffix = [rng.randrange(3, vocab) for _ in range(PROMPT - SHARED)]
        engine.add_request(f"r{rng.random()}", {"prompt_token_ids": prefix + suffix}, params)
    # Prefill, untimed: until every request has its first token. The 32 prompts take
    # several steps at the CPU's 1,024-token budget; counting one step's
    # outputs (as this did before that budget) ran into the timed decode steps, so the
    # last of them were empty (3 us "steps").
    started: set[str] = set()
    while len(started) < BATCH:
        started.update(out.request_id for out in engine.step())
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    assert not engine.has_unfinished_requests()
    return times


@pytest.mark.parametrize("model", list(MODELS))
def test_decode_step(benchmark: Any, model_dirs: dict[str, Path], model: str) -> None:
    llms = {
        name: LLM(
            model_dirs[model],
            attention_backend=backend,  # type: ignore[arg-type]
            dtype=dtype,
            num_threads=1,
            max_model_len=PROMPT + STEPS + 8,
            num_kvcache_blocks=BATCH * ((PROMPT + STEPS) // 16 + 2),
        )
        for name, (backend, dtype) in SETTINGS.items()
    }
    for name, llm in llms.items():
        assert llm.model_runner.backend.name == SETTINGS[name][0]
    vocab = int(next(iter(llms.values())).model_runner.hf_config.vocab_size)
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(SHARED)]
    times: dict[str, list[float]] = {name: [] for name in llms}

    def measure() -> None:
        for r in range(ROUNDS + 1):  # round 0 warms up
            order = list(llms.items())
            for name, llm in order[r % len(order) :] + order[: r % len(order)]:
                got = decode_steps(llm, rng, prefix, vocab)
                if r:
                    times[name].extend(got)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info = {"model": model, "batch": BATCH, "prompt": PROMPT, "steps": STEPS, "threads": 1}
    info.update(summarise(times))
    benchmark.extra_info.update(info)
    print(json.dumps(info))


def _attention_case(model_dir: Path, dtype: torch.dtype) -> tuple[Any, ...]:
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads, dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    bs = 16
    blocks = -(-ATTN_CONTEXT // bs)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(BATCH * blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(BATCH * blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(BATCH * blocks, generator=gen).view(BATCH, blocks).tolist()
    meta = make_attention_metadata([1] * BATCH, [ATTN_CONTEXT] * BATCH, order, bs)
    q = torch.randn(BATCH, heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta, dim**-0.5


@pytest.mark.parametrize("model", list(MODELS))
def test_decode_attention(benchmark: Any, model_dirs: dict[str, Path], model: str) -> None:
    torch.set_num_threads(1)
    cases = {dt: _attention_case(model_dirs[model], dt) for dt in (torch.bfloat16, torch.float32)}
    backends: dict[str, tuple[Any, torch.dtype]] = {
        "cpu-bf16": (CpuAttentionBackend(16, torch.bfloat16), torch.bfloat16),
        "cpu-bf16-portable": (
            CpuAttentionBackend(16, torch.bfloat16, bf16_variant="portable"),
            torch.bfloat16,
        ),
        "torch-bf16": (TorchAttentionBackend(16, torch.bfloat16), torch.bfloat16),
        "cpu-fp32": (CpuAttentionBackend(16, torch.float32), torch.float32),
    }
    if "avx512bf16" in bf16_variants():  # "auto" takes it only for head_dim >= 32
        backends["cpu-bf16-avx512bf16"] = (
            CpuAttentionBackend(16, torch.bfloat16, bf16_variant="avx512bf16"),
            torch.bfloat16,
        )
    times: dict[str, list[float]] = {name: [] for name in backends}

    def call(backend: Any, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        q, k, v, meta, scale = cases[dtype]
        return lambda: backend.attend(q, q, q, k, v, meta, scale)

    def measure() -> None:
        for r in range(ROUNDS + 1):
            for name, (backend, dtype) in backends.items():
                fn = call(backend, dtype)
                for _ in range(ATTN_CALLS):
                    start = time.perf_counter()
                    fn()
                    if r:
                        times[name].append(time.perf_counter() - start)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info = {"model": model, "batch": BATCH, "context": ATTN_CONTEXT, "threads": 1}
    info.update(summarise(times))
    benchmark.extra_info.update(info)
    print(json.dumps(info))
