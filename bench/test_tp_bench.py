"""Tensor parallelism on CPU: what a step costs at TP=2 against TP=1, with each hand-off,
and that the TP=1 path is no slower than the plain single-device layers.

On a 2-core machine TP=2 cannot be faster: the tiny model's matmuls are microseconds, and
TP adds a hand-off and ``2 L + 2`` collectives per step (``L`` layers) between two
processes that share the cores with everything else. These benchmarks report that
overhead honestly; the point of TP is a model that does not fit one device.

* ``test_tp_step[shm]`` and ``test_tp_step[broadcast]``: ``LLMEngine.generate`` of 16
  prompts of 32 tokens, 48 new tokens each (greedy, EOS ignored, prefix caching off so
  every round is the same work: one prefill step, then decode steps of 16), on the tiny
  model (hidden 64, 2 layers), TP=2 with each hand-off, rounds interleaved with TP=1 rounds
  in the same process (TP=1 runs in each round's untimed setup). ``extra_info``: seconds
  per round and per step (``min`` and ``median``) of both, the ratio TP=2 / TP=1, and on
  rank 0, per step: time in the hand-off (``send``), time in the collectives (waiting for
  the worker included), and their counts.
* ``test_tp1_path``: the TP=1 model (parallel layers at one rank) against the same model
  with the plain single-device layers, so that TP=1 is shown no slower.

What the collectives and hand-offs cost at Qwen3-0.6B's shapes:
bench/test_tp_costs_bench.py.

The figures and the kept hand-off are in docs/performance.md, "Tensor parallelism".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from paged_engine.config import EngineConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.sequence import Sequence
from paged_engine.layers.context import forward_context
from paged_engine.layers.embed_head import (
    LMHead,
    ParallelLMHead,
    VocabEmbedding,
    VocabParallelEmbedding,
)
from paged_engine.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    MergedLinear,
    QKVLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.parallel import TPGroup
from paged_engine.sampling_params import SamplingParams
from paged_engine.utils.model_config import ModelConfig
from paged_engine.utils.tiny_model import make_tiny_model
from paged_engine.worker.handoff import BroadcastChannel, ShmChannel
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.tp_worker import start_tensor_parallel

ROUNDS = 7
PROMPTS = [[3 + (17 * i + 5 * j) % 700 for j in range(32)] for i in range(16)]
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
CONFIG = EngineConfig(
    num_kvcache_blocks=128,
    max_model_len=256,
    enable_prefix_caching=False,
    num_threads=1,
    device="cpu",
)


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 6), "median": round(statistics.median(xs), 6)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return ModelConfig.load(make_tiny_model(tmp_path_factory.mktemp("tp_bench") / "tiny", seed=0))


def engine_for(runner: ModelRunner) -> LLMEngine:
    return LLMEngine(
        runner,
        runner.config,
        vocab_size=runner.model_config.vocab_size,
        eos_token_id=None,
        num_kvcache_blocks=runner.num_kvcache_blocks,
    )


@pytest.fixture(scope="module")
def tp1(model: ModelConfig) -> LLMEngine:
    return engine_for(ModelRunner(model, CONFIG))


class Probe:
    """Rank 0's time in the hand-off and in the collectives (class-level wrappers)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: dict[str, list[float]] = {"send": [], "all_reduce": [], "gather": []}
        for cls, name, key in (
            (ShmChannel, "send", "send"),
            (BroadcastChannel, "send", "send"),
            (TPGroup, "all_reduce", "all_reduce"),
            (TPGroup, "gather_last_dim", "gather"),
        ):
            monkeypatch.setattr(cls, name, self._timed(getattr(cls, name), key))

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        times = self.times[key]

        def wrapper(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            times.append(time.perf_counter() - t0)
            return out

        return wrapper

    def reset(self) -> None:
        for v in self.times.values():
            v.clear()


def run(engine: LLMEngine) -> tuple[float, int]:
    t0 = time.perf_counter()
    engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    stats = engine.last_run_stats
    assert stats is not None
    return time.perf_counter() - t0, stats.steps


@pytest.mark.benchmark(group="tp-cpu")
@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_tp_step(
    benchmark: Any,
    monkeypatch: pytest.MonkeyPatch,
    model: ModelConfig,
    tp1: LLMEngine,
    transport: str,
) -> None:
    runner = start_tensor_parallel(model, replace(CONFIG, tensor_parallel_size=2), transport)
    try:
        tp2 = engine_for(runner)
        run(tp2)  # warm-up
        run(tp1)
        probe = Probe(monkeypatch)
        one: list[float] = []
        two: list[tuple[float, int]] = []
        per_step: list[dict[str, float]] = []

        def setup() -> tuple[tuple[()], dict[str, Any]]:
            one.append(run(tp1)[0])
            probe.reset()
            return (), {}

        def timed() -> None:
            seconds, steps = run(tp2)
            two.append((seconds, steps))
            t = probe.times
            per_step.append(
                {k: sum(v) / steps for k, v in t.items()}
                | {f"{k}_calls": len(v) / steps for k, v in t.items()}
            )

        benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, iterations=1)
    finally:
        runner.workers.close()  # type: ignore[union-attr]
    steps = two[0][1]
    tp2_s = [s for s, _ in two]
    info: dict[str, Any] = {
        "transport": transport,
        "steps": steps,
        "tp1_seconds": summary(one),
        "tp2_seconds": summary(tp2_s),
        "tp1_ms_per_step": summary([1e3 * s / steps for s in one]),
        "tp2_ms_per_step": summary([1e3 * s / steps for s in tp2_s]),
        "ratio_tp2_over_tp1_min": round(min(tp2_s) / min(one), 2),
        "ratio_tp2_over_tp1_median": round(statistics.median(tp2_s) / statistics.median(one), 2),
    }
    for key in ("send", "all_reduce", "gather"):
        info[f"rank0_{key}_us_per_step"] = summary([1e6 * p[key] for p in per_step])
        info[f"rank0_{key}_calls_per_step"] = round(per_step[0][f"{key}_calls"], 2)
    benchmark.extra_info.update(info)
    print(f"\ntp-cpu[{transport}]: {info}")


