"""The CPU decode kernel on several threads (csrc/run_items.c's ``run_items``).

A call's work items, one per (sequence, KV head), are claimed one at a time by up to
``num_threads`` threads, in the kernel's own order (sequences sharing a first block
together, longest first); each item is computed whole by one thread, so the output must be
the same bits at every thread count and in any order of the batch. Here: that identity
(float32 and both bfloat16 variants, GQA, ragged batches, a zero-length context, shared
prefixes), against the reference too; the thread count the kernel reports (never more
than the items) and where it comes from (torch's, once per step); the refusals (a bad
``num_threads``, a bad block id with many threads: both before anything is written); that
a process importing torch and the kernel maps one libgomp (torch's when torch comes
first). The scheduling mutants these checks catch, and the build without OpenMP:
tests/test_cpu_kernel_threads_build.py.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from paged_engine.kernels import paged_decode_cpu
from paged_engine.kernels.paged_attention_ref import paged_decode_attention_ref
from paged_engine.kernels.paged_decode_cpu import (
    check_paged_decode_cpu,
    cpu_kernels_threaded,
    kernel_threads,
    paged_decode_attention_cpu,
)
from paged_engine.layers.attention import make_attention_metadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from tests.kernel_cases import Case, Tensors, assert_close, decode_case, make_tensors, ref_decode
from tests.test_cpu_kernel_bf16 import ONE_ROUNDING, VARIANTS, variant_param

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
THREADS = (1, 2, 3, 4)
# Ragged (longest-first order differs from index order), GQA, contexts around block edges,
# a zero-length context; 6 sequences x 2 KV heads = 12 items; and head_dim 20 (the generic
# copy, not a specialised one).
CASES = {
    "ragged-gqa": decode_case((37, 300, 1, 70, 0, 129), block_size=16, group=4, head_dim=64),
    "generic-dim": decode_case((90, 5, 33), block_size=8, group=3, head_dim=20, num_kv_heads=4),
}
KINDS = [pytest.param(None, id="float32"), *(variant_param(v) for v in VARIANTS)]


def materialise(case: Case, variant: str | None) -> Tensors:
    dtype = torch.float32 if variant is None else torch.bfloat16
    return make_tensors(replace(case, dtype=dtype), CPU)


def run(
    t: Tensors, variant: str | None, threads: int, isa: str | None = None
) -> tuple[torch.Tensor, int]:
    """The kernel's output (``out`` starts as NaN: an item left uncomputed shows) and the
    thread count it reports; ``isa``: the instruction-set level (None: the launcher's)."""
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    launch = check_paged_decode_cpu(
        *args, bf16_variant=variant or "auto", num_threads=threads, isa=isa or "auto"
    )
    out = torch.full_like(t.query, float("nan"), memory_format=torch.contiguous_format)
    return out, kernel_threads(launch, *args, t.scale, out)


def assert_matches_reference(out: torch.Tensor, t: Tensors, variant: str | None) -> None:
    if variant is None:
        assert_close(out, ref_decode(t))
    else:  # one rounding of the float32 answer over the bfloat16 inputs
        q, k, v = (x.float() for x in (t.query, t.k_cache, t.v_cache))
        want = paged_decode_attention_ref(q, k, v, t.block_tables, t.seq_lens, t.scale)
        torch.testing.assert_close(
            out.float(), want, atol=ONE_ROUNDING["atol"], rtol=ONE_ROUNDING["rtol"]
        )


def test_the_build_runs_items_in_parallel() -> None:
    """setup.py builds with OpenMP wherever the toolchain has it (all of ours): a build that
    silently dropped it must fail here, not quietly run one thread."""
    assert cpu_kernels_threaded()


@pytest.mark.parametrize("variant", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_the_same_bits_at_every_thread_count(name: str, variant: str | None) -> None:
    t = materialise(CASES[name], variant)
    items = len(CASES[name].seq_lens) * CASES[name].num_kv_heads
    one, ran = run(t, variant, 1)
    assert ran == 1
    assert_matches_reference(one, t, variant)
    for threads in THREADS[1:]:
        for _repeat in range(3):  # the claims interleave differently each time
            got, ran = run(t, variant, threads)
            assert ran == min(threads, items), f"asked for {threads}, ran {ran}"
            assert torch.equal(got, one), f"{threads} threads differ from 1 in some bit"


@pytest.mark.parametrize("isa", paged_decode_cpu.isa_levels())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_level_gives_the_same_bits_at_every_thread_count(
    isa: str, dtype: torch.dtype
) -> None:
    """Each instruction-set level's copies run through the same item driver."""
    t = make_tensors(replace(CASES["ragged-gqa"], dtype=dtype), CPU)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    variant = "portable" if dtype == torch.bfloat16 else "auto"
    outs = []
    for threads in (1, 3):
        launch = check_paged_decode_cpu(*args, bf16_variant=variant, num_threads=threads, isa=isa)
        out = torch.full_like(t.query, float("nan"))
        assert kernel_threads(launch, *args, t.scale, out) == threads
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert_matches_reference(outs[0], t, None if dtype == torch.float32 else variant)


def shared_prefix_batch(variant: str | None) -> Tensors:
    """Nine sequences over a shuffled pool of 8-token blocks: three prefixes of 2, 3 and 1
    blocks, each shared by two or three sequences (two of them share a block more), a
    sequence sharing nothing, one with no context; batch order interleaves the groups, as a
    scheduler hands them over. The kernel runs each group's members one after another
    (csrc/run_items.c's item_order)."""
    bs, gen = 8, torch.Generator().manual_seed(3)
    pool = torch.randperm(40, generator=gen).tolist()
    prefixes = [pool[0:2], pool[2:5], pool[5:6]]
    tails = [[pool[6]], [pool[7], pool[8]], [], [pool[9]], [pool[10]], [pool[11]]]
    rows = [
        prefixes[0] + tails[0],
        prefixes[1] + tails[1],
        [pool[12], pool[13]],  # shares nothing
        prefixes[2] + tails[2],
        prefixes[0] + [pool[6], pool[14]],  # the first row's prefix and its next block too
        [],  # no context
        prefixes[1] + tails[3],
        prefixes[2] + tails[4],
        prefixes[0] + tails[5],
    ]
    lens = [len(r) * bs - (3 if r else 0) for r in rows]
    width = max(len(r) for r in rows)
    dtype = torch.float32 if variant is None else torch.bfloat16
    heads, kv_heads, dim = 8, 4, 64  # the 29M model's: runs of kv heads (decode_run)
    k, v = torch.randn(2, 40, bs, kv_heads, dim, generator=gen).to(dtype)
    return Tensors(
        query=torch.randn(len(rows), heads, dim, generator=gen).to(dtype),
        k_cache=k,
        v_cache=v,
        block_tables=torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        scale=dim**-0.5,
    )


@pytest.mark.parametrize("variant", KINDS)
def test_a_batch_in_any_order_gives_each_sequence_the_same_bits(variant: str | None) -> None:
    """The kernel reorders a call's sequences (groups sharing a first block together):
    whatever order the batch comes in, every sequence gets its own output, the same bits,
    at every thread count, and the reference's values."""
    check_any_order(variant, None)


@pytest.mark.parametrize("isa", paged_decode_cpu.isa_levels())
def test_any_order_at_every_instruction_set_level(isa: str) -> None:
    """The same on each level's copies, the baseline's (no AVX2, no AVX-512) included:
    what a CPU without this one's instructions runs."""
    check_any_order(None, isa)
    check_any_order("portable", isa)


def check_any_order(variant: str | None, isa: str | None) -> None:
    t = shared_prefix_batch(variant)
    want, _ = run(t, variant, 1, isa)
    assert_matches_reference(want, t, variant)
    gen = torch.Generator().manual_seed(4)
    for perm in (torch.arange(8, -1, -1), torch.randperm(9, generator=gen)):
        shuffled = replace(
            t,
            query=t.query[perm].contiguous(),
            block_tables=t.block_tables[perm].contiguous(),
            seq_lens=t.seq_lens[perm].contiguous(),
        )
        for threads in (1, 3):
            got, _ = run(shuffled, variant, threads, isa)
            assert torch.equal(got, want[perm]), f"order {perm.tolist()}, {threads} threads"


def test_fewer_items_than_threads_use_fewer_threads() -> None:
    for seqs, kv_heads, want in [((40,), 1, 1), ((40,), 2, 2), ((40, 7), 1, 2), ((9, 40), 2, 4)]:
        t = materialise(decode_case(seqs, num_kv_heads=kv_heads), None)
        out, ran = run(t, None, 8)
        assert ran == want, (seqs, kv_heads, ran)
        assert_matches_reference(out, t, None)


def test_the_thread_count_comes_from_torch_at_check_time() -> None:
    t = materialise(CASES["ragged-gqa"], None)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        launch = check_paged_decode_cpu(*args)
        torch.set_num_threads(1)  # after the check: this launch keeps 3
        assert launch.num_threads == 3
        out = torch.empty_like(t.query)
        assert kernel_threads(launch, *args, t.scale, out) == 3
        assert check_paged_decode_cpu(*args).num_threads == 1
    finally:
        torch.set_num_threads(before)


def test_the_backend_takes_the_thread_count_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's layers all run at the count torch had when the step's first layer was
    checked; the next step (a new block table) reads it afresh."""
    seen: list[int] = []
    real = paged_decode_cpu.kernel_threads

    def recording(launch: paged_decode_cpu.DecodeLaunch, *args: Any) -> int:
        seen.append(launch.num_threads)
        return real(launch, *args)

    monkeypatch.setattr(paged_decode_cpu, "kernel_threads", recording)
    case = decode_case((37, 9, 16), block_size=8)
    t = materialise(case, None)
    tables = [
        [b for b in row if b >= 0][: -(-n // 8)]
        for row, n in zip(t.block_tables.tolist(), case.seq_lens, strict=True)
    ]
    backend = CpuAttentionBackend(8, torch.float32)
    before = torch.get_num_threads()
    try:
        for step, threads in enumerate((3, 2)):
            torch.set_num_threads(threads)
            meta = make_attention_metadata([1, 1, 1], list(case.seq_lens), tables, 8)
            for layer in range(3):
                if layer == 1:
                    torch.set_num_threads(1)  # mid-step: this step keeps its count
                q = t.query
                assert_close(
                    backend.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale), ref_decode(t)
                )
            assert seen[3 * step :] == [threads] * 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
def test_a_bad_thread_count_is_refused_and_out_left_alone(bad: object) -> None:
    t = materialise(CASES["ragged-gqa"], None)
    out = torch.full_like(t.query, 7.0)
    with pytest.raises(ValueError, match="num_threads must be an int >= 1"):
        paged_decode_attention_cpu(
            t.query,
            t.k_cache,
            t.v_cache,
            t.block_tables,
            t.seq_lens,
            t.scale,
            out,
            num_threads=bad,  # type: ignore[arg-type]
        )
    assert bool((out == 7.0).all())


def test_the_c_entry_refuses_a_bad_thread_count_before_writing() -> None:
    """The C entry point checks it too (the launcher is not its only caller)."""
    t = materialise(CASES["ragged-gqa"], None)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    launch = replace(check_paged_decode_cpu(*args, num_threads=2), num_threads=0)
    out = torch.full_like(t.query, 7.0)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        kernel_threads(launch, *args, t.scale, out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("variant", KINDS)
def test_block_ids_are_checked_before_any_thread_reads(variant: str | None) -> None:
    t = materialise(CASES["ragged-gqa"], variant)
    t.block_tables[5, 3] = 10**6  # the last sequence's fourth block
    out = torch.full_like(t.query, 7.0)
    with pytest.raises(ValueError, match="sequence 5 reads block table entry 3"):
        paged_decode_attention_cpu(
            t.query,
            t.k_cache,
            t.v_cache,
            t.block_tables,
            t.seq_lens,
            t.scale,
            out,
            bf16_variant=variant or "auto",
            num_threads=4,
        )
    assert bool((out == 7.0).all()), "a refused launch wrote to out"


MAPS_CHILD = r"""
import sys
first, second = sys.argv[1:3]
__import__(first)
__import__(second)
import torch
from paged_engine.kernels.paged_decode_cpu import paged_decode_attention_cpu

q = torch.randn(4, 2, 16)
k = torch.randn(4, 16, 1, 16)
tables = torch.arange(4, dtype=torch.int32).view(4, 1)
lens = torch.full((4,), 16, dtype=torch.int32)
paged_decode_attention_cpu(q, k, k, tables, lens, 0.25, num_threads=2)  # a parallel region
with open("/proc/self/maps") as f:
    paths = {line.split()[-1] for line in f if "libgomp" in line}
print("\n".join(sorted(paths)))
"""


@pytest.mark.parametrize(
    "order",
    [("torch", "paged_engine._cpu_kernels"), ("paged_engine._cpu_kernels", "torch")],
    ids=["torch-first", "kernel-first"],
)
def test_one_libgomp_is_mapped(order: tuple[str, str]) -> None:
    """torch's wheel bundles its own libgomp.so.1 and the extension needs libgomp.so.1: the
    dynamic loader matches the name against what is already loaded, so whichever comes
    first serves both (torch's, when torch is imported first, as the launcher does)."""
    run = subprocess.run(
        [sys.executable, "-c", MAPS_CHILD, *order],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    paths = run.stdout.split()
    assert len(paths) == 1, f"more than one OpenMP runtime mapped: {paths}"
    if order[0] == "torch":
        assert Path(paths[0]).parent == Path(torch.__file__).parent / "lib", paths
