"""The compiled CPU decode kernel in bfloat16: both variants (the portable one at every
instruction-set level this CPU runs), their refusals, their mutants, and the "cpu"
backend's once-per-step checks. The AVX512-BF16 variant's tests skip where torch's own
probe (``torch.cpu.get_capabilities``) says the CPU lacks what it executes.

The precision contract (csrc/paged_decode_head.h): q and K/V are read as bfloat16, every
product, the softmax and the accumulator are float32, and the output is rounded once. So the
output must lie within half a bfloat16 ulp (at most 2**-8 relative) of the float32
reference computed over the same bfloat16 inputs, not merely within the 2e-2 that kernels
rounding P to bfloat16 get (tests/kernel_cases.py's ``TOL``). That tight bound is what lets
the precision mutants (tests/kernel_mutants.py's ``BF16_MUTANTS``) be caught.
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
from paged_engine.kernels.paged_attention_ref import paged_decode_attention_ref
from paged_engine.kernels.paged_decode_cpu import (
    bf16_variants,
    check_paged_decode_cpu,
    isa_levels,
    paged_decode_attention_cpu,
)
from paged_engine.kernels.paged_decode_cpu_ref import paged_decode_cpu_ref
from paged_engine.layers.attention import cpu as cpu_module
from paged_engine.layers.attention import make_attention_metadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from tests.kernel_cases import DECODE_CASES, Case, Tensors, cpu_id, decode_case, make_tensors
from tests.kernel_mutants import (
    AMX_MUTANTS,
    AVX512_BF16_MUTANTS,
    BF16_MUTANTS,
    CpuKernelMutant,
    build_c_module,
    decode_module_bound,
)

CPU = torch.device("cpu")
BF16 = torch.bfloat16
ONE_ROUNDING = {"atol": 1e-5, "rtol": 2**-8 + 1e-5}
"""Half a bfloat16 ulp is at most 2**-8 of the value; atol covers float32 summation order."""
VARIANTS = ("portable", "avx512bf16", "amx")


# What torch's probe (the cpuinfo library: CPUID and the OS's state) says, not ours.
_CAPS = torch.cpu.get_capabilities()
HAS_AVX512_BF16 = all(bool(_CAPS.get(f)) for f in ("avx512_bf16", "avx512_bw", "avx512_vl"))
NO_AVX512_BF16 = (
    "torch.cpu.get_capabilities() has no avx512_bf16, avx512_bw and avx512_vl here "
    f"(capability {torch.backends.cpu.get_cpu_capability()})"
)
HAS_AMX = HAS_AVX512_BF16 and all(bool(_CAPS.get(f)) for f in ("amx_bf16", "amx_tile"))
NO_AMX = "torch.cpu.get_capabilities() has no amx_bf16 and amx_tile (or no AVX512-BF16) here"
AMX_CASES = [
    *(c for c in DECODE_CASES if c.block_size % 16 == 0 and c.head_dim % 64 == 0),
    # one kv head per item (a group of 1; 8 kv heads of 128), each its own copy of the code
    decode_case((37, 1, 70), block_size=32, group=1, num_kv_heads=2, head_dim=64),
    decode_case((40, 17), block_size=16, group=4, num_kv_heads=8, head_dim=128),
]
"""Layouts the amx variant scores on tiles (DECODE_CASES' others take its avx512 copy)."""


def variant_param(name: str) -> Any:
    marks = []
    if name == "avx512bf16" and not HAS_AVX512_BF16:
        marks.append(pytest.mark.skip(reason=NO_AVX512_BF16))
    if name == "amx" and not HAS_AMX:
        marks.append(pytest.mark.skip(reason=NO_AMX))
    return pytest.param(name, marks=marks, id=name)


variants = pytest.mark.parametrize("variant", [variant_param(v) for v in VARIANTS])
LEVELS = isa_levels()
each_level = pytest.mark.parametrize("isa", LEVELS)


def bf16(case: Case) -> Tensors:
    return make_tensors(replace(case, dtype=BF16), CPU)


def exact(t: Tensors) -> torch.Tensor:
    """The float32 reference over the bfloat16 inputs, not rounded."""
    up = [x.float() for x in (t.query, t.k_cache, t.v_cache)]
    return paged_decode_attention_ref(*up, t.block_tables, t.seq_lens, t.scale)


def launch(
    t: Tensors,
    variant: str,
    fn: Callable[..., torch.Tensor] | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    fn = fn or paged_decode_attention_cpu
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale)
    return fn(*args, bf16_variant=variant, isa=isa)


def assert_one_rounding(out: torch.Tensor, t: Tensors) -> None:
    assert out.dtype == BF16 and out.shape == t.query.shape
    assert not out.isnan().any(), "NaN in output: the kernel read an unused (NaN) slot"
    torch.testing.assert_close(out.float(), exact(t), **ONE_ROUNDING)


def test_the_variants_follow_the_cpu() -> None:
    """AMX and AVX512-BF16 are offered exactly where torch's probe says the CPU has them,
    best first; the portable variant is always there, last."""
    expected = ("amx",) * HAS_AMX + ("avx512bf16",) * HAS_AVX512_BF16 + ("portable",)
    assert bf16_variants() == expected


def test_auto_follows_the_platform_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" takes amx, else avx512bf16, where ``bf16_variants`` has it and the head dim
    is 32 or more, else portable; a platform that reports no AMX keeps avx512bf16, and one
    that reports no AVX512-BF16 (forced here, so CPUs that have them test the fallbacks
    too) leaves the portable variant only."""
    t = bf16(DECODE_CASES[1])
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens)
    code = paged_decode_cpu.BF16_VARIANTS
    wide = "amx" if HAS_AMX else "avx512bf16" if HAS_AVX512_BF16 else "portable"
    best = wide if t.query.shape[2] >= 32 else "portable"
    assert check_paged_decode_cpu(*args).bf16_variant == code[best]
    if HAS_AMX:  # a platform without AMX's flags keeps the AVX512 copy
        no_amx = replace(platform.cpu_info(), flags=platform.cpu_info().flags - {"amx_tile"})
        with monkeypatch.context() as m:
            m.setattr(platform, "cpu_info", lambda: no_amx)
            assert bf16_variants() == ("avx512bf16", "portable")
            assert check_paged_decode_cpu(*args).bf16_variant == code["avx512bf16"]
    flags = platform.cpu_info().flags - {"avx512_bf16"}
    without = replace(platform.cpu_info(), flags=flags)
    monkeypatch.setattr(platform, "cpu_info", lambda: without)
    assert bf16_variants() == ("portable",)
    assert check_paged_decode_cpu(*args).bf16_variant == code["portable"]
    assert_one_rounding(launch(t, "auto"), t)
    with pytest.raises(ValueError, match="'avx512bf16' is not available here"):
        launch(t, "avx512bf16")


@variants
@pytest.mark.parametrize("case", DECODE_CASES, ids=cpu_id)
def test_matches_ref_on_the_triton_kernels_layouts(case: Case, variant: str) -> None:
    t = bf16(case)
    assert_one_rounding(launch(t, variant), t)


@each_level
@pytest.mark.parametrize("case", DECODE_CASES, ids=cpu_id)
def test_the_portable_variant_at_every_level(case: Case, isa: str) -> None:
    t = bf16(case)
    assert_one_rounding(launch(t, "portable", isa=isa), t)


@variants
@pytest.mark.parametrize("head_dim", [16, 20, 24, 32, 48, 64, 128, 256])
def test_every_head_dim(head_dim: int, variant: str) -> None:
    # 16/32/64/128 have their own copies; the others the generic one, and in the AVX512
    # variant a masked tail (20, 48: not a multiple of 32).
    t = bf16(decode_case((45, 3, 16, 17), head_dim=head_dim, group=3))
    assert_one_rounding(launch(t, variant), t)
    if variant == "portable":
        for isa in LEVELS:
            assert_one_rounding(launch(t, variant, isa=isa), t)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_matches_ref_on_drawn_layouts(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 5))
    case = decode_case(
        tuple(data.draw(st.lists(st.integers(1, 140), min_size=batch, max_size=batch))),
        block_size=data.draw(st.sampled_from([1, 3, 8, 16, 64])),
        num_kv_heads=data.draw(st.sampled_from([1, 2, 4])),
        group=data.draw(st.sampled_from([1, 2, 3, 8, 16])),
        head_dim=data.draw(st.sampled_from([16, 20, 32, 64])),
        seed=data.draw(st.integers(0, 2**16)),
        strided_query=data.draw(st.booleans()),
        share_blocks=data.draw(st.booleans()),
    )
    t = bf16(case)
    variant = data.draw(st.sampled_from(bf16_variants()))
    isa = data.draw(st.sampled_from(LEVELS)) if variant == "portable" else "auto"
    assert_one_rounding(launch(t, variant, isa=isa), t)


def test_large_scores_and_a_zero_length_context() -> None:
    t = bf16(decode_case((5, 20, 33)))
    t.query.mul_(40)  # scores in the hundreds: the online softmax must rescale, not overflow
    t.seq_lens[0] = 0
    for variant in bf16_variants():
        out = launch(t, variant)
        assert not out[0].any()
        assert_one_rounding(out, t)


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("float32 caches", lambda a: a.update(k_cache=a["k_cache"].float()), "dtype"),
    ("float32 query", lambda a: a.update(query=a["query"].float()), "query dtype"),
    ("unknown variant", lambda a: a.update(bf16_variant="sse9"), "not available"),
    (
        "variant for float32",
        lambda a: (
            a.update({k: a[k].float() for k in ("query", "k_cache", "v_cache")})
            or a.update(bf16_variant="portable")
        ),
        "bfloat16 only",
    ),
    ("out float32", lambda a: a.update(out=torch.full(a["query"].shape, 7.0)), "out must be"),
]


@pytest.mark.parametrize(("mutate", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_refuses_bad_arguments_and_leaves_out_alone(
    mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    t = bf16(decode_case((5, 20)))
    args: dict[str, Any] = {
        "query": t.query,
        "k_cache": t.k_cache,
        "v_cache": t.v_cache,
        "block_tables": t.block_tables,
        "seq_lens": t.seq_lens,
        "scale": t.scale,
    }
    mutate(args)
    out = args.pop("out", None)
    if out is None:
        out = torch.full(args["query"].shape, 7.0, dtype=args["query"].dtype)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_cpu(**args, out=out)
    assert bool((out == 7.0).all()), "a refused launch wrote to out"


# ---- the precision mutants ------------------------------------------------------------------


@pytest.mark.parametrize("mutant", BF16_MUTANTS, ids=[m.name for m in BF16_MUTANTS])
def test_each_precision_mutant_is_caught_in_bf16_and_harmless_in_fp32(
    mutant: CpuKernelMutant,
) -> None:
    for variant in bf16_variants():
        caught = []
        for case in DECODE_CASES:
            t = bf16(case)
            got = launch(t, variant, mutant.launch).float()
            if not torch.allclose(got, exact(t), **ONE_ROUNDING):
                caught.append(cpu_id(case))
        assert caught, f"no layout catches {mutant.name} ({mutant.bug}) in {variant}"
    # In float32 the planted rounding is the identity: the bug is bfloat16's alone.
    t = make_tensors(DECODE_CASES[0], CPU)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale)
    assert torch.equal(mutant.launch(*args), paged_decode_attention_cpu(*args))


def assert_caught_in(mutant: CpuKernelMutant, variant: str, cases: list[Case], spared: str) -> None:
    """Some layout of ``cases`` puts ``mutant``'s ``variant`` outside the one-rounding bound,
    and the mutant's build leaves the ``spared`` variant's bits as they are."""
    caught = []
    for case in cases:
        t = bf16(case)
        if not torch.allclose(launch(t, variant, mutant.launch).float(), exact(t), **ONE_ROUNDING):
            caught.append(cpu_id(case))
    assert caught, f"no layout catches {mutant.name} ({mutant.bug})"
    t = bf16(cases[0])
    assert torch.equal(launch(t, spared, mutant.launch), launch(t, spared))


@pytest.mark.skipif(not HAS_AVX512_BF16, reason=NO_AVX512_BF16)
@pytest.mark.parametrize("mutant", AVX512_BF16_MUTANTS, ids=[m.name for m in AVX512_BF16_MUTANTS])
def test_each_avx512_mutant_is_caught_there_and_leaves_the_portable_copy_alone(
    mutant: CpuKernelMutant,
) -> None:
    assert_caught_in(mutant, "avx512bf16", DECODE_CASES, spared="portable")


@pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)
@pytest.mark.parametrize("case", AMX_CASES, ids=cpu_id)
def test_the_amx_variant_on_its_tile_layouts(case: Case) -> None:
    assert_one_rounding(launch(bf16(case), "amx"), bf16(case))


@pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)
def test_the_amx_variant_is_the_avx512_copy_where_tiles_do_not_apply() -> None:
    # head dims not a multiple of 64 or blocks not of a multiple of 16 tokens: the same call
    others = [c for c in DECODE_CASES if c not in AMX_CASES]
    others.append(decode_case((37, 1, 70), block_size=8, group=2, num_kv_heads=4, head_dim=64))
    assert AMX_CASES and others
    for case in others:
        t = bf16(case)
        assert torch.equal(launch(t, "amx"), launch(t, "avx512bf16")), cpu_id(case)


@pytest.mark.skipif(not HAS_AMX, reason=NO_AMX)
@pytest.mark.parametrize("mutant", AMX_MUTANTS, ids=[m.name for m in AMX_MUTANTS])
def test_each_amx_mutant_is_caught_there_and_leaves_the_avx512_copy_alone(
    mutant: CpuKernelMutant,
) -> None:
    assert_caught_in(mutant, "amx", AMX_CASES, spared="avx512bf16")


# ---- the backend: bfloat16 decode, checks once per step --------------------------------------


def _step(case: Case) -> tuple[Tensors, Any]:
    t = bf16(case)
    bs = case.block_size
    tables = [
        [b for b in row if b >= 0][: -(-s // bs)]
        for row, s in zip(t.block_tables.tolist(), case.seq_lens, strict=True)
    ]
    meta = make_attention_metadata(list(case.query_lens), list(case.seq_lens), tables, bs)
    return t, meta


def test_backend_decodes_bf16_on_the_kernel_checking_once_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks: list[int] = []
    real_check = cpu_module.check_paged_decode_cpu

    def counting_check(*args: Any, **kwargs: Any) -> Any:
        checks.append(1)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(cpu_module, "check_paged_decode_cpu", counting_check)
    backend = CpuAttentionBackend(8, BF16)
    case = decode_case((37, 9, 16), block_size=8)
    for step in range(2):
        t, meta = _step(replace(case, seed=step))
        q = t.query
        for _layer in range(4):
            out = backend.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale)
            assert_one_rounding(out, t)
        assert len(checks) == step + 1, "the launcher's checks ran more than once in a step"
    # Another layout in the same step is checked afresh, and a bad one refused.
    wide = torch.cat([q, q], dim=1)[:, : q.shape[1]]  # a strided query
    assert_one_rounding(backend.attend(wide, q, q, t.k_cache, t.v_cache, meta, t.scale), t)
    assert len(checks) == 3
    with pytest.raises(ValueError, match="resolve negated"):
        backend.attend(q._neg_view(), q, q, t.k_cache, t.v_cache, meta, t.scale)
    assert len(checks) == 4


def test_backend_still_checks_block_ids_on_every_call() -> None:
    """The per-step memo skips only layout checks: a block id outside the pool in a later
    call of the same step is refused by the kernel's own check, before any read."""
    backend = CpuAttentionBackend(8, BF16)
    t, meta = _step(decode_case((37, 9, 16), block_size=8))
    q = t.query
    backend.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale)
    meta.block_tables[1, 0] = 10**6
    with pytest.raises(ValueError, match="outside the pool"):
        backend.attend(q, q, q, t.k_cache, t.v_cache, meta, t.scale)


