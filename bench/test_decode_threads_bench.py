"""The CPU decode kernel at 1 and 2 threads, idle and beside a competing CPU-bound process
(``python -c "while True: pass"``): issue 13's goal is that 2 threads on a busy 2-core
machine are never slower than 1.

Two measurements, on issue 13's Qwen3-shaped 29M model (hidden 512, 8 layers, 8 heads / 4
KV heads, head_dim 64), float32 and bfloat16:

* ``layer``: one decode-attention layer call (``run_paged_decode_cpu``, checks made once
  per thread count, as a step makes them) for 32 sequences of 512-token contexts in
  16-token blocks, shuffled over the pool;
* ``step``: ``LLMEngine.step()`` of a whole decode step, timed as bench/test_cpu_bf16_bench.py
  does (its ``decode_steps``: 32 sequences, 192-token prompts, 16 decode steps a round),
  with ``torch.set_num_threads`` at the count: torch's matmuls take the same threads.

Each measurement runs in a fresh interpreter that imports paged_engine first (so OpenMP
waits passively, as a user gets it; ``OMP_*``/``GOMP_*`` removed from its environment), and
alternates the thread counts round by round in that one process (1, 2 then 2, 1, ...), so
both see the same machine. Per setting: milliseconds per call or step, ``min`` and
``median`` over every timed one; the ratio ``2t / 1t`` of each (below 1: two threads are
faster). The load average before and after is recorded: other jobs on the machine count as
load too. Figures in ``extra_info`` and printed; pytest-benchmark's own time is the whole
measurement (interpreter start included), not a figure.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paged_engine.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MODEL: dict[str, Any] = dict(
    hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1792
)
LAYER_ROUNDS, LAYER_CALLS = 10, 20
STEP_ROUNDS = 4
"""Timed rounds per thread count (after one warm-up round each)."""

CHILD = r"""
import paged_engine  # first: OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP
import json, os, random, sys, time
import torch
from paged_engine.kernels.paged_decode_cpu import check_paged_decode_cpu, run_paged_decode_cpu
from paged_engine.layers.attention import make_attention_metadata

part, model_dir, rounds, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
THREADS = (1, 2)
times = {}


def layer(dtype):
    batch, context, bs, heads, kv_heads, dim = 32, 512, 16, 8, 4, 64
    blocks = context // bs
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch * blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch * blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).tolist()
    meta = make_attention_metadata([1] * batch, [context] * batch, order, bs)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    args = (q, k, v, meta.block_tables, meta.seq_lens)
    launches = {n: check_paged_decode_cpu(*args, num_threads=n) for n in THREADS}
    out = torch.empty_like(q)
    results = {}
    for r in range(rounds + 1):  # round 0 warms up
        for n in THREADS if r % 2 else THREADS[::-1]:
            for _ in range(calls):
                start = time.perf_counter()
                run_paged_decode_cpu(launches[n], *args, dim**-0.5, out)
                elapsed = time.perf_counter() - start
                if r:
                    times.setdefault(f"{dtype_name(dtype)}-{n}t", []).append(elapsed)
            results[n] = out.clone()
    assert torch.equal(results[1], results[2]), "2 threads gave other bits than 1"


def step(dtype):
    from bench.test_cpu_bf16_bench import BATCH, PROMPT, STEPS, decode_steps
    from paged_engine import LLM

    llm = LLM(
        model_dir,
        attention_backend="cpu",
        dtype=dtype_name(dtype),
        num_threads=1,
        max_model_len=PROMPT + STEPS + 8,
        num_kvcache_blocks=BATCH * ((PROMPT + STEPS) // 16 + 2),
    )
    vocab = int(llm.model_runner.hf_config.vocab_size)
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(128)]
    for r in range(rounds + 1):
        for n in THREADS if r % 2 else THREADS[::-1]:
            torch.set_num_threads(n)
            got = decode_steps(llm, rng, prefix, vocab)
            if r:
                times.setdefault(f"{dtype_name(dtype)}-{n}t", []).extend(got)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


for dtype in (torch.float32, torch.bfloat16):
    (layer if part == "layer" else step)(dtype)
print(json.dumps({"times": times, "policy": os.environ.get("OMP_WAIT_POLICY")}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("threads-29m") / "m", seed=0, **MODEL)


@pytest.fixture(params=["idle", "loaded"])
def load(request: pytest.FixtureRequest) -> Iterator[str]:
    """``loaded``: a CPU-bound process runs for the whole measurement."""
    if request.param == "idle":
        yield "idle"
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield "loaded"
    finally:
        hog.kill()
        hog.wait()


def measure(part: str, model_dir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    rounds, calls = (LAYER_ROUNDS, LAYER_CALLS) if part == "layer" else (STEP_ROUNDS, 0)
    info: dict[str, Any] = {"load_avg_before": round(os.getloadavg()[0], 2)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, part, str(model_dir), str(rounds), str(calls)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    info["load_avg_after"] = round(os.getloadavg()[0], 2)
    info["wait_policy"] = result["policy"]
    times: dict[str, list[float]] = result["times"]
    for name, ts in times.items():
        info[f"{name}_ms_min"] = round(min(ts) * 1e3, 3)
        info[f"{name}_ms_median"] = round(statistics.median(ts) * 1e3, 3)
        info[f"{name}_samples"] = len(ts)
    for dtype in ("float32", "bfloat16"):
        for stat in ("min", "median"):
            two, one = info[f"{dtype}-2t_ms_{stat}"], info[f"{dtype}-1t_ms_{stat}"]
            info[f"{dtype}_2t_over_1t_{stat}"] = round(two / one, 3)
    return info


@pytest.mark.benchmark(group="decode-threads")
@pytest.mark.parametrize("part", ["layer", "step"])
def test_decode_threads(benchmark: Any, model_dir: Path, part: str, load: str) -> None:
    results: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: results.append(measure(part, model_dir)), rounds=1, iterations=1)
    info = {"suite": "decode-threads", "part": part, "load": load, **results[0]}
    benchmark.extra_info.update(info)
    for dtype in ("float32", "bfloat16"):
        print(
            f"\ndecode threads {part} {dtype} {load}: "
            f"1t {info[f'{dtype}-1t_ms_min']} ms ({info[f'{dtype}-1t_ms_median']}), "
            f"2t {info[f'{dtype}-2t_ms_min']} ms ({info[f'{dtype}-2t_ms_median']}), "
            f"2t/1t {info[f'{dtype}_2t_over_1t_min']} ({info[f'{dtype}_2t_over_1t_median']}); "
            f"load avg {info['load_avg_before']}->{info['load_avg_after']}"
        )
