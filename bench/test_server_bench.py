"""The OpenAI-compatible server measured from the client side, on CPU with the tiny model.

The server is ``python -m paged_engine serve`` in its own process (one torch thread,
block size 16, a pool that holds every request at full length, so nothing is preempted);
the client is this process: ``httpx`` streaming with a minimal SSE parser (the official
``openai`` client costs more per chunk than the server does, and on 2 cores it would
compete with the server for the same CPU).

The workload, drawn once from ``SEED``: ``NUM_REQUESTS`` token-id prompts of 16-128 random
tokens asking for 32-64 new tokens each, greedy, EOS ignored (``ignore_eos``), streamed.

* **Request rate against latency**: requests sent by a Poisson process at each rate of
  ``RATES`` (requests/s), and all at once (saturation). Time to first token: from sending
  the request to the first chunk that carries a token; inter-token latency: the gaps
  between a request's later chunks (one chunk per token). p50 and p99 over all requests
  (TTFT) or all gaps (ITL); throughput: output tokens / wall time from the first send to
  the last ``[DONE]``.
* **What the HTTP layer costs**: the same requests at saturation through the server, and
  through ``LLM.generate`` in this process (one torch thread, same engine settings),
  alternated round by round (``ROUNDS`` each, offline first) since the two cannot share a
  process; every server round's tokens are checked against the offline ones. Recorded:
  the fastest and median round of each and their ratio. Costs included on the server side:
  JSON, pydantic, SSE, the event-loop hop per step, the client's parsing on the same CPU.

Figures go to ``extra_info`` and are printed (run with ``-s``). Nothing is asserted about
time; the only assertions are that every stream completes with the offline tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.models import MODELS
from paged_engine import LLM, SamplingParams
from paged_engine.utils.tiny_model import make_tiny_model
from tests.test_server_support import MODEL, serve_process

SEED = 0
NUM_REQUESTS = 64
PROMPT_LEN = (16, 128)
NEW_TOKENS = (32, 64)
RATES = (8.0, 32.0, 128.0)
ROUNDS = 3
ENGINE = dict(block_size=16, max_model_len=512, num_kvcache_blocks=NUM_REQUESTS * 12, num_threads=1)
FLAGS = ["--block-size", "16", "--max-model-len", "512", "--num-kv-blocks", str(NUM_REQUESTS * 12)]


@dataclass(frozen=True, slots=True)
class Work:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Trace:
    sent: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def workload(round_: int = 0) -> list[Work]:
    """The requests of one run; each run draws its own prompts, so no run is served from
    an earlier run's prefix cache."""
    rng = random.Random(SEED + 1000 * round_)
    return [
        Work(
            [rng.randrange(3, 700) for _ in range(rng.randint(*PROMPT_LEN))],
            rng.randint(*NEW_TOKENS),
        )
        for _ in range(NUM_REQUESTS)
    ]


