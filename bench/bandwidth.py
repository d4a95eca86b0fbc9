"""The machine's read bandwidth, and the CPU decode kernel's effective read bandwidth on the
29M model's shapes: issue 25, item 2's measurement (bench/test_bandwidth_bench.py runs this
in a fresh interpreter and records the figures).

* ``stream``: a STREAM-like read of a float32 buffer far larger than the last-level cache
  (``STREAM_BYTES``, or ``LLC_MULTIPLE`` times the cache where that is more), reduced by
  ``torch.sum`` and by ``numpy.sum``, at 1 thread and at every usable CPU; GB/s = bytes /
  seconds of one pass (1 GB = 1e9 bytes). Where the kernel allows huge pages, each reader
  also reads a copy on huge pages (``_huge``). The machine's read bandwidth at a thread
  count is the best of the readers and buffers.
* ``decode``: ``run_paged_decode_cpu`` (checks made once, as a step makes them) for
  ``batch`` sequences of ``context`` tokens in 16-token blocks (the engine's default), the
  29M model's heads (8 query / 4 KV heads, head_dim 64) and SmolLM2-135M's (9 / 3, head_dim
  64; cells named ``smollm2_...``), float32 and bfloat16. Bytes per call = the K and V rows
  the contexts cover, ``2 * batch * context * kv_heads * head_dim * itemsize`` (the query,
  tables and output are below 1% of it and not counted). ``cold``: each call reads the next
  copy of the batch's blocks, shuffled over a pool of at least ``COLD_BYTES`` (8x a 32 MiB
  last-level cache; ``LLC_MULTIPLE`` times a larger one), so every call streams from memory
  as one layer of a real step does (the model's weights evict the cache between layers);
  ``ordered``: the same, but each copy's blocks consecutive in the pool, sequence after
  sequence (the best case for the hardware prefetcher: what the block tables' jumps cost is
  cold against ordered); ``hot``: the same blocks every call (cached where they fit: a
  ceiling on what the kernel's arithmetic allows). The fraction is cold (and ordered) GB/s
  over the machine's read bandwidth at the same thread count.
* ``_huge`` (``cold_huge``, ``ordered_huge``): the same calls over a second pool allocated
  empty, advised onto transparent huge pages before it is written
  (``bench/huge_pages.py``; the engine's own pool is not advised), alternated with the
  first (whose pages are the allocator's ordinary 4 KiB ones) call by call within each
  round; only where the kernel's THP mode allows the advice. ``anon_huge_mib`` is the
  process's huge-page-backed memory once both pools are written (``/proc/self/smaps_rollup``).

Every setting is measured ``rounds`` times, thread counts alternating (1, N then N, 1, ...);
per setting the best (fastest) and the median pass or call.

Run alone: ``python -m bench.bandwidth [--rounds N] [--quick]``; prints one line per cell and
the figures as the last line, a JSON object. Import paged_engine first (it sets OpenMP's
passive wait before torch loads it, as a user gets it); the caller removes ``OMP_*``.
"""

from __future__ import annotations

import paged_engine  # noqa: F401  (first: OMP_WAIT_POLICY before torch loads OpenMP)

# isort: split
import argparse
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.huge_pages import advise_huge_pages, huge_pages_usable, transparent_huge_pages
from bench.models import MODELS
from paged_engine import platform
from paged_engine.kernels.paged_decode_cpu import (
    bf16_variants,
    check_paged_decode_cpu,
    run_paged_decode_cpu,
)
from paged_engine.platform_cgroup import read_text

STREAM_BYTES = 512 * 2**20
"""The least stream buffer (16x a 32 MiB last-level cache; ``sized`` takes more for more)."""
COLD_BYTES = 256 * 2**20
"""The least K+V a cold decode cell rotates over (8x a 32 MiB last-level cache)."""
LLC_MULTIPLE = 4
"""Where the CPU reports a larger last-level cache, both are at least this many times it: a
VM on a 480 MiB-L3 Xeon held 256 MiB pools in cache, and read "cold" blocks from it."""
BLOCK_SIZE = 16
BATCHES = (8, 32)
CONTEXTS = (128, 512)
GEOMETRIES: dict[str, dict[str, int]] = {
    "": MODELS["qwen3-29m"],  # the cells' names carry no prefix, as before SmolLM2's came
    "smollm2_": dict(num_heads=9, num_kv_heads=3, head_dim=64),
}
"""Attention geometries, by the prefix of their cells' names: the 29M model's (8 query / 4
KV heads of 64) and SmolLM2-135M's (9 / 3 of 64; the real model bench-vllm runs)."""


