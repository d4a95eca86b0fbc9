"""The CPU KV pool on transparent huge pages (``bench/huge_pages.py``'s advice, given to the
pool as it is allocated, before anything writes it) against the engine as it is (its pool
on the allocator's ordinary pages): offline ``LLM.generate`` end to end. The measurement
behind the product's choice not to advise its pool (``docs/performance.md``).

What is timed: ``LLM.generate`` of a workload's prompts of random tokens, its new tokens
each, greedy (``WORKLOADS``: 32 prompts of 256 tokens and 128 new ones, a batch whose
decode steps are mostly matmuls; 16 prompts of 1,024 tokens and 64 new ones, where decode
attention takes the larger share), on ``qwen3-29m`` (``bench/models.py``: 8 layers,
8/4 heads of 64, random weights), ``num_threads=1``, block size 16, the pool sized
automatically (as a user gets it). Decode-heavy on purpose: decode attention, which reads
the pool, is what the pages change.

How: every measurement is a fresh interpreter (``import paged_engine`` first, ``OMP_*``
removed from its environment) that builds one ``LLM``, runs one warm-up ``generate`` and
``RUNS`` timed ones. The ``huge`` arm wraps ``allocate_kv_cache`` where
``worker/model_runner.py`` calls it, so the pool it returns is advised before the first
block is written; the ``small`` arm runs the engine unchanged. The arms alternate,
``ROUNDS`` interpreters each, the first swapped every round. Per arm: generated tokens per
second of every timed run (best, median), the child's huge-page-backed memory after the
runs (``AnonHugePages``) and its peak RSS (``VmHWM``); the ratios ``huge / small``.
Nothing is asserted about time: the figures are in ``extra_info`` and printed. Set
``PAGED_ENGINE_HUGE_PAGES_ROUNDS`` to change the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench.alternation import fresh_interpreter
from bench.huge_pages import huge_pages_usable, transparent_huge_pages
from bench.models import MODELS
from paged_engine.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("PAGED_ENGINE_HUGE_PAGES_ROUNDS", "4"))
RUNS = 2
WORKLOADS = {"b32_p256_n128": (32, 256, 128), "b16_p1024_n64": (16, 1024, 64)}
"""Prompts, prompt tokens, new tokens."""
ARMS = ("huge", "small")

CHILD = """
import json, random, sys, time
import paged_engine
from pathlib import Path
from paged_engine import LLM, SamplingParams
from paged_engine.worker import model_runner
from bench.alternation import fresh_interpreter
from bench.huge_pages import advise_huge_pages

model, arm, runs, prompts, prompt_len, new = sys.argv[1:7]
if arm == "huge":
    allocate = model_runner.allocate_kv_cache
    def advised(*args):
        cache = allocate(*args)
        assert advise_huge_pages(cache.data_ptr(), cache.nbytes)
        return cache
    model_runner.allocate_kv_cache = advised
llm = LLM(model, num_threads=1, block_size=16, enable_prefix_caching=False)
rng = random.Random(0)
reqs = [{"prompt_token_ids": [rng.randrange(10, 700) for _ in range(int(prompt_len))]}
        for _ in range(int(prompts))]
params = SamplingParams(max_tokens=int(new), temperature=0.0, ignore_eos=True)
llm.generate(reqs, params, use_tqdm=False)
rates = []
for _ in range(int(runs)):
    start = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
def field(path, name):
    for line in Path(path).read_text().splitlines():
        if line.startswith(name):
            return int(line.split()[1])
print("RESULT " + json.dumps({
    "tok_s": rates,
    "anon_huge_kib": field("/proc/self/smaps_rollup", "AnonHugePages:"),
    "vm_hwm_kib": field("/proc/self/status", "VmHWM:"),
}))
"""


def run_child(model: Path, arm: str, workload: tuple[int, int, int]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    return fresh_interpreter(CHILD, [str(model), arm, str(RUNS), *map(str, workload)], env)


@pytest.mark.skipif(
    not huge_pages_usable(),
    reason=f"this kernel's THP mode is {transparent_huge_pages()!r}: no advice to compare",
)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.benchmark(group="huge-pages")
def test_huge_page_pool_end_to_end(benchmark: Any, tmp_path: Path, workload: str) -> None:
    model = make_tiny_model(tmp_path / "qwen3-29m", seed=0, **MODELS["qwen3-29m"])
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}

    def measure() -> None:
        for r in range(ROUNDS):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                results[arm].append(run_child(model, arm, WORKLOADS[workload]))

    benchmark.pedantic(measure, rounds=1, iterations=1)
    info: dict[str, Any] = {"suite": "huge_pages", "workload": workload, "rounds": ROUNDS}
    info["runs"] = RUNS
    info["thp_mode"] = transparent_huge_pages()
    for arm, got in results.items():
        rates = [x for g in got for x in g["tok_s"]]
        info[f"{arm}_tok_s_best"] = round(max(rates), 1)
        info[f"{arm}_tok_s_median"] = round(statistics.median(rates), 1)
        info[f"{arm}_anon_huge_mib"] = [round(g["anon_huge_kib"] / 1024) for g in got]
        info[f"{arm}_peak_rss_mib"] = [round(g["vm_hwm_kib"] / 1024) for g in got]
    for stat in ("best", "median"):
        info[f"ratio_{stat}"] = round(info[f"huge_tok_s_{stat}"] / info[f"small_tok_s_{stat}"], 3)
    benchmark.extra_info.update(info)
    print()
    print(json.dumps(info))
