"""CUDA graphs for decode: buckets, padding, static buffers, frozen metadata, and the engine
giving the same greedy tokens with graphs as without.

On CPU a stand-in replaces ``torch.cuda.CUDAGraph``: capturing records the step function,
replaying calls it again on the same static buffers and the same capture-time metadata, so a
replay sees exactly what a real graph would (new values only through the buffers ``fill``
writes; every host-side value frozen at capture). Under the ``gpu`` marker the same
comparison runs with real graphs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.config import EngineConfig
from paged_engine.kernels.paged_decode_attention import is_interpreted
from paged_engine.layers.attention import AttentionMetadata, make_attention_metadata
from paged_engine.worker.cuda_graphs import (
    DecodeGraphs,
    StaticDecodeBuffers,
    bucket_for,
    capture_sizes,
)

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()


class FakeGraph:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class FakeCapture:
    """Records each capture: its function, and the pool it was handed."""

    def __init__(self) -> None:
        self.pools: list[Any] = []

    def __call__(self, fn: Callable[[], None], pool: Any) -> tuple[FakeGraph, Any]:
        self.pools.append(pool)
        return FakeGraph(fn), "the pool"


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert capture_sizes(10_000)[-3:] == (480, 496, 512)  # capped like nano-vllm
    sizes = capture_sizes(40)
    assert [bucket_for(sizes, n) for n in (1, 3, 8, 9, 17, 33, 40, 41, 0)] == [
        1, 4, 8, 16, 32, 40, 40, None, None,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0)


def _decode_meta(tables: list[list[int]], lens: list[int], block_size: int) -> AttentionMetadata:
    return make_attention_metadata([1] * len(lens), lens, tables, block_size)


def test_fill_copies_the_rows_and_pads_the_bucket() -> None:
    buffers = StaticDecodeBuffers.allocate(8, table_width=5, device=CPU)
    wide = _decode_meta([[3, 4, 5, 6], [7], [1, 2], [0], [8]], [60, 3, 20, 9, 2], 16)
    buffers.fill(8, torch.arange(5) + 100, torch.arange(5) + 50, wide)
    narrow = _decode_meta([[9], [2, 3]], [4, 17], 16)
    buffers.fill(4, torch.tensor([11, 12]), torch.tensor([3, 16]), narrow)
    assert buffers.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert buffers.positions[:4].tolist() == [3, 16, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [9 * 16 + 3, 3 * 16 + 0, -1, -1]
    assert buffers.seq_lens[:4].tolist() == [4, 17, 0, 0]
    # Every column of the bucket's rows rewritten: none of the wider step's blocks remain.
    assert buffers.block_tables[:4].tolist() == [
        [9, -1, -1, -1, -1], [2, 3, -1, -1, -1], [-1] * 5, [-1] * 5,
    ]  # fmt: skip
    statics = (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens)
    before = [t.clone() for t in (*statics, buffers.block_tables)]
    with pytest.raises(ValueError, match="cannot put 2 rows into bucket 1"):
        buffers.fill(1, torch.tensor([1, 2]), torch.tensor([1, 2]), narrow)
    too_wide = _decode_meta([list(range(6))], [90], 16)
    with pytest.raises(ValueError, match="6 wide do not fit the captured 5"):
        buffers.fill(1, torch.tensor([1]), torch.tensor([1]), too_wide)
    # A refused fill writes nothing.
    assert all(
        torch.equal(a, b) for a, b in zip(before, (*statics, buffers.block_tables), strict=True)
    )


def _toy_forward(calls: list[int]) -> Callable[..., torch.Tensor]:
    """A stand-in model that reads every static input: hidden = f(ids, positions, lengths,
    slots, the table's first column), and counts its calls."""

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        calls.append(ids.shape[0])
        cols = [ids, pos, meta.seq_lens.long(), meta.slot_mapping, meta.block_tables[:, 0].long()]
        return torch.stack(cols, dim=1).float()

    return forward


def test_replays_equal_the_eager_step_for_every_batch_size() -> None:
    calls: list[int] = []
    forward = _toy_forward(calls)
    capture = FakeCapture()
    sizes = capture_sizes(6)
    graphs = DecodeGraphs(
        forward, StaticDecodeBuffers.allocate(6, 4, CPU), sizes, 5, torch.float32, capture
    )
    assert calls == [6, 4, 2, 1]  # the warm-ups, largest bucket first
    assert capture.pools == [None, "the pool", "the pool", "the pool"]  # one shared pool
    for n in range(1, 7):
        tables = [[i, i + 1] for i in range(n)]
        meta = _decode_meta(tables, [17 + i for i in range(n)], 16)
        ids, pos = torch.arange(n) + 7, torch.arange(n) + 16
        got = graphs.run(ids, pos, meta)
        assert got is not None and torch.equal(got, forward(ids, pos, meta)), n
        assert calls[-2] == bucket_for(sizes, n)  # the replay ran the bucket's graph
    assert graphs.replays == 6
    seven = _decode_meta([[i] for i in range(7)], [2] * 7, 16)
    assert (
        graphs.run(torch.zeros(7, dtype=torch.long), torch.ones(7, dtype=torch.long), seven) is None
    )
    prefill = make_attention_metadata([3], [3], [[0]], 16)
    assert graphs.run(torch.zeros(3, dtype=torch.long), torch.arange(3), prefill) is None


def test_enforce_eager_is_a_validated_config_field() -> None:
    assert EngineConfig().enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager must be a bool, got 1"):
        EngineConfig(enforce_eager=1)  # type: ignore[arg-type]


# ---- the engine, graphs against eager ---------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [20] * 40]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _llm(model_dir: Path, device: str, **kw: Any) -> LLM:
    return LLM(
        model_dir,
        attention_backend="triton",
        device=device,
        dtype="float32",
        kvcache_block_size=16,
        num_kvcache_blocks=32,
        max_model_len=128,
        max_num_seqs=4,  # buckets 1, 2, 4: three sequences replay bucket 4, one row padded
        **kw,
    )


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.skipif(not is_interpreted(), reason="the CPU run needs the Triton interpreter")
def test_graphed_decode_gives_the_eager_tokens_on_cpu(tiny_model_dir: Path) -> None:
    """Also the regression test for a memo hazard: the rotary factors are memoised by the
    positions tensor's identity, so a warm-up on the static buffers would have frozen the
    warm-up's factors into the graph (``DecodeGraphs`` passes fresh views every call)."""
    eager = _tokens(_llm(tiny_model_dir, "cpu", enforce_eager=True))
    llm = _llm(tiny_model_dir, "cpu")
    runner = llm.model_runner
    assert runner.decode_graphs is None  # no CUDA: eager by default
    runner.decode_graphs = runner._capture_decode_graphs(FakeCapture())
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == (1, 2, 4)
    assert _tokens(llm) == eager
    assert runner.decode_graphs.replays == GREEDY.max_tokens - 1  # every decode step replayed
    eager_llm = _llm(tiny_model_dir, "cpu", enforce_eager=True)
    assert eager_llm.model_runner._capture_decode_graphs(FakeCapture()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or is_interpreted(), reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_cuda_graphs_give_the_eager_tokens(tiny_model_dir: Path, dtype: str) -> None:
    def run(**kw: Any) -> tuple[list[list[int]], LLM]:
        llm = LLM(
            tiny_model_dir,
            attention_backend="triton",
            device="cuda",
            dtype=dtype,
            max_model_len=256,
            max_num_seqs=8,
            **kw,
        )
        prompts = [[i + 3] * (5 + 9 * i) for i in range(7)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)], llm

    eager, _ = run(enforce_eager=True)
    graphed, llm = run()
    graphs = llm.model_runner.decode_graphs
    assert graphs is not None and graphs.replays > 0
    assert graphed == eager


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or is_interpreted(), reason="needs CUDA and compiled kernels")
def test_gpu_a_full_step_fits_the_memory_target(tiny_model_dir: Path) -> None:
    """The pool is sized from CUDA memory so that a step at full width (max_num_seqs rows
    sampled with every filter and logprobs, split-K decode, graphs held) stays within
    ``gpu_memory_utilization`` of the device."""
    target = 0.5
    llm = LLM(
        tiny_model_dir,
        attention_backend="triton",
        device="cuda",
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=128,
        gpu_memory_utilization=target,
    )
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, logprobs=5, max_tokens=16)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(300)] for i in range(128)]
    llm.generate(prompts, params, use_tqdm=False)
    total = torch.cuda.get_device_properties(0).total_memory
    assert torch.cuda.max_memory_allocated() <= target * total
