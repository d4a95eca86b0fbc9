"""Tensor parallelism's costs at Qwen3-0.6B's shapes, on CPU (gloo), and the two step
hand-offs compared (bench/test_tp_bench.py: the whole step at TP=2 against TP=1).

``test_tp_costs``: two spawned gloo ranks time, per call (fastest and median, the kinds
taking turns so that all see the same load), an all-reduce of ``[rows, 1024]`` float32
(Qwen3-0.6B's hidden size), the LM head's gather of ``[rows, 151936 / 2]``, and each
hand-off of a decode step of ``rows`` sequences of 1,000 tokens followed by a one-element
all-reduce (in the engine, the embedding's: where rank 0 learns the worker has the step);
the hand-off's cost is the fastest such call less the fastest one-element all-reduce
alone. It also computes (not measures) what a Qwen3-0.6B step moves: ``2 * 28 + 1``
all-reduces of ``rows * 1024 * 2`` bytes in bfloat16 and one gather, and the hand-off's
bytes against pickling every sequence's token list.

The figures and the kept hand-off are in docs/performance.md, "Tensor parallelism".
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_engine.engine.sequence import Sequence
from paged_engine.layers.parallel import TPGroup
from paged_engine.worker.handoff import BroadcastChannel, ShmChannel, ShmReader, StepMessage

QWEN3_06B = {"hidden": 1024, "layers": 28, "vocab": 151936, "bytes": 2}  # bfloat16
ROWS = (1, 16, 64, 256)


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 6), "median": round(statistics.median(xs), 6)}


def decode_step(rows: int, tokens: int = 1000, block: int = 16) -> list[Sequence]:
    seqs = []
    for i in range(rows):
        s = Sequence([3 + (7 * j + i) % 700 for j in range(tokens)], block_size=block, seq_id=i)
        s.num_cached_tokens, s.num_scheduled_tokens, s.is_prefill = tokens - 1, 1, False
        s.block_table = list(range(i * 63, i * 63 + s.num_blocks))
        seqs.append(s)
    return seqs


def _times(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Per call, in microseconds, the calls of ``fns`` taking turns ``rounds`` times (both
    ranks make the same calls in the same order), so that every kind sees the same load."""
    dist.barrier()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(1e6 * (time.perf_counter() - t0))
    return out


def _pair(rank: int, store: str, out: str, signal: Any) -> None:
    """Rank 0 records its per-call times: fastest (``min``) and ``median``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    hidden, vocab = QWEN3_06B["hidden"], QWEN3_06B["vocab"]
    tp = TPGroup(rank, 2)
    one = torch.zeros(1)
    channel: Any = ShmChannel([signal]) if rank == 0 else None
    box = [channel.name if channel else None]
    dist.broadcast_object_list(box, src=0)
    reader = ShmReader(box[0], signal, lambda: True) if rank == 1 else None
    bcast = BroadcastChannel()
    result: dict[str, Any] = {}
    for rows in ROWS:
        x, logits = torch.zeros(rows, hidden), torch.zeros(rows, vocab // 2)
        message = StepMessage.of(decode_step(rows), is_prefill=False) if rank == 0 else None
        # A hand-off, then the all-reduce that tells rank 0 the worker has it (in the
        # engine: the embedding's); "barrier" is that all-reduce alone.
        if rank == 0:
            shm = lambda m=message: (channel.send(m), dist.all_reduce(one))  # noqa: E731
            bc = lambda m=message: (bcast.send(m), dist.all_reduce(one))  # noqa: E731
        else:
            shm = lambda: (reader.receive(), dist.all_reduce(one))  # type: ignore[union-attr]  # noqa: E731
            bc = lambda: (bcast.receive(), dist.all_reduce(one))  # noqa: E731
        fns = {
            "all_reduce": lambda x=x: dist.all_reduce(x),
            "gather": lambda g=logits: tp.gather_last_dim(g),
            "barrier": lambda: dist.all_reduce(one),
            "shm": shm,
            "broadcast": bc,
        }
        for kind, ts in _times(fns, 40 if rows <= 64 else 12).items():
            result[f"{kind}[{rows}]"] = summary(ts)
    if rank == 0:
        channel.close()
        torch.save(result, out)
    else:
        reader.close()  # type: ignore[union-attr]
    dist.destroy_process_group()


def run_pair(tmp: Path) -> dict[str, Any]:
    signal = mp.get_context("spawn").Semaphore(0)
    out = tmp / "result.pt"
    mp.start_processes(
        _pair, args=(str(tmp / "store"), str(out), signal), nprocs=2, start_method="spawn"
    )
    return torch.load(out)  # type: ignore[no-any-return]


@pytest.mark.benchmark(group="tp-costs")
def test_tp_costs(benchmark: Any, tmp_path: Path) -> None:
    """pytest-benchmark's time is the whole measurement (two interpreters starting
    included), not a figure: the figures are in ``extra_info``."""
    found: list[dict[str, Any]] = []
    benchmark.pedantic(lambda: found.append(run_pair(tmp_path)), rounds=1, iterations=1)
    pair_results = found[0]
    q = QWEN3_06B
    per_layer = 2  # o_proj and down: row-parallel, one all-reduce each
    count = per_layer * q["layers"] + 1  # and the embedding's
    info: dict[str, Any] = {"qwen3_0.6b": q, "all_reduces_per_step": count, "gathers_per_step": 1}
    for rows in ROWS:
        r = {k: pair_results[f"{k}[{rows}]"] for k in ("all_reduce", "gather", "barrier")}
        ar_bytes = rows * q["hidden"] * q["bytes"]
        seqs = decode_step(rows)
        compact = len(pickle.dumps(StepMessage.of(seqs, False), protocol=5))
        full = len(pickle.dumps([(s.__getstate__()[:-1], s.token_ids) for s in seqs], protocol=5))
        info[f"rows={rows}"] = {
            "all_reduce_bytes": ar_bytes,
            "all_reduce_bytes_per_step": count * ar_bytes,
            "gather_bytes_from_rank_1": rows * (q["vocab"] // 2) * q["bytes"],
            "gloo_fp32_all_reduce_us": r["all_reduce"],
            "gloo_fp32_gather_us": r["gather"],
            "gloo_collectives_ms_per_step_fastest": round(
                (count * r["all_reduce"]["min"] + r["gather"]["min"]) / 1e3, 2
            ),
            "handoff_bytes": compact,
            "handoff_bytes_with_token_lists": full,
            # fastest call with a hand-off, less the fastest all-reduce alone
            **{
                f"handoff_{k}_us": round(
                    pair_results[f"{k}[{rows}]"]["min"] - r["barrier"]["min"], 1
                )
                for k in ("shm", "broadcast")
            },
            "barrier_us": r["barrier"],
        }
    benchmark.extra_info.update(info)
    print(f"\ntp-costs: {info}")
