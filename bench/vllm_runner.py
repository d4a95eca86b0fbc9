"""One system's side of the side-by-side benchmark (``bench/test_vllm_bench.py``), in its
own interpreter: ``python bench/vllm_runner.py SPEC.json`` prints one JSON line (prefixed
``RESULT ``) with the figures of every timed round.

Why a process per measurement: vLLM reads its thread binding (``VLLM_CPU_OMP_THREADS_BIND``)
and OpenMP reads its wait policy once, at start; and vLLM spawns an engine-core process,
which is why everything below runs under ``if __name__ == "__main__"``. One process runs a
warm-up round (torch.compile, caches, first-touch of the KV pool) and then ``rounds``
timed ones; each round is one ``generate`` over the whole workload on a fresh prefix cache
(paged_engine: a fresh ``LLM`` per round, built outside the timed region; vLLM:
``reset_prefix_cache()`` before the round, since a second engine would cost a second
start-up), so no round is served from an earlier round's cache.

SPEC (JSON): ``system`` ("paged_engine" or "vllm"), ``model`` (a local HF directory),
``dtype``, ``threads``, ``block_size``, ``rounds``, ``kv_cache_gib`` (vLLM's
``VLLM_CPU_KVCACHE_SPACE``), ``num_kvcache_blocks`` (paged_engine's pool) and ``requests``
(``[[prompt_token_ids, max_tokens], ...]``); optionally ``engine_args``, more keyword
arguments for paged_engine's ``LLM`` (an A/B of an engine option on this workload). Per
round: wall seconds of the ``generate`` call, CPU seconds of this process and its children
over it (vLLM's engine core does the work in a child), time to first token per request from
the call's start, and peak RSS over the round: each process's VmHWM (reset through
``/proc/PID/clear_refs`` at the start) summed over the process tree, an upper bound on the
tree's simultaneous peak. Greedy tokens of the last round come back too, so the caller can
compare the systems.

paged_engine's side also measures its matmul floor (``bench/floor.py``): the warm-up round
records each step's rows (it is scheduled exactly as the timed rounds are: same requests,
fresh pool), and after the timed rounds the model's projections are replayed alone on
them; ``info`` gets ``linear_floor_s`` and ``linear_floor_gflops_per_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _tree() -> list[int]:
    """This process and its descendants (Linux ``/proc``: no psutil in either env)."""
    pids, i = [os.getpid()], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the process ended in between
                pids += [int(c) for c in task.read_text().split() if int(c) not in pids]
        i += 1
    return pids


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds per live process (``/proc/PID/stat`` fields 14-15)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended in between: its time is not counted
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _reset_hwm(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


def _hwm_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _measure(generate: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    procs = _tree()
    _reset_hwm(procs)
    cpu0 = _cpu_seconds(procs)
    wall0 = time.time()
    start = time.perf_counter()
    tokens, first_token_wall = generate(requests)
    elapsed = time.perf_counter() - start
    procs = _tree()
    cpu1 = _cpu_seconds(procs)
    cpu = sum(cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1)
    ttft = [t - wall0 for t in first_token_wall]
    return {
        "elapsed": elapsed,
        "cpu": cpu,
        "ttft": ttft,
        "peak_rss_bytes": _hwm_bytes(procs),
        "processes": len(procs),
        "tokens": tokens,
    }


def _paged_engine(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from bench.floor import record, replay
    from paged_engine import LLM, SamplingParams

    def make() -> Any:
        return LLM(
            spec["model"],
            dtype=spec["dtype"],
            num_threads=spec["threads"],
            kvcache_block_size=spec["block_size"],
            num_kvcache_blocks=spec["num_kvcache_blocks"],
            **spec.get("engine_args", {}),
        )

    holder = {"llm": make()}
    info = {
        "attention_backend": holder["llm"].model_runner.backend.name,
        "max_num_batched_tokens": holder["llm"].config.max_num_batched_tokens,
    }

    def fresh() -> None:
        holder["llm"] = None  # free the old pool first
        holder["llm"] = make()

    def generate(requests: list[tuple[list[int], int]]) -> tuple[list[list[int]], list[float]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests
        ]
        outs = holder["llm"].generate([p for p, _ in requests], params, use_tqdm=False)
        toks = [list(o.outputs[0].token_ids) for o in outs]
        return toks, [float(o.metrics.first_token_time) for o in outs]

    def warm_up(requests: list[tuple[list[int], int]]) -> None:
        with record(holder["llm"].model_runner.model) as shapes:
            generate(requests)
        holder["shapes"] = shapes

    def after() -> dict[str, Any]:
        floor = replay(holder["llm"].model_runner.model, holder["shapes"])
        return {
            "linear_floor_s": round(floor.seconds, 4),
            "linear_floor_gflops_per_s": round(floor.gflops_per_s, 1),
            "steps": len(holder["shapes"].tokens),
        }

    return (fresh, generate, warm_up, after), info


def _vllm(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        block_size=spec["block_size"],
        enable_prefix_caching=True,
        disable_log_stats=False,  # keeps per-request metrics (first_token_latency)
        seed=0,
    )
    import vllm

    sched = llm.llm_engine.vllm_config.scheduler_config
    info = {
        "vllm_version": vllm.__version__,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "processes": len(_tree()),
    }

    def fresh() -> None:
        llm.reset_prefix_cache()

    def generate(requests: list[tuple[list[int], int]]) -> tuple[list[list[int]], list[float]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests
        ]
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        outs = llm.generate(prompts, params, use_tqdm=False)
        toks = [list(o.outputs[0].token_ids) for o in outs]
        first = []
        for o in outs:
            m = o.metrics
            if m is None or not m.first_token_latency:
                raise RuntimeError("vLLM returned no first-token metrics (log stats off?)")
            first.append(m.arrival_time + m.first_token_latency)
        return toks, first

    return (fresh, generate, generate, dict), info


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    requests = [(list(p), int(n)) for p, n in spec["requests"]]
    started = time.perf_counter()
    make = _paged_engine if spec["system"] == "paged_engine" else _vllm
    (fresh, generate, warm_up, after), info = make(spec)
    info["startup_s"] = round(time.perf_counter() - started, 2)
    warm_up(requests)  # not timed
    rounds = []
    for _ in range(spec["rounds"]):
        fresh()
        rounds.append(_measure(generate, requests))
    info.update(after())
    tokens = rounds[-1]["tokens"]
    for r in rounds:
        del r["tokens"]
    print("RESULT " + json.dumps({"info": info, "rounds": rounds, "tokens": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1]))
