"""End to end on CPU: paged_engine's ``LLM.generate`` against transformers' ``generate``.

The workload (the issue's shape, drawn once from ``SEED``): 64 requests, each one of 4
shared prefixes (128-512 tokens) plus its own suffix (16-128 tokens), asking for 32-128 new
tokens, greedy, EOS ignored. Both sides run the same model (``make_tiny_model``'s default:
Qwen3, hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16, vocab 768, float32) on the
same requests, in the same process, group "e2e-cpu". The ratio is recorded in the
paged_engine test's ``extra_info`` (``speedup_vs_transformers``: fastest rounds of the
transformers test and this one, one after the other; also medians), against
``TARGET_SPEEDUP``; run both tests (the transformers one first) to get it. The ratio
regression tracking follows, in process CPU time (``speedup_vs_transformers_cpu``), comes
from transformers rounds interleaved with the paged_engine test's own, so both sides'
fastest rounds are taken over the same minutes.

* **paged_engine**: all 64 requests to one ``LLM.generate`` call (default scheduling
  limits, prefix caching on, the default attention backend: "auto", i.e. the compiled CPU
  decode kernel when built, recorded as ``attention_backend``), each with its own
  ``max_tokens``; and again on the torch backend (``paged_engine[torch]``), the reference
  path with shared-prefix cascades, for comparison. A fresh ``LLM`` per round
  (built outside the timed region), so no round is served from an earlier round's prefix
  cache. The KV pool is sized to hold every request at full length with no prefix sharing,
  so nothing is preempted.
* **transformers**: ``Qwen3ForCausalLM.generate`` (its defaults: SDPA attention, dynamic
  KV cache), greedy (``do_sample=False``), requests in order in batches of 16, left-padded
  with an attention mask, ``max_new_tokens`` = the batch's largest request, and no EOS
  (``eos_token_id=None``: generation runs to ``max_new_tokens`` like ``ignore_eos``).

**Output tokens, fairly**: both sides are credited with exactly the tokens the requests
asked for, ``sum(max_tokens)``. transformers also generates, for every request in a batch
below the batch's maximum, tokens nobody asked for; that is the cost of static batching,
counted in its time but not as output (``generated_tokens`` in ``extra_info`` shows the
total). The figure is output tokens per second of the fastest round of each side; the
median is recorded beside it.

**Threads**: both sides run with the same torch intra-op thread count, ``BENCH_THREADS``
(env ``PAGED_ENGINE_BENCH_THREADS``, default 1), restored afterwards. The tiny model's ops
are too small to gain from a second thread, and on a 2-core machine shared with other
jobs, OpenMP's spin-waiting makes 2-thread timings erratic; it hits transformers hardest
(measured with 2 threads: transformers 18-22 s a round against 1.8 s on one thread,
paged_engine 0.6-10 s).

Also recorded, per side: time to first token (paged_engine: from the ``generate`` call to
the first sampled token of any request, and the mean over requests; transformers: the
first batch's prefill, i.e. its first generated token, and the mean over requests, a
request's batch starting when the previous batch ends), peak RSS during the timed call
(VmHWM, reset before it) and its growth over the RSS at the call, KV-cache bytes
(paged_engine: the pool, ``kv_cache.numel() * element_size()``, and the peak in use;
transformers: the dynamic cache's largest size, batch x padded length x layers x K and V)
and paged_engine's prefix-cache hit rate.

Correctness, outside the timed region: every request's tokens from paged_engine are
compared with transformers' batched ones; where they differ, and for the first request of
every batch regardless, paged_engine's tokens are checked against transformers run
unpadded and uncached (``tests/hf_oracle.py``), which must agree up to ties.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.utils.tiny_model import make_tiny_model

SEED = 0
NUM_REQUESTS = 64
NUM_PREFIXES = 4
PREFIX_LEN = (128, 512)
SUFFIX_LEN = (16, 128)
NEW_TOKENS = (32, 128)
HF_BATCH = 16
BLOCK_SIZE = 16
ROUNDS = {"paged_engine": 5, "transformers": 3}
BENCH_THREADS = int(os.environ.get("PAGED_ENGINE_BENCH_THREADS", "1"))
FIRST_ORDINARY_TOKEN = 3
"""Token ids below this are the tiny tokenizer's specials (eos, bos, pad): prompts avoid them."""

