"""Tensor parallelism end to end: TP=2 on CPU (gloo, this process and one worker) is token
for token TP=1 and transformers on the tiny Qwen3 in float32, with prefix hits, chunked
prefill, preemption and a second ``generate`` all happening; three mutants are caught by
that comparison; a worker killed mid-run makes the next step raise within a bound and
leaves no process behind. Workers that raise or exit, interpreter exit and the refusals:
tests/test_tp_lifecycle.py.

Each TP ``LLM`` spawns a worker (a fresh interpreter importing torch: a few seconds), so
the module builds as few as it can.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import paged_engine.layers.decoder as decoder
from paged_engine import LLM, SamplingParams
from paged_engine.worker import tp_worker
from paged_engine.worker.tp_process import WorkerError
from tests import tp_mutants
from tests.hf_oracle import HFOracle, Reference, compare
from tests.tp_support import (
    CONFIG,
    GREEDY,
    MAX_TOKENS,
    alive,
    assert_gone,
    bounded,
    make_prompts,
    tokens_of,
)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, prompts: list[list[int]]) -> list[Reference]:
    oracle = HFOracle(tiny_model_dir)
    return [oracle.greedy(p, MAX_TOKENS) for p in prompts]


EXTRAS = [  # rows turned into logits for prompt logprobs; sampling on rank 0
    SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=5),
]


def extras_of(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    """Per request: its token ids, then per position of its prompt and sampled logprobs,
    the ``(token id, rank, logprob)`` entries."""
    outs = llm.generate(prompts[:2], EXTRAS, use_tqdm=False)

    def entries(positions: Any) -> list[Any]:
        return [
            sorted((t, lp.rank, lp.logprob) for t, lp in (p or {}).items()) for p in positions or []
        ]

    return [
        (o.outputs[0].token_ids, entries(o.prompt_logprobs) + entries(o.outputs[0].logprobs))
        for o in outs
    ]


def assert_same_extras(got: list[Any], want: list[Any]) -> None:
    """Same tokens, ids and ranks; logprobs within 1e-4 (TP sums in another order)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert [[e[:2] for e in pos] for pos in g] == [[e[:2] for e in pos] for pos in w]
        flat = [
            (a[2], b[2]) for pg, pw in zip(g, w, strict=True) for a, b in zip(pg, pw, strict=True)
        ]
        assert all(abs(a - b) < 1e-4 for a, b in flat), flat


@pytest.fixture(scope="module")
def tp1_tokens(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return tokens_of(LLM(tiny_model_dir, **CONFIG), prompts)


@pytest.fixture(scope="module")
def tp1_extras(tiny_model_dir: Path, prompts: list[list[int]]) -> list[Any]:
    return extras_of(LLM(tiny_model_dir, **CONFIG), prompts)


def check(tokens: list[list[int]], tp1: list[list[int]], refs: list[Reference]) -> None:
    """Identical to TP=1, and to transformers up to its ties."""
    differ = [i for i, (a, b) in enumerate(zip(tokens, tp1, strict=True)) if a != b]
    assert not differ, f"TP=2 differs from TP=1 in requests {differ}"
    verdicts = [compare(t, r) for t, r in zip(tokens, refs, strict=True)]
    real = [v for v in verdicts if v not in ("same", "tie")]
    assert not real, real
    assert verdicts.count("tie") <= 2, "too many ties for the tiny model to be a good oracle"


# ---- equality ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2(tiny_model_dir: Path) -> Iterator[LLM]:
    """One TP=2 LLM for the equality test and then (it kills the worker) the next one."""
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    yield llm
    llm.close()


def test_tp2_is_token_identical_to_tp1_and_transformers(
    tp2: LLM,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    references: list[Reference],
    tp1_tokens: list[list[int]],
    tp1_extras: list[Any],
) -> None:
    assert tp2.config.tensor_parallel_size == 2 and tp2.model_runner.tp.size == 2
    assert tp2.model_runner.layout.num_kv_heads == 1  # its share of the tiny model's 2
    children = multiprocessing.active_children()
    with pytest.raises(RuntimeError, match="process group already exists"):
        LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)  # one TP group per process
    assert multiprocessing.active_children() == children
    first = tokens_of(tp2, prompts)
    stats = tp2.last_run_stats
    assert stats is not None and stats.preemptions > 0
    assert stats.steps > stats.prefill_tokens // 19  # chunked prefill
    second = tokens_of(tp2, prompts)  # the same LLM again: prefix hits now
    stats = tp2.last_run_stats
    assert stats is not None and stats.cached_prompt_tokens > 0
    extras = extras_of(tp2, prompts)
    assert_same_extras(extras, tp1_extras)
    assert len(extras[0][1]) > len(prompts[0])  # prompt logprobs were computed
    check(first, tp1_tokens, references)
    check(second, tp1_tokens, references)


