"""Mixed steps (``mixed_steps=True``, S2m) against the default policy (a step prefills, or
else decodes), on the 29M model, one thread, float32 and (where the CPU has bfloat16
matmuls) bfloat16, offline through ``LLMEngine``.

Mixing trades one latency for another: decodes ride along a prefill's GEMMs (fewer
steps, no decode stalls while prompts arrive), but a step that carries a prefill chunk is
longer for the decodes in it. So the figures are time to first token, inter-token
latency and throughput, under requests that arrive while others decode: ``NUM_REQUESTS``
requests of ``PROMPT_LEN`` random prompt tokens and ``NEW_TOKENS`` new ones, arriving by
a Poisson process at each rate of ``RATES`` (requests/s; None: all at once). The two
policies run the same arrivals in alternating rounds (fresh prompts each round, so no
round is served from an earlier one's prefix cache), ``ROUNDS`` each
(``PAGED_ENGINE_MIXED_BENCH_ROUNDS`` overrides it); per policy, the best and median round;
the ratios mixed/default. Nothing about time is asserted; in float32 both policies must
produce the same tokens. In bfloat16 the rounding of a step's arithmetic depends on how
the batch is cut (the matmuls' row counts, a prompt split into other chunks), which mixing
changes, so greedy tokens may part (on random weights, early): the bench reports how many
requests kept the same tokens in every round.
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.models import MODELS
from paged_engine import LLM, SamplingParams
from paged_engine.utils.tiny_model import make_tiny_model

NUM_REQUESTS = 48
PROMPT_LEN = (64, 256)
NEW_TOKENS = (24, 48)
RATES = (4.0, None)
ROUNDS = int(os.environ.get("PAGED_ENGINE_MIXED_BENCH_ROUNDS", "3"))
ENGINE: dict[str, Any] = dict(block_size=16, num_threads=1, max_model_len=512)
DTYPES = ("float32", "bfloat16") if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ("float32",)


def workload(round_: int, rate: float | None) -> list[tuple[float, list[int], int]]:
    rng = random.Random(1000 + round_)
    t, out = 0.0, []
    for _ in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 700) for _ in range(rng.randint(*PROMPT_LEN))]
        out.append((t, prompt, rng.randint(*NEW_TOKENS)))
        t += rng.expovariate(rate) if rate else 0.0
    return out


def run(llm: LLM, work: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    """Feed ``work`` at its arrival times; per-request token times."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    arrivals: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    i = 0
    while i < len(work) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(work) and work[i][0] <= now:
            at, prompt, n = work[i]
            rid = str(i)
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            arrivals[rid], times[rid], tokens[rid] = t0 + at, [], []
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.001, max(0.0, work[i][0] - now)))
            continue
        for out in engine.step():
            new = out.outputs[0].token_ids[len(tokens[out.request_id]) :]
            if new:
                times[out.request_id].append(time.perf_counter())
                tokens[out.request_id] += new
    wall = time.perf_counter() - t0
    ttft = sorted(times[r][0] - arrivals[r] for r in times)
    itl = sorted(b - a for ts in times.values() for a, b in itertools.pairwise(ts))
    return {
        "tok_s": sum(map(len, tokens.values())) / wall,
        "ttft_p50_ms": 1e3 * ttft[len(ttft) // 2],
        "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "itl_p50_ms": 1e3 * itl[len(itl) // 2],
        "itl_p99_ms": 1e3 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
        "tokens": [tokens[str(k)] for k in range(len(work))],
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mixed") / "m", seed=0, **MODELS["qwen3-29m"])


@pytest.mark.benchmark(group="mixed-steps")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate", RATES, ids=lambda r: f"{r:g}rps" if r else "all-at-once")
def test_mixed_against_default_steps(
    benchmark: Any, model_dir: Path, rate: float | None, dtype: str
) -> None:
    llms = {
        m: LLM(model_dir, **ENGINE, dtype=dtype, mixed_steps=m == "mixed")
        for m in ("default", "mixed")
    }
    for llm in llms.values():  # warm-up: first-call costs outside the figures
        run(llm, workload(99, None)[:4])
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in llms}
    same: list[int] = []  # requests with the same tokens under both policies, per round
    for r in range(ROUNDS):
        work = workload(r, rate)
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        got = {m: run(llms[m], work) for m in order}
        pairs = zip(got["mixed"]["tokens"], got["default"]["tokens"], strict=True)
        same.append(sum(a == b for a, b in pairs))
        if dtype == "float32":  # bfloat16 rounds by how the batch is cut: counted only
            assert got["mixed"]["tokens"] == got["default"]["tokens"]
        for m in llms:
            results[m].append(got[m])
    info: dict[str, Any] = {"suite": "mixed-steps", "rate": rate, "dtype": dtype, "rounds": ROUNDS}
    info["same_tokens"] = f"{min(same)}/{NUM_REQUESTS}"
    for m, rounds in results.items():
        for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            values = [x[k] for x in rounds]
            best = max(values) if k == "tok_s" else min(values)
            info[f"{m}_{k}"] = round(best, 2)
            info[f"{m}_{k}_median"] = round(statistics.median(values), 2)
    for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        info[f"{k}_mixed_over_default"] = round(info[f"mixed_{k}"] / info[f"default_{k}"], 3)
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: run(llms["mixed"], workload(50, rate)[:8]), rounds=1, iterations=1)
    print(f"\nmixed vs default steps, 29M, {dtype}, 1 thread, rate {rate or 'all at once'}")
    for k, v in info.items():
        print(f"  {k:32} {v}")
    for llm in llms.values():
        llm.close()