TARGET_SPEEDUP = 4.0
"""The issue's bar: paged_engine's output tokens/s over transformers'. Recorded, not enforced
(like the allocator targets): a loaded machine must not fail a build."""

_RESULTS: dict[str, dict[str, Any]] = {}
"""Each side's figures, so the second test can record the ratio."""


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(vocab_size: int, seed: int = SEED) -> list[Request]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(n)]

    prefixes = [tokens(rng.randint(*PREFIX_LEN)) for _ in range(NUM_PREFIXES)]
    return [
        Request(
            prompt=prefixes[rng.randrange(NUM_PREFIXES)] + tokens(rng.randint(*SUFFIX_LEN)),
            max_tokens=rng.randint(*NEW_TOKENS),
        )
        for _ in range(NUM_REQUESTS)
    ]


def workload_summary(workload: list[Request]) -> dict[str, Any]:
    prompts = [len(r.prompt) for r in workload]
    return {
        "requests": len(workload),
        "prompt_tokens": sum(prompts),
        "prompt_len_min_mean_max": [min(prompts), round(sum(prompts) / len(prompts)), max(prompts)],
        "output_tokens": sum(r.max_tokens for r in workload),
    }


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("e2e") / "model", seed=0)


@pytest.fixture(scope="module")
def workload(model_dir: Path) -> list[Request]:
    from transformers import AutoConfig

    return make_workload(int(AutoConfig.from_pretrained(model_dir).vocab_size))


@pytest.fixture(scope="module", autouse=True)
def torch_threads() -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(BENCH_THREADS)
    try:
        yield BENCH_THREADS
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# ---- measurement helpers -------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak resident memory over a region: Linux's VmHWM, reset at the start through
    ``/proc/self/clear_refs``; elsewhere ``ru_maxrss``, the process's lifetime peak."""

    def __enter__(self) -> PeakRSS:
        self.resettable = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.resettable = _status_kib("VmHWM") is not None
        except OSError:
            pass
        self.start_kib = _status_kib("VmRSS") or 0
        return self

    def __exit__(self, *exc: object) -> None:
        hwm = _status_kib("VmHWM") if self.resettable else None
        self.peak_kib = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF)[2]

    @property
    def peak_bytes(self) -> int:
        return self.peak_kib * 1024

    @property
    def growth_bytes(self) -> int:
        return max(0, self.peak_kib - self.start_kib) * 1024


def _summary(runs: list[dict[str, Any]], output_tokens: int) -> dict[str, float]:
    """Wall-clock figures (the headline) and process CPU time (steadier on a shared
    machine: it does not count the time other jobs hold the core)."""
    times = [r["elapsed"] for r in runs]
    cpu = [r["cpu"] for r in runs]
    best, median = min(times), statistics.median(times)
    return {
        "seconds_min": round(best, 4),
        "seconds_median": round(median, 4),
        "cpu_seconds_min": round(min(cpu), 4),
        "output_tokens_per_s": round(output_tokens / best, 1),
        "output_tokens_per_s_median": round(output_tokens / median, 1),
        "output_tokens_per_cpu_s": round(output_tokens / min(cpu), 1),
    }


# ---- transformers --------------------------------------------------------------------------


class _FirstTokenClock:
    """A generate streamer: its first ``put`` is the prompt, its second the first token."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_batches(
    workload: list[Request], pad_id: int
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(input_ids, attention_mask, max_new_tokens)`` per batch of ``HF_BATCH``, left-padded."""
    batches = []
    for b in range(0, len(workload), HF_BATCH):
        reqs = workload[b : b + HF_BATCH]
        width = max(len(r.prompt) for r in reqs)
        ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, r in enumerate(reqs):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        batches.append((ids, mask, max(r.max_tokens for r in reqs)))
    return batches


def run_transformers(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor, int]]) -> dict:
    """Generate every batch; returns the generated ids and the clock readings."""
    from transformers import GenerationConfig

    pad_id = int(model.config.pad_token_id)
    outputs: list[torch.Tensor] = []
    first_token: list[float] = []
    cpu = time.process_time()
    start = time.perf_counter()
    for ids, mask, max_new in batches:
        clock = _FirstTokenClock()
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad_id
        )
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock
        )
        assert clock.first_token_at is not None
        first_token.append(clock.first_token_at - start)
        outputs.append(out[:, ids.shape[1] :])
    elapsed = time.perf_counter() - start
    return {
        "elapsed": elapsed,
        "cpu": time.process_time() - cpu,
        "outputs": outputs,
        "ttft": first_token,
    }


