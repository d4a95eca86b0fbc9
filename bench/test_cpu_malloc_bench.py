"""The model process's C heap kept between steps (``worker/cpu_malloc.py``, "keep", the
default) against glibc's defaults ("off"): offline ``LLM.generate`` end to end. The
measurement behind the default.

What is timed: ``LLM.generate`` of bench-vllm's workload (``bench/test_e2e_bench.py``'s
``make_workload``: 64 requests over 4 shared prefixes, greedy, ``ignore_eos``) on
``qwen3-29m`` (``bench/models.py``), block size 32, prefix caching on, the pool sized as
bench-vllm sizes it (every request's blocks, unshared), ``num_threads`` 1 and 2, float32
and, where the CPU has bfloat16 matmuls, bfloat16. The prefix cache is reset before each
``generate``, so every run prefills as the first did.

How: every measurement is a fresh interpreter (``OMP_*`` removed from its environment,
``$PAGED_ENGINE_CPU_MALLOC`` set to the arm) that builds one ``LLM``, runs one warm-up
``generate`` and ``RUNS`` timed ones. The arms alternate, ``ROUNDS`` interpreters each,
the first swapped every round. Per arm: output tokens per second of every timed run (best,
median), the minor page faults and system CPU seconds of each timed run (``getrusage``),
and the child's peak RSS (``VmHWM``); the ratios ``keep / off``. Nothing is asserted
about time: the figures are in ``extra_info`` and printed. ``PAGED_ENGINE_MALLOC_ROUNDS``
changes the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.alternation import fresh_interpreter
from bench.models import MODELS
from paged_engine.utils.tiny_model import make_tiny_model
from paged_engine.worker.cpu_malloc import ENV, glibc

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("PAGED_ENGINE_MALLOC_ROUNDS", "3"))
RUNS = 3
ARMS = ("keep", "off")
DTYPES = ("float32", "bfloat16") if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ("float32",)

CHILD = """
import json, resource, sys, time
from pathlib import Path
from paged_engine import LLM, SamplingParams
from bench.test_e2e_bench import make_workload

model, dtype, threads, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = json.loads((Path(model) / "config.json").read_text())
workload = make_workload(int(config["vocab_size"]))
blocks = sum(-(-(len(r.prompt) + r.max_tokens) // 32) for r in workload)
llm = LLM(model, dtype=dtype, num_threads=threads, block_size=32, enable_prefix_caching=True,
          num_kvcache_blocks=blocks)
prompts = [{"prompt_token_ids": r.prompt} for r in workload]
params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
          for r in workload]
llm.generate(prompts, params, use_tqdm=False)
rates, faults, system = [], [], []
for _ in range(runs):
    llm.reset_prefix_cache()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    faults.append(after.ru_minflt - before.ru_minflt)
    system.append(after.ru_stime - before.ru_stime)
hwm = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines()
           if x.startswith("VmHWM:"))
print("RESULT " + json.dumps({"tok_s": rates, "faults": faults, "sys_s": system,
                              "vm_hwm_kib": hwm}))
"""


def run_child(model: Path, arm: str, dtype: str, threads: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    return fresh_interpreter(CHILD, [str(model), dtype, str(threads), str(RUNS)], {**env, ENV: arm})


@pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's: this C library is not glibc")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.benchmark(group="cpu-malloc")
def test_kept_heap_end_to_end(benchmark: Any, tmp_path: Path, dtype: str, threads: int) -> None:
    model = make_tiny_model(tmp_path / "qwen3-29m", seed=0, **MODELS["qwen3-29m"])
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}

    def measure() -> None:
        for r in range(ROUNDS):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                results[arm].append(run_child(model, arm, dtype, threads))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info: dict[str, Any] = {"suite": "cpu_malloc", "dtype": dtype, "threads": threads}
    info.update(rounds=ROUNDS, runs=RUNS, cpu=torch.backends.cpu.get_cpu_capability())
    for arm, got in results.items():
        rates = [x for g in got for x in g["tok_s"]]
        info[f"{arm}_tok_s_best"] = round(max(rates), 1)
        info[f"{arm}_tok_s_median"] = round(statistics.median(rates), 1)
        info[f"{arm}_faults_median"] = int(statistics.median(x for g in got for x in g["faults"]))
        info[f"{arm}_sys_s_median"] = round(
            statistics.median(x for g in got for x in g["sys_s"]), 3
        )
        info[f"{arm}_peak_rss_mib"] = [round(g["vm_hwm_kib"] / 1024) for g in got]
    for stat in ("best", "median"):
        info[f"ratio_{stat}"] = round(info[f"keep_tok_s_{stat}"] / info[f"off_tok_s_{stat}"], 3)
    benchmark.extra_info.update(info)
    print()
    print(json.dumps(info))