def test_a_killed_worker_makes_the_next_step_raise(tp2: LLM, prompts: list[list[int]]) -> None:
    engine = tp2.llm_engine
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    (pid,) = tp2.model_runner.workers.pids  # type: ignore[union-attr]
    assert alive(pid)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died \(signal 9\)"):
        bounded(engine.step)
    assert_gone([pid])
    sched = engine.scheduler  # the step was recovered: nothing in flight, R12 holds
    assert not sched._in_flight
    everyone = [*sched.waiting, *sched.running]
    engine.block_manager.check_invariants(everyone)  # type: ignore[union-attr]
    assert all(s.num_cached_tokens == s.num_tokens - 1 for s in sched.running)
    with pytest.raises(RuntimeError, match="workers were shut down"):
        engine.step()


def test_replicated_kv_heads_and_the_with_block(tmp_path: Path, prompts: list[list[int]]) -> None:
    """One KV head, two ranks: each rank holds a replica of it (the rule in
    layers/parallel.py) and half the query heads. The ``with`` block ends the worker."""
    from paged_engine.utils.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "kv1", seed=3, num_kv_heads=1)
    tp1 = tokens_of(LLM(model, **CONFIG), prompts)
    with LLM(model, tensor_parallel_size=2, **CONFIG) as llm:
        assert llm.model_runner.layout.num_kv_heads == 1
        pids = llm.model_runner.workers.pids  # type: ignore[union-attr]
        tp2 = tokens_of(llm, prompts)
    assert tp2 == tp1
    assert_gone(pids)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)


FAMILIES = {
    "Qwen2ForCausalLM": {},  # q/k/v biases: sliced with their heads
    "LlamaForCausalLM": {
        "attention_bias": True,  # o_proj's bias is added once, after the all-reduce
        "mlp_bias": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_tp2_of_each_family_is_token_identical_to_transformers(
    tmp_path: Path, prompts: list[list[int]], architecture: str
) -> None:
    """The sharded pieces each family adds (biases on column- and row-parallel layers,
    llama3 rotary) under TP=2, against transformers' own class."""
    from paged_engine.utils.tiny_model import make_tiny_model

    overrides = dict(FAMILIES[architecture])
    rope = overrides.pop("rope_parameters", None)
    model = make_tiny_model(
        tmp_path / "m",
        seed=4,
        tie_word_embeddings=False,
        architecture=architecture,
        rope_parameters=rope,
        config_overrides=overrides,
    )
    oracle = HFOracle(model)
    refs = [oracle.greedy(p, MAX_TOKENS) for p in prompts[:6]]
    with LLM(model, tensor_parallel_size=2, **CONFIG) as llm:
        tp2 = tokens_of(llm, prompts[:6])
    verdicts = [compare(t, r) for t, r in zip(tp2, refs, strict=True)]
    assert all(v in ("same", "tie") for v in verdicts), verdicts
    assert verdicts.count("same") >= 5, verdicts


# ---- mutants -------------------------------------------------------------------------------

MUTANTS: dict[str, tuple[Callable[..., None], str | None, type | None]] = {
    "row-parallel without all-reduce": (
        tp_mutants.row_parallel_worker,
        "RowParallelLinear",
        tp_mutants.RowParallelWithoutAllReduce,
    ),
    "vocab embedding without mask": (
        tp_mutants.vocab_embedding_worker,
        "VocabParallelEmbedding",
        tp_mutants.VocabEmbeddingWithoutMask,
    ),
    "worker reads token_ids, not last_token": (tp_mutants.token_ids_worker, None, None),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_equality_check_catches_a_mutant(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    references: list[Reference],
    tp1_tokens: list[list[int]],
    name: str,
) -> None:
    worker, layer, mutant = MUTANTS[name]
    monkeypatch.setattr(tp_worker, "worker_main", worker)
    if layer is not None:  # a layer mutant runs on rank 0 too
        monkeypatch.setattr(decoder, layer, mutant)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG)
    pids = llm.model_runner.workers.pids  # type: ignore[union-attr]
    tokens = tokens_of(llm, prompts)
    del llm  # its finalizer ends the worker
    gc.collect()
    assert_gone(pids)
    with pytest.raises(AssertionError, match="TP=2 differs from TP=1"):
        check(tokens, tp1_tokens, references)


_CUDA = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(
    _CUDA < 2, reason=f"skipped: {_CUDA} device{'' if _CUDA == 1 else 's'} (NCCL TP=2 needs 2)"
)
def test_nccl_tp2_is_token_identical_to_tp1(
    tiny_model_dir: Path, prompts: list[list[int]], references: list[Reference]
) -> None:
    cuda = {**CONFIG, "device": "cuda", "dtype": "float32"}
    tp1 = tokens_of(LLM(tiny_model_dir, **cuda), prompts)
    with LLM(tiny_model_dir, tensor_parallel_size=2, **cuda) as llm:
        tp2 = tokens_of(llm, prompts)
    check(tp2, tp1, references)