@pytest.mark.benchmark(group="e2e-cpu")
def test_e2e_transformers(benchmark: Any, hf_model: Any, workload: list[Request]) -> None:
    batches = _hf_batches(workload, int(hf_model.config.pad_token_id))
    runs: list[dict] = []
    rss: list[PeakRSS] = []

    def timed() -> None:
        with PeakRSS() as peak:
            runs.append(run_transformers(hf_model, batches))
        rss.append(peak)

    benchmark.pedantic(timed, rounds=ROUNDS["transformers"], iterations=1, warmup_rounds=1)
    runs, rss = runs[1:] or runs, rss[1:] or rss  # drop the warm-up round
    last = runs[-1]
    for (ids, _, max_new), out in zip(batches, last["outputs"], strict=True):
        assert out.shape == (ids.shape[0], max_new)  # ran to max_new_tokens: no EOS stop
    hf_tokens = [
        out[row, : r.max_tokens].tolist()
        for b, out in enumerate(last["outputs"])
        for row, r in enumerate(workload[b * HF_BATCH : (b + 1) * HF_BATCH])
    ]
    useful = sum(r.max_tokens for r in workload)
    generated = sum(ids.shape[0] * max_new for ids, _, max_new in batches)
    cfg = hf_model.config
    itemsize = torch.empty((), dtype=hf_model.dtype).element_size()
    per_token_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize
    kv_peak = max(ids.shape[0] * (ids.shape[1] + max_new - 1) for ids, _, max_new in batches)
    info = {
        "engine": "transformers",
        "threads": torch.get_num_threads(),
        **workload_summary(workload),
        "generated_tokens": generated,
        **_summary(runs, useful),
        "ttft_first_s": round(min(r["ttft"][0] for r in runs), 4),
        "ttft_mean_s": round(
            min(sum(r["ttft"][b] for b in range(len(batches))) / len(batches) for r in runs), 4
        ),
        "peak_rss_bytes": max(p.peak_bytes for p in rss),
        "rss_growth_bytes": max(p.growth_bytes for p in rss),
        "kv_cache_bytes": kv_peak * per_token_kv,
        "attn_implementation": str(getattr(cfg, "_attn_implementation", "?")),
    }
    benchmark.extra_info.update(info)
    _RESULTS["transformers"] = {**info, "tokens": hf_tokens}
    print(f"\ntransformers: {info}")


# ---- paged_engine --------------------------------------------------------------------------


