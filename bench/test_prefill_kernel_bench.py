"""Prefill attention on the paged decode kernel against per-sequence SDPA: issue 13's "paged
prefill kernel", measured before it is kept (it was not: see the module's last paragraph).

The ``cpu`` backend prefills with the torch backend's path: per sequence, gather the cached
prefix from the pool, build a causal mask, one SDPA call. The candidate (``KernelPrefill``,
below, a subclass that lives here, not in the product) sends every new row of the step to
the compiled decode kernel as a query of its own: row ``j`` of a sequence whose first
``c`` tokens are cached attends to the first ``c + j + 1`` slots of that sequence's block
table, read straight from the pool (the step's new K/V are stored before ``attend``). One
kernel call per layer for the whole step, causal by construction, prefix hits and chunks
included; nothing gathered, no mask.

Workload: ``tox -e bench``'s end-to-end requests (64 prompts over 4 shared prefixes), one
thread, block size 32, on the two models of ``bench/models.py`` in float32 and bfloat16,
twice: ``prefill`` (one output token each: the steps are almost all prefill) and ``e2e``
(the workload's 32-128 new tokens). One ``LLM`` per cell; the two attention paths alternate
round by round on it (the backend object's class is swapped between rounds), the prefix
cache reset before each round. Reported (``extra_info``, printed): seconds per round, min
and median, ``kernel / sdpa`` of each (below 1: the kernel is faster), and how many
requests' greedy tokens agree.

Why it was not kept (the figures are the README's): the kernel, one matrix-vector pass per
query row, did no better than SDPA's tiled GEMMs, within the noise, prefill attention being
a small part of the 29M model's end-to-end time; and it would change bfloat16 prefill
numerics (P is not rounded to bfloat16 in the kernel; SDPA's bfloat16 path rounds).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.models import MODELS
from bench.test_e2e_bench import make_workload, workload_summary
from paged_engine.kernels.paged_decode_cpu import geometry_problem
from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend

ROUNDS = int(os.environ.get("PAGED_ENGINE_PREFILL_BENCH_ROUNDS", "2"))
BLOCK_SIZE = 32


class KernelPrefill(CpuAttentionBackend):
    """The ``cpu`` backend with every prefill row on the decode kernel (see the module)."""

    _rows: tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None = None

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        usable = (
            meta.max_query_len > 1
            and k_cache.numel() != 0
            and meta.slots_all_valid is True  # every new row is in the pool
            and query.dtype == k_cache.dtype
            and geometry_problem(query.shape[1], k_cache.shape[2], query.shape[2], query.dtype)
            is None
        )
        if not usable:
            return super().attend(query, key, value, k_cache, v_cache, meta, scale)
        if self._rows is None or self._rows[0] is not meta:  # once per step
            q_lens, ctx = np.asarray(meta.query_lens_cpu), np.asarray(meta.seq_lens_cpu)
            owner = np.repeat(np.arange(q_lens.size), q_lens)
            first_row = np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
            lens = np.repeat(ctx - q_lens, q_lens) + np.arange(owner.size) - first_row + 1
            tables = meta.block_tables.index_select(0, torch.from_numpy(owner)).contiguous()
            self._rows = (meta, tables, torch.from_numpy(lens.astype(np.int32)))
        _, tables, lens = self._rows
        return self._decode_checked_per_step(query, k_cache, v_cache, tables, lens, scale)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from paged_engine.utils.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("prefill-models")
    return {name: make_tiny_model(root / name, seed=0, **kw) for name, kw in MODELS.items()}


@pytest.mark.benchmark(group="prefill-kernel")
@pytest.mark.parametrize("phase", ["prefill", "e2e"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_prefill_on_kernel(
    benchmark: Any, model_dirs: dict[str, Path], model: str, dtype: str, phase: str
) -> None:
    from transformers import AutoConfig

    from paged_engine import LLM, SamplingParams

    path = model_dirs[model]
    workload = make_workload(int(AutoConfig.from_pretrained(path).vocab_size))
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // BLOCK_SIZE) for r in workload)
    llm = LLM(
        path,
        dtype=dtype,
        num_threads=1,
        kvcache_block_size=BLOCK_SIZE,
        num_kvcache_blocks=blocks,
        attention_backend="cpu",
    )
    backend = llm.model_runner.backend
    assert type(backend) is CpuAttentionBackend
    paths = {"sdpa": CpuAttentionBackend, "kernel": KernelPrefill}
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=1 if phase == "prefill" else r.max_tokens, ignore_eos=True
        )
        for r in workload
    ]
    prompts = [r.prompt for r in workload]
    times: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, list[list[int]]] = {}

    def measure() -> None:
        for i in range(ROUNDS + 1):  # round 0 of each: warm-up, not counted
            for name in list(paths) if i % 2 == 0 else list(paths)[::-1]:
                backend.__class__ = paths[name]
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if i:
                    times[name].append(time.perf_counter() - start)
                tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
        backend.__class__ = CpuAttentionBackend

    benchmark.pedantic(measure, rounds=1, iterations=1, warmup_rounds=0)
    assert all(len(t) == p.max_tokens for t, p in zip(tokens["kernel"], params, strict=True))
    same = sum(a == b for a, b in zip(tokens["sdpa"], tokens["kernel"], strict=True))
    info = {
        "suite": "prefill-kernel",
        "model": model,
        "dtype": dtype,
        "phase": phase,
        **workload_summary(workload),
        **{f"{n}_s_min": round(min(t), 4) for n, t in times.items()},
        **{f"{n}_s_median": round(statistics.median(t), 4) for n, t in times.items()},
        "kernel_over_sdpa": round(min(times["kernel"]) / min(times["sdpa"]), 3),
        "kernel_over_sdpa_median": round(
            statistics.median(times["kernel"]) / statistics.median(times["sdpa"]), 3
        ),
        "identical_tokens": same,
    }
    benchmark.extra_info.update(info)
    print(f"\n{model} {dtype} {phase}: {info}")