# ---- the TP=1 path: the parallel layers at one rank against the plain ones --------------

PLAIN: dict[type, type] = {
    QKVParallelLinear: QKVLinear,
    MergedColumnParallelLinear: MergedLinear,
    RowParallelLinear: Linear,
    VocabParallelEmbedding: VocabEmbedding,
    ParallelLMHead: LMHead,
}
"""Each parallel layer's single-device base: the same parameters, without the TP branch."""


@torch.inference_mode()
def forward_seconds(runner: ModelRunner, calls: int) -> float:
    """Fastest of ``calls`` forward passes of a decode batch of 16 (one token each, 40
    cached), through the runner's own batch preparation."""
    seqs = []
    for i in range(16):
        s = Sequence([3 + (5 * j + i) % 700 for j in range(41)], block_size=16, seq_id=i)
        s.num_cached_tokens, s.num_scheduled_tokens, s.is_prefill = 40, 1, False
        s.block_table = [3 * i, 3 * i + 1, 3 * i + 2]
        seqs.append(s)
    batch = runner.prepare(seqs, is_prefill=False)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        with forward_context(batch.meta):
            runner.model(batch.input_ids, batch.positions)
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.benchmark(group="tp1-path")
def test_tp1_path(benchmark: Any, model: ModelConfig, tp1: LLMEngine) -> None:
    """The same workload on the product's TP=1 model (parallel layers, one rank) and on a
    copy whose layers are the plain classes (``__class__`` swapped back), rounds
    interleaved; ``extra_info``: both, and the ratio product / plain."""
    plain_runner = ModelRunner(model, CONFIG)
    swapped = 0
    for m in plain_runner.model.modules():
        if type(m) in PLAIN:
            m.__class__ = PLAIN[type(m)]
            swapped += 1
    layers = int(plain_runner.model_config.hf_config.num_hidden_layers)
    assert swapped == 4 * layers + 2  # qkv, o, gate_up, down per layer; embedding, head
    plain = engine_for(plain_runner)
    run(plain)
    run(tp1)
    plain_s: list[float] = []
    product_s: list[float] = []

    def setup() -> tuple[tuple[()], dict[str, Any]]:
        plain_s.append(run(plain)[0])
        return (), {}

    benchmark.pedantic(lambda: product_s.append(run(tp1)[0]), setup=setup, rounds=3 * ROUNDS)
    # The model's forward alone on a decode batch of 16, fastest of many calls, blocks of
    # calls alternating: far less noisy than whole generates on a busy machine.
    runners = {"product": tp1.model_runner, "plain": plain_runner}
    fastest = {k: float("inf") for k in runners}
    for _ in range(20):
        for name, r in runners.items():
            fastest[name] = min(fastest[name], forward_seconds(r, 25))  # type: ignore[arg-type]
    info = {
        "forward_us_product": round(1e6 * fastest["product"], 1),
        "forward_us_plain": round(1e6 * fastest["plain"], 1),
        "forward_ratio_product_over_plain": round(fastest["product"] / fastest["plain"], 3),
        "product_seconds": summary(product_s),
        "plain_seconds": summary(plain_s),
        "ratio_product_over_plain_min": round(min(product_s) / min(plain_s), 3),
        "ratio_product_over_plain_median": round(
            statistics.median(product_s) / statistics.median(plain_s), 3
        ),
    }
    benchmark.extra_info.update(info)
    print(f"\ntp1-path: {info}")