MODEL_NAME = os.environ.get("PAGED_ENGINE_SERVER_BENCH_MODEL", "tiny")
"""``tiny`` (the default) or ``qwen3-29m`` (``bench/models.py``): on the tiny model a step
is so cheap that the HTTP side's per-token cost dominates; on the 29M one less so."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = {} if MODEL_NAME == "tiny" else MODELS[MODEL_NAME]
    return make_tiny_model(tmp_path_factory.mktemp("serve") / "model", seed=0, **shape)


@pytest.fixture(scope="module", params=["process", "thread"])
def server(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """``--engine-core process`` (the default: the engine steps in a process of its own)
    and ``thread`` (in the server's process, sharing its GIL)."""
    flags = [*FLAGS, "--max-queue", "4096", "--engine-core", request.param]
    with serve_process(model_dir, *flags) as (url, _):
        yield url


async def _one(client: httpx.AsyncClient, url: str, w: Work, delay: float) -> Trace:
    await asyncio.sleep(delay)
    body = {
        "model": MODEL, "prompt": w.prompt, "max_tokens": w.max_tokens, "temperature": 0,
        "stream": True, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    trace = Trace(time.perf_counter())
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0]["token_ids"]
            if ids:
                trace.token_times.append(time.perf_counter())
                trace.token_ids += ids
    return trace


def run_server(url: str, work: list[Work], rate: float | None) -> tuple[list[Trace], float]:
    """Send ``work`` at ``rate`` requests/s (Poisson; None: all at once); traces and wall."""
    rng = random.Random(SEED + 1)
    delays, t = [], 0.0
    for _ in work:
        delays.append(t)
        t += rng.expovariate(rate) if rate else 0.0

    async def go() -> tuple[list[Trace], float]:
        limits = httpx.Limits(max_connections=len(work), max_keepalive_connections=len(work))
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            t0 = time.perf_counter()
            traces = await asyncio.gather(
                *(_one(client, url, w, d) for w, d in zip(work, delays, strict=True))
            )
            return list(traces), time.perf_counter() - t0

    return asyncio.run(go())


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(traces: list[Trace], wall: float) -> dict[str, float]:
    ttft = [t.token_times[0] - t.sent for t in traces]
    itl = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    tokens = sum(len(t.token_ids) for t in traces)
    return {
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
    }


def test_server_request_rate_against_latency(benchmark: Any, server: str) -> None:
    run_server(server, workload(99)[:8], None)  # warm up: first requests pay lazy initialisation
    figures: dict[str, dict[str, float]] = {}
    for i, rate in enumerate(RATES, start=1):
        traces, wall = run_server(server, workload(i), rate)
        figures[f"{rate:g}/s"] = summary(traces, wall)
    saturated: list[Any] = []
    work = workload(len(RATES) + 1)
    benchmark.pedantic(
        lambda: saturated.append(run_server(server, work, None)), rounds=1, iterations=1
    )
    figures["saturation"] = summary(*saturated[0])
    benchmark.extra_info.update({"suite": "server", "figures": figures})
    print(f"\nserver, {NUM_REQUESTS} streamed requests, tiny model on CPU")
    print(f"{'rate':>12} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'tok/s':>8}")
    for name, f in figures.items():
        print(
            f"{name:>12} {f['ttft_p50_ms']:8.1f}ms {f['ttft_p99_ms']:6.1f}ms "
            f"{f['itl_p50_ms']:6.2f}ms {f['itl_p99_ms']:6.2f}ms {f['output_tokens_per_s']:8,.0f}"
        )


def test_http_layer_cost_against_offline_generate(
    benchmark: Any, server: str, model_dir: Path, request: pytest.FixtureRequest
) -> None:
    llm = LLM(model_dir, **ENGINE)
    warm = workload(98)[:8]
    llm.generate([w.prompt for w in warm], SamplingParams(max_tokens=8), use_tqdm=False)
    run_server(server, warm, None)
    offline_tps, server_tps, ratios = [], [], []
    for r in range(ROUNDS):  # the same fresh requests on both sides in each round
        work = workload(10 + r)
        params = [
            SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True) for w in work
        ]
        tokens = sum(w.max_tokens for w in work)
        t0 = time.perf_counter()
        outs = llm.generate([w.prompt for w in work], params, use_tqdm=False)
        offline_s = time.perf_counter() - t0
        traces, server_s = run_server(server, work, None)
        assert [t.token_ids for t in traces] == [o.outputs[0].token_ids for o in outs]
        offline_tps.append(tokens / offline_s)
        server_tps.append(tokens / server_s)
        ratios.append(server_s / offline_s)
    info = {
        "suite": "server",
        "engine_core": request.node.callspec.params["server"],
        "model": MODEL_NAME,
        "offline_tokens_per_s_best": max(offline_tps),
        "offline_tokens_per_s_median": statistics.median(offline_tps),
        "server_tokens_per_s_best": max(server_tps),
        "server_tokens_per_s_median": statistics.median(server_tps),
        "server_time_over_offline_min": min(ratios),
        "server_time_over_offline_median": statistics.median(ratios),
    }
    benchmark.extra_info.update(info)
    extra = workload(10 + ROUNDS)
    benchmark.pedantic(lambda: run_server(server, extra, None), rounds=1, iterations=1)
    print(f"\nHTTP layer, {NUM_REQUESTS} requests at saturation, {ROUNDS} alternated rounds each")
    for k, v in info.items():
        if k not in ("suite", "engine_core", "model"):
            print(f"  {k:28} {v:10.3f}")
    print(f"  engine core: {info['engine_core']}")


LOW_RATE_REQUESTS = 16


def _offline_ttft(llm: LLM, w: Work, request_id: str) -> float:
    """Seconds from ``add_request`` to the step that gives ``w``'s first token."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": w.prompt}, params)
    first: float | None = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter() - t0
    assert first is not None
    return first


def test_ttft_overhead_at_low_rate(
    benchmark: Any, server: str, model_dir: Path, request: pytest.FixtureRequest
) -> None:
    """One request at a time (the lowest rate): the server's time to first token, seen by
    the client, against the engine's in this process (``add_request`` to the step that
    samples it), request by request, alternating; fresh prompts on both sides. The
    difference is what the HTTP layer and, in process mode, the hop to the core add."""
    llm = LLM(model_dir, **ENGINE)
    warm = workload(97)[:4]
    run_server(server, warm, None)
    for i, w in enumerate(warm):
        _offline_ttft(llm, w, f"warm{i}")
    offline, served, diffs = [], [], []
    for i, w in enumerate(workload(50)[:LOW_RATE_REQUESTS]):
        off = _offline_ttft(llm, w, f"r{i}")
        (trace,), _ = run_server(server, [Work(w.prompt, 4)], None)
        on = trace.token_times[0] - trace.sent
        offline.append(off)
        served.append(on)
        diffs.append(on - off)
    info = {
        "suite": "server",
        "engine_core": request.node.callspec.params["server"],
        "model": MODEL_NAME,
        "offline_ttft_p50_ms": 1e3 * statistics.median(offline),
        "server_ttft_p50_ms": 1e3 * statistics.median(served),
        "ttft_overhead_p50_ms": 1e3 * statistics.median(diffs),
        "ttft_overhead_min_ms": 1e3 * min(diffs),
    }
    benchmark.extra_info.update(info)
    one = workload(51)[:1]
    benchmark.pedantic(lambda: run_server(server, one, None), rounds=1, iterations=1)
    print(f"\nTTFT at the lowest rate, {LOW_RATE_REQUESTS} requests one at a time")
    for k, v in info.items():
        if k.endswith("_ms"):
            print(f"  {k:28} {v:10.2f}")
    print(f"  engine core: {info['engine_core']}")
