"""The load path: ``LLM`` reads the model directory's config once into a ``ModelConfig`` and
hands it down; the model runner and every tensor-parallel worker (which gets it pickled in
its spec) build from that record and never parse config.json again. The CUDA pool budget's
measurement, wired to the runner, run on a CPU against a fake allocator.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

import paged_engine.utils.model_config as model_config
from paged_engine import LLM, SamplingParams
from paged_engine.config import EngineConfig
from paged_engine.utils.model_config import ModelConfig
from paged_engine.worker import cuda_memory, tp_worker
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.tp_process import WorkerSpec
from tests import tp_mutants
from tests.tp_support import CONFIG, assert_gone, bounded, tokens_of

SMALL: dict[str, Any] = {"num_kvcache_blocks": 16, "max_model_len": 64}


@pytest.fixture
def config_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every parse of a config.json in this process: by this package's JSON reader
    ("json") and by transformers ("transformers")."""
    reads: list[str] = []
    real_read = model_config.read_json_object
    real_parse = AutoConfig.from_pretrained

    def read_json_object(path: Path) -> Any:
        if path.name == "config.json":
            reads.append("json")
        return real_read(path)

    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        reads.append("transformers")
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(model_config, "read_json_object", read_json_object)
    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    return reads


def test_llm_parses_config_json_once(tiny_model_dir: Path, config_reads: list[str]) -> None:
    """Before: ``LLM`` parsed it, then the runner again (and each TP worker)."""
    llm = LLM(tiny_model_dir, **SMALL)
    assert config_reads == ["json", "transformers"]
    assert llm.model_runner.model_config.model_dir == tiny_model_dir
    # min_tokens masks the ids the engine stops at: the runner has them from construction
    assert llm.model_runner.eos_token_ids == llm.engine.eos_token_ids != ()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert config_reads == ["json", "transformers"]  # nor later


def test_a_runner_built_from_a_model_config_reads_no_file(
    tiny_model_dir: Path, config_reads: list[str]
) -> None:
    model = ModelConfig.load(tiny_model_dir)
    config_reads.clear()
    runner = ModelRunner(model, EngineConfig(device="cpu", **SMALL))
    assert config_reads == []
    assert runner.model_config is model
    assert runner.hf_config is model.hf_config


def test_a_runner_built_from_a_directory_reads_it_once(
    tiny_model_dir: Path, config_reads: list[str]
) -> None:
    runner = ModelRunner(tiny_model_dir, EngineConfig(device="cpu", **SMALL))
    assert config_reads == ["json", "transformers"]
    assert runner.model_config.vocab_size == int(runner.hf_config.vocab_size)


def test_the_worker_spec_carries_the_model_config(tiny_model_dir: Path) -> None:
    model = ModelConfig.load(tiny_model_dir)
    spec = WorkerSpec(model, EngineConfig(tensor_parallel_size=2), 1234, "gloo", None, 60.0)
    copy = pickle.loads(pickle.dumps(spec))
    assert copy.model.model_dir == model.model_dir
    assert copy.model.eos_token_ids == model.eos_token_ids
    assert copy.model.hf_config.to_dict() == model.hf_config.to_dict()


def test_tp_workers_build_from_rank_0s_config(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    """The worker refuses to parse config.json (``tp_mutants.config_unreadable_worker``):
    it starts and computes the TP=1 tokens only from the record in its spec. Before, each
    worker read the directory again (and failed here with the probe's AssertionError)."""
    prompts = [[3 + (7 * i + j) % 700 for j in range(20 + 9 * i)] for i in range(3)]
    want = tokens_of(LLM(tiny_model_dir, **CONFIG), prompts)
    monkeypatch.setattr(tp_worker, "worker_main", tp_mutants.config_unreadable_worker)
    with LLM(tiny_model_dir, tensor_parallel_size=2, **CONFIG) as llm:
        pids = llm.model_runner.workers.pids  # type: ignore[union-attr]
        assert llm.model_runner.eos_token_ids == llm.engine.eos_token_ids != ()
        assert bounded(lambda: tokens_of(llm, prompts)) == want
    assert_gone(pids)


# ---- the CUDA pool budget, on a CPU ------------------------------------------------------


class FakeAllocator:
    """``torch.cuda``'s memory counters: ``allocated`` bytes now, the peaks that successive
    ``max_memory_allocated`` calls report, a device of ``total`` bytes with ``free`` free."""

    def __init__(self, allocated: int, peaks: list[int], free: int, total: int) -> None:
        self.allocated, self.peaks, self.free, self.total = allocated, peaks, free, total

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        values: dict[str, Callable[..., Any]] = {
            "empty_cache": lambda: None,
            "synchronize": lambda device=None: None,
            "reset_peak_memory_stats": lambda device=None: None,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peaks.pop(0),
            "mem_get_info": lambda device=None: (self.free, self.total),
        }
        for name, fn in values.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_the_cuda_budget_measures_a_full_prefill_and_sampling_through_the_runner(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    config = EngineConfig(
        device="cpu",
        max_model_len=64,
        max_num_seqs=3,
        max_num_batched_tokens=150,
        num_kvcache_blocks=16,
    )
    runner = ModelRunner(tiny_model_dir, config)
    runner.kv_cache = torch.empty(0)  # as when the runner measures: before the pool exists
    steps: list[tuple[list[int], bool]] = []
    real_forward = runner._forward

    def forward(seqs: list[Any], is_prefill: bool) -> Any:
        steps.append(([s.num_scheduled_tokens for s in seqs], is_prefill))
        return real_forward(seqs, is_prefill)

    monkeypatch.setattr(runner, "_forward", forward)
    mib = 2**20
    # the prefill peaks at 300 MiB, the sampling at 450 MiB (350 over the 100 MiB weights)
    fake = FakeAllocator(100 * mib, [300 * mib, 450 * mib], free=1000 * mib, total=2000 * mib)
    fake.install(monkeypatch)
    budget = cuda_memory.cuda_pool_budget(runner)
    # 150 tokens as sequences of at most max_model_len; no decode pass (no graphs on a CPU)
    assert steps == [([64, 64, 22], True)]
    assert fake.peaks == []  # both peaks were read
    # others hold 2000 - 1000 - 100 MiB; the step needs max(300, 100 + 350) MiB
    assert budget == int(2000 * mib * 0.9) - 900 * mib - 450 * mib