def test_backend_refuses_a_variant_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="bf16_variant 'sse9'"):
        CpuAttentionBackend(8, BF16, bf16_variant="sse9")
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        CpuAttentionBackend(8, torch.float32, bf16_variant="portable")


# ---- the kernel's algorithm in torch (paged_decode_cpu_ref) ---------------------------------


@pytest.mark.parametrize("case", [*DECODE_CASES, decode_case((100, 9), block_size=64)], ids=cpu_id)
def test_the_algorithm_reference_agrees_with_both(case: Case) -> None:
    """The readable statement of the kernel's algorithm (chunked block walk, online softmax)
    gives the plain reference's answer, and the kernel gives its answer, in float32 and
    in bfloat16 (to one rounding)."""
    t32 = make_tensors(case, CPU)
    want = paged_decode_attention_ref(
        t32.query, t32.k_cache, t32.v_cache, t32.block_tables, t32.seq_lens, t32.scale
    )
    args32 = (t32.query, t32.k_cache, t32.v_cache, t32.block_tables, t32.seq_lens, t32.scale)
    torch.testing.assert_close(paged_decode_cpu_ref(*args32), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        paged_decode_attention_cpu(*args32), paged_decode_cpu_ref(*args32), atol=1e-5, rtol=1e-5
    )
    t = bf16(case)
    args = (t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale)
    assert_one_rounding(paged_decode_cpu_ref(*args), t)
    for variant in bf16_variants():  # two roundings of nearly one value: one ulp apart
        torch.testing.assert_close(
            launch(t, variant).float(), paged_decode_cpu_ref(*args).float(), atol=1e-5, rtol=2**-7
        )