def last_level_cache_bytes(root: Path | None = None) -> int | None:
    """The largest cache sysfs reports for CPU 0 (``root``: its ``cache`` directory, by
    default under ``platform.SYS_CPU``), bytes; None where there is none to read."""
    root = root or platform.SYS_CPU / "cpu0" / "cache"
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for path in root.glob("index*/size"):
        text = read_text(path) or ""
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=None)


def sized(least: int, llc: int | None) -> int:
    """``least`` bytes, or ``LLC_MULTIPLE`` last-level caches where that is more."""
    return max(least, LLC_MULTIPLE * llc) if llc else least


def usable_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_counts() -> tuple[int, ...]:
    n = usable_threads()
    return (1,) if n == 1 else (1, n)


def dtypes() -> tuple[torch.dtype, ...]:
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported() and bool(bf16_variants())
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _alternating(rounds: int, counts: tuple[int, ...]) -> list[int]:
    order: list[int] = []
    for r in range(rounds):
        order += list(counts if r % 2 == 0 else counts[::-1])
    return order


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    best, median = min(times), statistics.median(times)
    return {
        "us_min": round(best * 1e6, 1),
        "us_median": round(median * 1e6, 1),
        "gbs_best": round(nbytes / best / 1e9, 2),
        "gbs_median": round(nbytes / median / 1e9, 2),
        "samples": len(times),
    }


