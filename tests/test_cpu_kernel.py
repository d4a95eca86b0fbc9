"""The compiled CPU decode kernel (csrc/paged_decode_cpu.c) and the "cpu" backend, float32
(bfloat16: tests/test_cpu_kernel_bf16.py).

The kernel against ``paged_decode_attention_ref`` on the layouts tests/kernel_cases.py holds
for the Triton kernels (NaN outside every context, shared prefix blocks, lengths off block
edges, GQA, strided queries) and on drawn ones, every head-dim specialisation included;
its refusals (each leaves ``out`` untouched); its mutants; and the backend's routing. Every
instruction-set level this CPU runs (``isa_levels``: the baseline copy and, on x86-64, the
x86-64-v3/v4 ones) is held to the reference, whichever the launcher would pick. The
attention machine (tests/test_attention_machine.py) and tests/test_e2e.py run it through
the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_engine import platform
from paged_engine.kernels import paged_decode_cpu
from paged_engine.kernels.cpu_library import ISA_CODES
from paged_engine.kernels.paged_decode_cpu import (
    check_paged_decode_cpu,
    cpu_kernels_problem,
    isa_levels,
    kernel_threads,
    paged_decode_attention_cpu,
)
from paged_engine.layers.attention import (
    TorchAttentionBackend,
    get_attention_backend,
    make_attention_metadata,
)
from paged_engine.layers.attention import cpu as cpu_module
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from tests import fused_mutants, kernel_mutants
from tests.kernel_cases import (
    DECODE_CASES,
    TOL,
    Case,
    assert_close,
    cpu_id,
    decode_case,
    make_tensors,
    ref_decode,
    run_decode,
)
from tests.kernel_mutants import (
    AMX_MUTANTS,
    AVX512_BF16_MUTANTS,
    BF16_MUTANTS,
    COMPILE_MUTANTS,
    CPU_MUTANTS,
    MUTANTS,
    PREFILL_MUTANTS,
    SHARE_MUTANTS,
    STORE_MUTANTS,
    THREAD_MUTANTS,
    CpuKernelMutant,
    KernelMutant,
)
from tests.patch_mutants import StaleMutant

CPU = torch.device("cpu")
LEVELS = isa_levels()
each_level = pytest.mark.parametrize("isa", LEVELS)


def test_the_extension_is_built() -> None:
    """The package's install builds it on every machine with a C compiler (all of ours):
    a silently skipped build must fail here, not quietly move decode back to torch."""
    assert cpu_kernels_problem() is None, cpu_kernels_problem()


@each_level
@pytest.mark.parametrize("case", DECODE_CASES, ids=cpu_id)
def test_matches_ref_on_the_triton_kernels_layouts(case: Case, isa: str) -> None:
    t = make_tensors(case, CPU)
    assert_close(run_decode(t, paged_decode_attention_cpu, isa=isa), ref_decode(t))


@each_level
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 24, 32, 64, 128, 256])
def test_every_head_dim_specialisation(head_dim: int, group: int, isa: str) -> None:
    # 16, 32, 64 and 128 have their own compiled copies, and within them groups of 1, 2, 3
    # and 4; 24 and 256 take the generic ones (and so would a group of 5).
    t = make_tensors(decode_case((45, 3, 16, 17), head_dim=head_dim, group=group), CPU)
    assert_close(run_decode(t, paged_decode_attention_cpu, isa=isa), ref_decode(t))


@each_level
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "group"),
    [(4, 64, 2), (2, 64, 2), (3, 64, 3), (4, 128, 4), (2, 64, 1), (3, 128, 1), (8, 128, 2)],
)
def test_a_run_of_kv_heads_gives_each_heads_own_bits(
    kv_heads: int, head_dim: int, group: int, dtype: torch.dtype, isa: str
) -> None:
    # With head_dim 64 or 128 and groups of 2 to 4, one item takes a run of 2, 3 or 4 kv
    # heads (csrc's run_span; 3 of 64 with groups of 3 is SmolLM2-135M's geometry); a call
    # over one kv head runs it alone. Each head's output must be the same bits either way:
    # the run changes the order memory is read in, never the arithmetic. Groups of 1 take no
    # runs: their run copy, as GCC vectorised it, differed in the last bit.
    case = decode_case((45, 3, 16, 17, 70), head_dim=head_dim, group=group, num_kv_heads=kv_heads)
    t = make_tensors(replace(case, dtype=dtype), CPU)
    whole = run_decode(t, paged_decode_attention_cpu, isa=isa)
    for kh in range(kv_heads):
        heads = slice(group * kh, group * kh + group)
        alone = paged_decode_attention_cpu(
            t.query[:, heads].contiguous(),
            t.k_cache[:, :, kh : kh + 1].contiguous(),
            t.v_cache[:, :, kh : kh + 1].contiguous(),
            t.block_tables,
            t.seq_lens,
            t.scale,
            isa=isa,
        )
        assert torch.equal(alone, whole[:, heads]), f"kv head {kh} differs"


@st.composite
def cpu_cases(draw: st.DrawFn) -> Case:
    batch = draw(st.integers(1, 5))
    return decode_case(
        tuple(draw(st.lists(st.integers(1, 140), min_size=batch, max_size=batch))),
        block_size=draw(st.sampled_from([1, 3, 8, 16, 64])),
        num_kv_heads=draw(st.sampled_from([1, 2, 3, 4])),
        group=draw(st.sampled_from([1, 2, 3, 8, 16])),
        head_dim=draw(st.sampled_from([16, 20, 32, 64])),
        seed=draw(st.integers(0, 2**16)),
        strided_query=draw(st.booleans()),
        share_blocks=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(cpu_cases(), st.sampled_from(LEVELS))
def test_matches_ref_on_drawn_layouts(case: Case, isa: str) -> None:
    t = make_tensors(case, CPU)
    assert_close(run_decode(t, paged_decode_attention_cpu, isa=isa), ref_decode(t))


# ---- instruction-set levels ----------------------------------------------------------------


def test_auto_takes_the_best_level_the_platform_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_tensors(decode_case((5, 20)), CPU)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    assert LEVELS[-1] == "baseline"
    assert check_paged_decode_cpu(*args).isa == ISA_CODES[LEVELS[0]]
    # A platform reporting no flags (an older CPU, forced): the baseline copy, same answer.
    bare = replace(platform.cpu_info(), flags=frozenset())
    monkeypatch.setattr(platform, "cpu_info", lambda: bare)
    assert isa_levels() == ("baseline",)
    launch = check_paged_decode_cpu(*args)
    assert launch.isa == ISA_CODES["baseline"]
    out = torch.empty_like(t.query)
    kernel_threads(launch, *args, t.scale, out)
    assert_close(out, ref_decode(t))
    with pytest.raises(ValueError, match="isa 'x86-64-v3' is not available here"):
        check_paged_decode_cpu(*args, isa="x86-64-v3")


def test_a_level_that_does_not_run_here_is_refused_before_writing() -> None:
    t = make_tensors(decode_case((5, 20)), CPU)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    out = torch.full_like(t.query, 7.0)
    with pytest.raises(ValueError, match="isa 'x86-64-v9' is not available here"):
        paged_decode_attention_cpu(*args, t.scale, out, isa="x86-64-v9")
    # The C entry point refuses a level too (a bad code, or one this build or CPU lacks:
    # the launcher never passes one), before reading anything.
    assert paged_decode_cpu._COMPILED is not None
    module = paged_decode_cpu._COMPILED.module
    missing = [c for n, c in ISA_CODES.items() if n not in module.isa_levels()]
    for code in (-1, 3, *missing):
        launch = replace(check_paged_decode_cpu(*args), isa=code)
        with pytest.raises(ValueError, match=f"instruction-set level {code} is not built"):
            kernel_threads(launch, *args, t.scale, out)
    assert bool((out == 7.0).all()), "a refused launch wrote to out"


def test_zero_length_context_gives_zeros_and_fills_out() -> None:
    t = make_tensors(decode_case((5, 20)), CPU)
    t.seq_lens[0] = 0
    out = torch.full_like(t.query, float("nan"))
    assert run_decode(t, paged_decode_attention_cpu, out=out) is out
    assert not out[0].any()
    assert_close(out, ref_decode(t))


def _args() -> dict[str, Any]:
    t = make_tensors(decode_case((5, 20)), CPU)
    return {
        "query": t.query,
        "k_cache": t.k_cache,
        "v_cache": t.v_cache,
        "block_tables": t.block_tables,
        "seq_lens": t.seq_lens,
        "scale": t.scale,
    }


def _set_table(a: dict[str, Any], row: int, col: int, value: int) -> None:
    a["block_tables"] = a["block_tables"].clone()
    a["block_tables"][row, col] = value


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "float16",
        lambda a: a.update({k: a[k].half() for k in ("query", "k_cache", "v_cache")}),
        "only float32 and bfloat16",
    ),
    ("block past the pool", lambda a: _set_table(a, 1, 0, 10**6), "sequence 1 reads block table"),
    ("negative block", lambda a: _set_table(a, 0, 0, -1), "sequence 0 reads block table entry 0"),
    ("length past the table", lambda a: a["seq_lens"].__setitem__(1, 10**4), "beyond its block"),
    # the block count of a length near 2**31 must not overflow into a passing check
    ("length 2**31 - 1", lambda a: a["seq_lens"].__setitem__(1, 2**31 - 1), "beyond its block"),
    ("negated view", lambda a: a.update(query=a["query"]._neg_view()), "negated"),
    ("table strided", lambda a: a.update(block_tables=a["block_tables"][:, ::2]), "contiguous"),
    ("query dtype", lambda a: a.update(query=a["query"].double()), "query dtype"),
    ("seq_lens int64", lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be"),
    (
        "group of 17",
        lambda a: a.update(query=a["query"].repeat(1, 17, 1)[:, :34]),
        "at most 16 query heads",
    ),
]


@pytest.mark.parametrize(("mutate", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_refuses_bad_arguments_and_leaves_out_alone(
    mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    args = _args()
    mutate(args)
    out = torch.full(args["query"].shape, 7.0, dtype=args["query"].dtype)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_cpu(**args, out=out)
    assert bool((out == 7.0).all()), "a refused launch wrote to out"


@pytest.mark.parametrize("mutant", CPU_MUTANTS, ids=[m.name for m in CPU_MUTANTS])
def test_each_mutant_disagrees_with_ref_on_some_layout(mutant: CpuKernelMutant) -> None:
    caught = [
        cpu_id(case)
        for case in DECODE_CASES
        if not torch.allclose(
            run_decode(t := make_tensors(case, CPU), mutant.launch),
            ref_decode(t),
            **TOL[case.dtype],
        )
    ]
    assert caught, f"no layout catches mutant {mutant.name} ({mutant.bug})"


# ---- the mutants' patch files (tests/kernel_mutants/, tests/fused_mutants/; the applier:
# tests/test_patch_mutants.py) ---------------------------------------------------------------


def test_every_patch_file_is_a_listed_mutant_and_back() -> None:
    """A patch file no mutant names would never run; a mutant without one fails alone."""
    cpu = (*CPU_MUTANTS, *BF16_MUTANTS, *AVX512_BF16_MUTANTS, *AMX_MUTANTS, *STORE_MUTANTS)
    cpu = (*cpu, *THREAD_MUTANTS, *SHARE_MUTANTS)
    names = [m.name for m in (*MUTANTS, *PREFILL_MUTANTS, *COMPILE_MUTANTS, *cpu)]
    assert len(names) == len(set(names))
    assert set(names) == {p.stem for p in kernel_mutants.PATCH_DIR.glob("*.patch")}
    fused = [m.name for m in fused_mutants.MUTANTS]
    assert len(fused) == len(set(fused))
    assert set(fused) == {p.stem for p in fused_mutants.PATCH_DIR.glob("*.patch")}


def test_a_mutant_is_built_when_used_not_when_listed() -> None:
    """Collecting a test file never reads a patch: a missing one fails where it is used."""
    triton = KernelMutant("no_such_mutant", "decode", "listed, never written")
    c = CpuKernelMutant("no_such_mutant", "listed, never written")
    missing = r"mutant no_such_mutant: .*no_such_mutant\.patch: no such patch file"
    with pytest.raises(StaleMutant, match=missing):
        triton.kernel()
    with pytest.raises(StaleMutant, match=missing):
        c.module()


# ---- the backend ----------------------------------------------------------------------------


def _step(seq_lens: list[int], query_lens: list[int]) -> tuple[Any, ...]:
    case = Case(seq_lens=tuple(seq_lens), query_lens=tuple(query_lens), block_size=8)
    t = make_tensors(case, CPU)
    tables = [[b for b in row if b >= 0] for row in t.block_tables.tolist()]
    tables = [row[: -(-s // 8)] for row, s in zip(tables, seq_lens, strict=True)]
    meta = make_attention_metadata(query_lens, seq_lens, tables, 8)
    return t, meta


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [([37, 9, 16], [1, 1, 1]), ([37, 9, 16], [5, 9, 1])],
    ids=["decode", "prefill"],
)
def test_backend_agrees_with_the_torch_backend(
    seq_lens: list[int], query_lens: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    t, meta = _step(seq_lens, query_lens)
    calls: list[int] = []
    cpu = CpuAttentionBackend(8, torch.float32)
    kernel = cpu_module.run_paged_decode_cpu

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cpu_module, "run_paged_decode_cpu", counting)
    torch_backend = TorchAttentionBackend(8, torch.float32)
    q = t.query
    got = cpu.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale)
    want = torch_backend.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale)
    assert_close(got, want)
    assert len(calls) == (1 if max(query_lens) == 1 else 0)  # only decode takes the kernel


def test_head_dims_the_kernel_refuses_go_to_the_torch_path() -> None:
    # head_dim 8: below what the launchers accept, so decode falls back, it does not fail
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 4, 1, 8, generator=gen)
    v_cache = torch.randn(6, 4, 1, 8, generator=gen)
    meta = make_attention_metadata([1, 1], [7, 3], [[4, 1], [0]], 4)
    q = torch.randn(2, 2, 8, generator=gen)
    cpu = CpuAttentionBackend(4, torch.float32)
    want = TorchAttentionBackend(4, torch.float32).attend(q, q, q, k_cache, v_cache, meta, 0.3)
    assert_close(cpu.attend(q, q, q, k_cache, v_cache, meta, 0.3), want)


def test_auto_picks_the_kernel_for_float32_and_bfloat16_on_cpu_and_torch_otherwise() -> None:
    assert get_attention_backend("auto", CPU, 16, torch.float32).name == "cpu"
    assert get_attention_backend("auto", CPU, 16, torch.bfloat16).name == "cpu"
    assert get_attention_backend("auto", CPU, 16, torch.float16).name == "torch"


def test_cpu_backend_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="bfloat16 or float32 only"):
        get_attention_backend("cpu", CPU, 16, torch.float16)
    with pytest.raises(ValueError, match="bfloat16 or float32 only"):
        CpuAttentionBackend(16, torch.float16)


def test_a_missing_extension_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_decode_cpu, "_COMPILED", None)
    monkeypatch.setattr(paged_decode_cpu, "_PROBLEM", "not built (test)")
    with pytest.raises(RuntimeError, match="not built"):
        paged_decode_attention_cpu(**_args())
    # "auto" then falls back to the torch backend instead of failing.
    assert get_attention_backend("auto", CPU, 16, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="not built"):
        get_attention_backend("cpu", CPU, 16, torch.float32)