def _pool_blocks(workload: list[Request]) -> int:
    """Blocks for every request at full length with no prefix sharing: nothing preempts."""
    return sum(-(-(len(r.prompt) + r.max_tokens) // BLOCK_SIZE) for r in workload)


def run_paged_engine(llm: LLM, workload: list[Request]) -> dict:
    """One ``generate`` over the whole workload, timing each request's first token (the
    engine's ``RequestOutput.metrics.first_token_time``, a ``time.time()``)."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload
    ]
    cpu = time.process_time()
    wall = time.time()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    first_token = [o.metrics.first_token_time for o in outputs]
    assert all(t is not None for t in first_token)
    ttft = [t - wall for t in first_token if t is not None]
    return {
        "elapsed": elapsed,
        "cpu": cpu,
        "outputs": outputs,
        "ttft": ttft,
        "stats": llm.last_run_stats,
    }


@pytest.mark.benchmark(group="e2e-cpu")
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_e2e_paged_engine(
    benchmark: Any, model_dir: Path, workload: list[Request], backend: str, hf_model: Any
) -> None:
    pool = _pool_blocks(workload)
    runs: list[dict] = []
    rss: list[PeakRSS] = []
    llms: list[LLM] = []
    batches = _hf_batches(workload, int(hf_model.config.pad_token_id))
    hf_cpu: list[float] = []

    def setup() -> tuple[tuple[LLM], dict[str, Any]]:
        # A transformers round before every paged_engine round (untimed here), for the
        # tracked CPU-time ratio: each side's fastest round then comes from the same
        # minutes. Measured apart (the transformers test, then this one), the two sides'
        # rounds saw different load: transformers' fastest CPU time moved 2.3 -> 1.5 ->
        # 1.7 s over three runs under a busy loop, and the ratio by -41% to -14%.
        hf_cpu.append(run_transformers(hf_model, batches)["cpu"])
        llm = LLM(
            model_dir,
            num_kvcache_blocks=pool,
            kvcache_block_size=BLOCK_SIZE,
            attention_backend=backend,
            num_threads=BENCH_THREADS,  # the same threads as transformers' side
        )
        llms[:] = [llm]
        return (llm,), {}

    def timed(llm: LLM) -> None:
        with PeakRSS() as peak:
            runs.append(run_paged_engine(llm, workload))
        rss.append(peak)

    benchmark.pedantic(
        timed, setup=setup, rounds=ROUNDS["paged_engine"], iterations=1, warmup_rounds=1
    )
    runs, rss = runs[1:] or runs, rss[1:] or rss
    last = runs[-1]
    stats = last["stats"]
    assert stats is not None and stats.preemptions == 0
    ours = [o.outputs[0].token_ids for o in last["outputs"]]
    assert [len(t) for t in ours] == [r.max_tokens for r in workload]
    useful = sum(r.max_tokens for r in workload)
    runner = llms[-1].model_runner
    info = {
        "engine": "paged_engine" if backend == "auto" else f"paged_engine[{backend}]",
        "threads": torch.get_num_threads(),
        **workload_summary(workload),
        **_summary(runs, useful),
        "ttft_first_s": round(min(min(r["ttft"]) for r in runs), 4),
        "ttft_mean_s": round(min(statistics.fmean(r["ttft"]) for r in runs), 4),
        "peak_rss_bytes": max(p.peak_bytes for p in rss),
        "rss_growth_bytes": max(p.growth_bytes for p in rss),
        "kv_cache_bytes": runner.kv_cache.numel() * runner.kv_cache.element_size(),
        "kv_cache_bytes_peak_in_use": stats.peak_blocks_in_use * runner.layout.bytes_per_block,
        "kv_blocks": runner.num_kvcache_blocks,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "prefill_tokens": stats.prefill_tokens,
        "steps": stats.steps,
        "attention_backend": runner.backend.name,
    }
    hf = _RESULTS.get("transformers")
    if hf is not None:
        info["speedup_vs_transformers"] = round(
            info["output_tokens_per_s"] / hf["output_tokens_per_s"], 2
        )
        info["speedup_vs_transformers_median"] = round(
            info["output_tokens_per_s_median"] / hf["output_tokens_per_s_median"], 2
        )
        info["target_speedup"] = TARGET_SPEEDUP
    # Regression tracking (bench/ratios.py, bench/compare.py): fastest rounds in process CPU
    # time (tokens per CPU-second), which other jobs do not inflate as they do wall time,
    # against the transformers rounds interleaved with this test's (``setup``).
    hf_rounds = hf_cpu[1:] or hf_cpu  # the first ran before the warm-up round
    info["transformers_interleaved_cpu_seconds_min"] = round(min(hf_rounds), 4)
    info["speedup_vs_transformers_cpu"] = round(min(hf_rounds) / info["cpu_seconds_min"], 2)
    info["tracked_ratios"] = {
        f"{info['engine']}/transformers (cpu)": info["speedup_vs_transformers_cpu"]
    }
    _check_tokens(ours, workload, model_dir, hf, info)
    benchmark.extra_info.update(info)
    print(f"\npaged_engine: {info}")


def _check_tokens(
    ours: list[list[int]],
    workload: list[Request],
    model_dir: Path,
    hf: dict[str, Any] | None,
    info: dict[str, Any],
) -> None:
    """Ours against transformers, outside the timed region (see the module docstring)."""
    from tests.hf_oracle import HFOracle, compare

    to_check = set(range(0, len(workload), HF_BATCH))
    if hf is not None:
        differ = [i for i, (a, b) in enumerate(zip(ours, hf["tokens"], strict=True)) if a != b]
        info["identical_to_transformers_batched"] = len(workload) - len(differ)
        to_check.update(differ)
    oracle = HFOracle(model_dir)
    verdicts = {
        i: compare(ours[i], oracle.greedy(workload[i].prompt, workload[i].max_tokens))
        for i in sorted(to_check)
    }
    real = {i: v for i, v in verdicts.items() if v not in ("same", "tie")}
    info["oracle_checked"] = len(verdicts)
    info["oracle_ties"] = sum(v == "tie" for v in verdicts.values())
    assert not real, real
