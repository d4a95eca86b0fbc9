"""CPU binding (``cpu_bind``, ``PAGED_ENGINE_CPU_BIND``): offline ``LLM.generate`` with
one torch thread, bound ("auto": the last physical core of this process's CPUs, so CPU 1
on 2 cores) against unbound ("off"), on a quiet machine and under a competing load.

What is timed: ``LLM.generate`` of 16 prompts of 64 random tokens, 64 new tokens each,
greedy (1,024 generated tokens), on ``qwen3-29m`` (``bench/models.py``: hidden 512, 8
layers, 28.7M parameters, random weights), ``num_threads=1``.

How: every measurement is a fresh interpreter (``import paged_engine`` first, ``OMP_*``
and ``GOMP_*`` removed from its environment, as a user gets it) that builds one ``LLM``,
runs one warm-up ``generate`` and ``RUNS`` timed ones; bound and unbound interpreters
alternate, ``ROUNDS`` of each, the order flipped every round (bound, unbound, unbound,
bound, ...), so both see the same machine. The loads:

* ``quiet``: nothing else (other jobs on the machine count: the load average before and
  after is recorded);
* ``one_hog``: one ``python -c "while True: pass"``, free to run on any CPU;
* ``hog_per_cpu``: one such process per CPU this process may use.

Per mode: generated tokens per second of every timed run, ``best`` and ``median``; the
ratios ``bound / unbound`` of both (above 1: binding wins); and ``on_cpu``, the median
share of the wall time the engine's process was on a CPU (its CPU time over the wall
time of a ``generate``). The child also reports the CPUs its threads may use
(``/proc/self/task/*/status``), so a binding that did not happen shows. Nothing about
time is asserted; the figures are in ``extra_info`` and printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.models import MODELS
from paged_engine.cpu_bind import thread_cpus
from paged_engine.utils.tiny_model import make_tiny_model
from tests.test_server_support import MODEL, serve_process

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 6
"""Interpreters per mode and load."""
TP_ROUNDS = 4
"""The same with ``tensor_parallel_size=2`` (one thread per rank)."""
RUNS = 3
"""Timed ``generate`` calls per interpreter (after one warm-up)."""
SERVE_ROUNDS = 4
"""Servers per mode and load (``test_cpu_bind_serve``), each timed ``RUNS`` times."""
SERVE_REQUESTS = 32
MODES = {"bound": "auto", "unbound": "off"}
"""Mode -> the child's ``PAGED_ENGINE_CPU_BIND``."""