def test_a_build_without_avx512_bf16_has_the_portable_variant_only() -> None:
    """The sources compiled down the path every compiler but GCC on x86-64 takes (here GCC
    told it is clang; aarch64 takes it too: no x86 levels, no AVX512-BF16 pragma): the
    module builds, offers "portable" at the baseline level only, refuses "avx512bf16" and
    the x86 levels, and computes the same attention."""
    module = build_c_module("as_clang", None, ("-D__clang__",))
    assert module.bf16_variants() == ("portable",)
    assert module.isa_levels() == ("baseline",)
    t = bf16(DECODE_CASES[1])
    t32 = make_tensors(DECODE_CASES[1], CPU)
    args32 = (t32.query, t32.k_cache, t32.v_cache, t32.block_tables, t32.seq_lens, t32.scale)
    with decode_module_bound(module):
        assert isa_levels() == ("baseline",)
        assert_one_rounding(launch(t, "auto"), t)
        assert_one_rounding(launch(t, "portable"), t)
        torch.testing.assert_close(
            paged_decode_attention_cpu(*args32),
            paged_decode_attention_ref(*args32),
            atol=1e-5,
            rtol=1e-5,
        )
        with pytest.raises(ValueError, match="'avx512bf16' is not available here"):
            launch(t, "avx512bf16")
        with pytest.raises(ValueError, match="isa 'x86-64-v3' is not available here"):
            launch(t, "portable", isa="x86-64-v3")