def stream(rounds: int, nbytes: int = STREAM_BYTES, passes: int = 3) -> dict[str, Any]:
    """Read bandwidth per thread count: ``{f"{reader}_{n}t": summary}`` and
    ``f"read_{n}t_gbs_best"``/``_median`` (the better reader's)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written: every page is mapped
    readers: dict[str, Callable[[], object]] = {}
    buffers = {"": buf}
    if huge_pages_usable():  # the same read over huge pages: the machine's best is either
        buffers["_huge"] = huge_copy(buf)
    for suffix, b in buffers.items():
        arr = b.numpy()
        readers[f"torch_sum{suffix}"] = b.sum
        readers[f"numpy_sum{suffix}"] = arr.sum
    times: dict[str, list[float]] = {}
    for n in _alternating(rounds, thread_counts()):
        torch.set_num_threads(n)  # numpy's sum is single-threaded whatever n says
        for name, read in readers.items():
            if name.startswith("numpy_sum") and n > 1:
                continue
            read()  # warm: the first pass after a switch pays the threads' start
            for _ in range(passes):
                start = time.perf_counter()
                read()
                times.setdefault(f"{name}_{n}t", []).append(time.perf_counter() - start)
    out: dict[str, Any] = {k: _summary(v, nbytes) for k, v in times.items()}
    for n in thread_counts():
        cells = [v for k, v in out.items() if k.endswith(f"_{n}t")]
        for stat in ("best", "median"):
            out[f"read_{n}t_gbs_{stat}"] = max(c[f"gbs_{stat}"] for c in cells)
    return out


def huge_copy(src: torch.Tensor) -> torch.Tensor:
    """A copy of ``src`` in memory allocated empty (as the engine's KV pool is), advised onto
    huge pages, then written."""
    pool = torch.empty_like(src)
    advise_huge_pages(pool.data_ptr(), pool.nbytes)
    return pool.copy_(src)


def anon_huge_mib() -> float | None:
    """This process's anonymous memory on huge pages, MiB (None where unreadable)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def decode_cell(
    batch: int,
    context: int,
    dtype: torch.dtype,
    rounds: int,
    calls: int,
    cold_bytes: int,
    huge: bool,
    shape: dict[str, int],
) -> dict[str, Any]:
    """The kernel's cold, ordered and hot per-call figures at each thread count, and with
    ``huge`` the cold and ordered ones over a huge-page pool too (see the module), for the
    attention geometry ``shape``."""
    heads, kv_heads, dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = 2 * batch * context * kv_heads * dim * itemsize
    copies = max(2, math.ceil(cold_bytes / nbytes))
    width = -(-context // BLOCK_SIZE)
    num_blocks = copies * batch * width
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
    k = torch.rand(shape, generator=gen).sub_(0.5).to(dtype)
    v = torch.rand(shape, generator=gen).sub_(0.5).to(dtype)
    pools = {"": (k, v)}
    if huge:
        pools["_huge"] = (huge_copy(k), huge_copy(v))
    shuffled = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    in_order = torch.arange(num_blocks, dtype=torch.int32)
    tables = {
        mode: [t.contiguous() for t in ids.view(copies, batch, width).unbind(0)]
        for mode, ids in (("cold", shuffled), ("ordered", in_order))
    }
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.rand(batch, heads, dim, generator=gen).sub_(0.5).to(dtype)
    out = torch.empty_like(q)
    scale = dim**-0.5
    counts = thread_counts()
    launches = {
        n: check_paged_decode_cpu(q, k, v, tables["cold"][0], seq_lens, num_threads=n)
        for n in counts
    }
    times: dict[str, list[float]] = {}
    turn = dict.fromkeys(tables, 0)  # copies 1.. in turn, across rounds: 0 is the hot one
    for n in _alternating(rounds, counts):
        launch = launches[n]
        for mode in ("cold", "ordered", "hot"):
            for i in range(calls + 1):  # call 0 warms up
                table = tables["cold"][0]
                if mode != "hot":
                    table = tables[mode][1 + turn[mode] % (copies - 1)]
                    turn[mode] += 1
                for suffix, (pk, pv) in pools.items():  # the same table in each pool
                    if mode == "hot" and suffix:
                        continue
                    start = time.perf_counter()
                    run_paged_decode_cpu(launch, q, pk, pv, table, seq_lens, scale, out)
                    elapsed = time.perf_counter() - start
                    if i:
                        times.setdefault(f"{mode}{suffix}_{n}t", []).append(elapsed)
    return {
        "kv_bytes_per_call": nbytes,
        "copies": copies,
        "anon_huge_mib": anon_huge_mib(),
        **{key: _summary(ts, nbytes) for key, ts in times.items()},
    }


def measure(rounds: int, quick: bool = False) -> dict[str, Any]:
    """Every figure (see the module); ``quick``: a small buffer and pool, few calls (a smoke
    run whose figures mean nothing)."""
    llc = last_level_cache_bytes()
    cold_bytes = 4 * 2**20 if quick else sized(COLD_BYTES, llc)
    result: dict[str, Any] = {
        "threads": list(thread_counts()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "bf16_variants": list(bf16_variants()),
        "llc_bytes": llc,
        "stream_bytes": 8 * 2**20 if quick else sized(STREAM_BYTES, llc),
        "cold_bytes": cold_bytes,
        "thp_mode": transparent_huge_pages(),
        "load_avg_before": round(os.getloadavg()[0], 2),
    }
    result["stream"] = stream(rounds, result["stream_bytes"])
    print(stream_line(result), flush=True)
    result["decode"] = {}
    huge = huge_pages_usable()
    calls = 4 if quick else 32
    modes = ("cold", "ordered", "cold_huge", "ordered_huge")[: 4 if huge else 2]
    for prefix, shape in GEOMETRIES.items():
        for dtype, batch, context in itertools.product(dtypes(), BATCHES, CONTEXTS):
            cell = decode_cell(batch, context, dtype, rounds, calls, cold_bytes, huge, shape)
            for n in thread_counts():
                for stat in ("best", "median"):
                    read = result["stream"][f"read_{n}t_gbs_{stat}"]
                    for mode in modes:
                        frac = cell[f"{mode}_{n}t"][f"gbs_{stat}"] / read
                        cell[f"{mode}_{n}t"][f"fraction_{stat}"] = round(frac, 3)
            name = f"{prefix}{dtype_name(dtype)}_b{batch}_c{context}"
            result["decode"][name] = cell
            print(cell_line(name, cell, result["threads"]), flush=True)
    result["load_avg_after"] = round(os.getloadavg()[0], 2)
    return result


def stream_line(result: dict[str, Any]) -> str:
    parts = []
    for n in result["threads"]:
        s = result["stream"]
        parts.append(f"{n}t {s[f'read_{n}t_gbs_best']} GB/s ({s[f'read_{n}t_gbs_median']})")
    return "stream read (best (median)): " + ", ".join(parts)


def cell_line(name: str, cell: dict[str, Any], threads: list[int]) -> str:
    parts = []
    for n in threads:
        c, o, h = cell[f"cold_{n}t"], cell[f"ordered_{n}t"], cell[f"hot_{n}t"]
        parts.append(
            f"{n}t cold {c['gbs_best']} GB/s ({c['gbs_median']}) = "
            f"{c['fraction_best']:.0%} ({c['fraction_median']:.0%}) of stream, "
            f"{c['us_min']} us/call; ordered {o['gbs_best']} GB/s = {o['fraction_best']:.0%}; "
            f"hot {h['gbs_best']} GB/s"
        )
        if f"cold_huge_{n}t" in cell:
            ch, oh = cell[f"cold_huge_{n}t"], cell[f"ordered_huge_{n}t"]
            parts[-1] += (
                f"; huge pages: cold {ch['gbs_best']} GB/s ({ch['gbs_median']}) = "
                f"{ch['fraction_best']:.0%} ({ch['fraction_median']:.0%}), "
                f"ordered {oh['gbs_best']} GB/s = {oh['fraction_best']:.0%}"
            )
    mib = cell["kv_bytes_per_call"] / 2**20
    return f"decode {name} ({mib:.2f} MiB K+V/call): " + "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes")
    args = parser.parse_args()
    print(json.dumps(measure(args.rounds, args.quick)))


if __name__ == "__main__":
    main()