CHILD = r"""
import json, random, sys, time
import paged_engine  # first: OMP_WAIT_POLICY=PASSIVE before torch loads
from paged_engine import LLM, SamplingParams
from paged_engine.cpu_bind import thread_cpus

model_dir, runs, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
prompts = [[rng.randrange(3, 768) for _ in range(64)] for _ in range(16)]
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
llm = LLM(
    model_dir, num_threads=1, num_kvcache_blocks=256, max_model_len=256, tensor_parallel_size=tp
)
rates, on_cpu = [], []
for r in range(runs + 1):  # run 0 warms up
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if r:
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
        on_cpu.append(cpu / wall)
workers = llm.model_runner.workers.pids if llm.model_runner.workers else []
cpus = [sorted(set().union(*thread_cpus(p).values())) for p in ["self", *workers]]
print(json.dumps({"rates": rates, "on_cpu": on_cpu, "cpus": cpus, "bind": llm.config.cpu_bind}))
llm.close()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cpu_bind")
    shape: dict[str, Any] = dict(MODELS["qwen3-29m"])
    return make_tiny_model(root / "qwen3-29m", seed=0, **shape)


@pytest.fixture(params=["quiet", "one_hog", "hog_per_cpu"])
def load(request: pytest.FixtureRequest) -> Iterator[str]:
    """The competing CPU-bound processes, running for the whole measurement."""
    count = {"quiet": 0, "one_hog": 1, "hog_per_cpu": len(os.sched_getaffinity(0))}
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(count[request.param])
    ]
    try:
        yield request.param
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _child(model_dir: Path, bind: str, tp: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    env["PAGED_ENGINE_CPU_BIND"] = bind
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), str(RUNS), str(tp)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def measure(model_dir: Path, tp: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    on_cpu: dict[str, list[float]] = {m: [] for m in MODES}
    info: dict[str, Any] = {"load_avg_before": round(os.getloadavg()[0], 2)}
    for r in range(ROUNDS if tp == 1 else TP_ROUNDS):
        order = list(MODES.items())
        for mode, bind in order if r % 2 == 0 else order[::-1]:
            result = _child(model_dir, bind, tp)
            rates[mode] += result["rates"]
            on_cpu[mode] += result["on_cpu"]
            info[f"{mode}_cpus"] = result["cpus"]
            info[f"{mode}_cpu_bind"] = result["bind"]
    info["load_avg_after"] = round(os.getloadavg()[0], 2)
    return _figures(info, rates, on_cpu)


def _figures(
    info: dict[str, Any], rates: dict[str, list[float]], on_cpu: dict[str, list[float]] | None
) -> dict[str, Any]:
    for mode in MODES:
        info[f"{mode}_best_tok_s"] = round(max(rates[mode]), 1)
        info[f"{mode}_median_tok_s"] = round(statistics.median(rates[mode]), 1)
        if on_cpu is not None:
            info[f"{mode}_on_cpu"] = round(statistics.median(on_cpu[mode]), 3)
        info[f"{mode}_runs"] = len(rates[mode])
    for stat in ("best", "median"):
        ratio = info[f"bound_{stat}_tok_s"] / info[f"unbound_{stat}_tok_s"]
        info[f"bound_over_unbound_{stat}"] = round(ratio, 3)
    return info


def _report(info: dict[str, Any]) -> str:
    return (
        f"bound (CPUs {info['bound_cpus']}) best {info['bound_best_tok_s']} median "
        f"{info['bound_median_tok_s']} tok/s, on CPU {info.get('bound_on_cpu')}; unbound "
        f"(CPUs {info['unbound_cpus']}) best {info['unbound_best_tok_s']} median "
        f"{info['unbound_median_tok_s']} tok/s, on CPU {info.get('unbound_on_cpu')}; "
        f"bound/unbound best {info['bound_over_unbound_best']}x, median "
        f"{info['bound_over_unbound_median']}x ({info['bound_runs']} runs each); load avg "
        f"{info['load_avg_before']}->{info['load_avg_after']}"
    )


@pytest.mark.benchmark(group="cpu_bind")
@pytest.mark.parametrize("tp", [1, 2])
def test_cpu_bind(benchmark: Any, model_dir: Path, load: str, tp: int) -> None:
    results: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: results.append(measure(model_dir, tp)), rounds=1, iterations=1)
    info = {"suite": "cpu_bind", "model": "qwen3-29m", "tp": tp, "load": load, **results[0]}
    benchmark.extra_info.update(info)
    print(f"\ncpu_bind offline tp={tp} {load}: {_report(info)}")


def _stream(url: str, seed: int) -> tuple[int, float]:
    """``SERVE_REQUESTS`` streamed completions at once (64 random prompt tokens, 64 new
    ones, greedy, EOS ignored); the tokens received and the wall time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 700) for _ in range(64)] for _ in range(SERVE_REQUESTS)]

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        body = {
            "model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    n += len(json.loads(line[6:])["choices"][0]["token_ids"] or [])
        return n

    async def go() -> tuple[int, float]:
        limits = httpx.Limits(max_connections=SERVE_REQUESTS)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(client, p) for p in prompts))
            return sum(counts), time.perf_counter() - t0

    return asyncio.run(go())


def _children_cpus(pid: int) -> list[list[int]]:
    """The CPUs each child process of ``pid`` (the engine core) may use."""
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):  # spawned from any of its threads
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return [sorted(set().union(*thread_cpus(k).values())) for k in kids]


def measure_serve(model_dir: Path) -> dict[str, Any]:
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    info: dict[str, Any] = {"load_avg_before": round(os.getloadavg()[0], 2)}
    flags = ["--engine-core", "process", "--max-model-len", "256", "--num-kv-blocks", "1200"]
    for r in range(SERVE_ROUNDS):
        order = list(MODES.items())
        for mode, bind in order if r % 2 == 0 else order[::-1]:
            env = {"PAGED_ENGINE_CPU_BIND": bind}
            with serve_process(model_dir, *flags, env=env) as (url, proc):
                _stream(url, seed=99)  # warm-up
                for i in range(RUNS):
                    tokens, wall = _stream(url, seed=100 * r + i)
                    rates[mode].append(tokens / wall)
                info[f"{mode}_cpus"] = _children_cpus(proc.pid)
                info[f"{mode}_cpu_bind"] = bind
    info["load_avg_after"] = round(os.getloadavg()[0], 2)
    return _figures(info, rates, None)


@pytest.mark.benchmark(group="cpu_bind")
def test_cpu_bind_serve(benchmark: Any, model_dir: Path, load: str) -> None:
    """``serve --engine-core process --threads 1``: "auto" puts the engine core on the
    last CPU and leaves the API process (unbound) the others."""
    results: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: results.append(measure_serve(model_dir)), rounds=1, iterations=1)
    info = {"suite": "cpu_bind_serve", "model": "qwen3-29m", "load": load, **results[0]}
    benchmark.extra_info.update(info)
    print(f"\ncpu_bind serve {load}: {_report(info)}")
