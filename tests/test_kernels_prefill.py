"""The Triton paged prefill kernel against its torch ref, and the kernel mutants.

Prefill on tests/kernel_cases.py's hand-picked and drawn layouts (fresh prompts, prefix
hits ending mid-block, GQA, strided queries), both kernels at block sizes that are not powers
of two, prefill's refusals, and every mutant in tests/kernel_mutants.py caught by some
hand-picked layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_engine.kernels.paged_prefill_attention import paged_prefill_attention
from tests.kernel_cases import (
    CPU_DTYPES,
    DECODE_CASES,
    FEW,
    PREFILL_CASES,
    TOL,
    Case,
    assert_close,
    cpu_id,
    decode_case,
    make_tensors,
    ref_decode,
    ref_prefill,
    requires_kernels,
    run_decode,
    run_prefill,
)
from tests.kernel_mutants import MUTANTS, PREFILL_MUTANTS, KernelMutant

pytestmark = requires_kernels

# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=cpu_id)
def test_prefill_matches_ref(case: Case, dtype: torch.dtype) -> None:
    t = make_tensors(replace(case, dtype=dtype))
    expected = ref_prefill(t)
    assert_close(run_prefill(t), expected)
    # The smallest legal query tile (16 rows): several tiles per sequence; 16-key tiles.
    smallest_m = 16 // (1 << (case.group - 1).bit_length())
    assert_close(run_prefill(t, block_m=smallest_m, block_n=16), expected)


@st.composite
def prefill_cases(draw: st.DrawFn) -> tuple[Case, dict[str, Any]]:
    batch = draw(st.integers(1, 3))
    seq_lens, query_lens = [], []
    for _ in range(batch):
        s = draw(st.integers(1, 70))
        seq_lens.append(s)
        query_lens.append(draw(st.sampled_from([s, 1, max(1, s // 2), max(1, s - 16)])))
    group = draw(st.sampled_from([1, 2, 3]))
    case = Case(
        seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens),
        block_size=draw(st.sampled_from([8, 16, 24, 32, 48])),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=group,
        head_dim=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from(CPU_DTYPES)),
        seed=draw(st.integers(0, 2**16)),
        strided_query=draw(st.booleans()),
        share_blocks=draw(st.booleans()),
    )
    smallest_m = 16 // (1 << (group - 1).bit_length())  # tiles need >= 16 rows
    knobs = {"block_m": draw(st.sampled_from([None, smallest_m])), "block_n": 16}
    return case, knobs


@FEW
@given(prefill_cases())
def test_prefill_matches_ref_on_drawn_layouts(drawn: tuple[Case, dict[str, Any]]) -> None:
    case, knobs = drawn
    t = make_tensors(case)
    assert_close(run_prefill(t, **knobs), ref_prefill(t))


def test_prefill_with_one_token_per_sequence_equals_decode() -> None:
    t = make_tensors(decode_case((37, 1, 70, 16)))
    assert_close(run_prefill(t), run_decode(t))


def _prefill_args() -> dict[str, Any]:
    t = make_tensors(PREFILL_CASES[1])
    return {
        "query": t.query,
        "k_cache": t.k_cache,
        "v_cache": t.v_cache,
        "block_tables": t.block_tables,
        "query_start_loc": t.query_start_loc,
        "seq_lens": t.seq_lens,
        "max_query_len": 37,
        "scale": t.scale,
    }


PREFILL_BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("query 2-D", lambda a: a.update(query=a["query"].flatten(1)), r"query must be \[N, H, D\]"),
    ("heads", lambda a: a.update(query=a["query"][:, :3]), "not a multiple of num_kv_heads"),
    ("query dtype", lambda a: a.update(query=a["query"].half()), "query dtype"),
    ("table 1-D", lambda a: a.update(block_tables=a["block_tables"][0]), "block_tables must be"),
    (
        "qsl length",
        lambda a: a.update(query_start_loc=a["query_start_loc"][:3]),
        r"query_start_loc must have shape \[4\]",
    ),
    (
        "qsl int64",
        lambda a: a.update(query_start_loc=a["query_start_loc"].long()),
        "query_start_loc must be",
    ),
    ("seq_lens len", lambda a: a.update(seq_lens=a["seq_lens"][:2]), "seq_lens must have shape"),
    ("max_query_len", lambda a: a.update(max_query_len=-1), "max_query_len"),
    ("block_m", lambda a: a.update(block_m=4), "block_m must be"),
    ("block_n", lambda a: a.update(block_n=24), "block_n must be"),
    ("out dtype", lambda a: a.update(out=a["query"].half()), "out must be"),
]


@pytest.mark.parametrize(
    ("mutate", "match"), [c[1:] for c in PREFILL_BAD], ids=[c[0] for c in PREFILL_BAD]
)
def test_prefill_rejects_bad_arguments(
    mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    args = _prefill_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**args)


# --------------------------------------------------------------------------------------------
# Mutants: the layouts above must catch each planted bug
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutant", MUTANTS + PREFILL_MUTANTS, ids=[m.name for m in MUTANTS + PREFILL_MUTANTS]
)
def test_each_mutant_disagrees_with_ref_on_some_layout(mutant: KernelMutant) -> None:
    """Run the mutant over the hand-picked layouts that the real kernel passes; one must fail.

    Also names which layouts catch it, so a layout list that stops catching a mutant fails
    here rather than silently weakening the suite.
    """
    caught = []
    cases = DECODE_CASES if mutant.kind == "decode" else PREFILL_CASES
    for case in cases:
        t = make_tensors(case)
        if mutant.kind == "decode":
            got, expected = run_decode(t, mutant.launch), ref_decode(t)
        else:
            got, expected = run_prefill(t, mutant.launch), ref_prefill(t)
        if not torch.allclose(got.float(), expected.float(), **TOL[case.dtype]):
            caught.append(cpu_id(case))
    assert caught, f"no layout catches mutant {mutant.name} ({mutant.bug})"


@pytest.mark.parametrize("block_size", [24, 48])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["fp32", "fp16"])
def test_kernels_match_ref_at_block_sizes_24_and_48(block_size: int, dtype: torch.dtype) -> None:
    # Lengths on both sides of block edges, a prefix ending mid-block, GQA over 2 KV heads.
    decode = make_tensors(decode_case((49, 1, 96, 23), block_size=block_size, dtype=dtype))
    assert_close(run_decode(decode, num_splits=1), ref_decode(decode))
    assert_close(run_decode(decode, num_splits=3, block_n=16), ref_decode(decode))
    case = Case(seq_lens=(50, 30, 97), query_lens=(50, 7, 40), block_size=block_size, dtype=dtype)
    prefill = make_tensors(case)
    assert_close(run_prefill(prefill), ref_prefill(prefill))
