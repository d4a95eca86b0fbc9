"""The Triton kernels (store, paged decode, paged prefill) and the backends built on them.

Every launcher is checked against its plain-torch ``*_ref`` on small layouts that exercise
what paging gets wrong: shuffled block ids, blocks shared between sequences, padded (-1)
block tables, lengths that are not multiples of the block size, prefixes that end mid-block,
GQA ratios of 1, 2 and 3 with several KV heads, strided queries, and both the single-pass and
the split-K decode paths. Unused cache slots hold NaN, so a kernel that reads one token too
many poisons its output instead of passing by luck. tests/kernel_mutants.py supplies broken
kernels that these layouts must catch.

Without CUDA the kernels run under Triton's interpreter (set below, before anything imports
Triton's JIT); shapes are tiny and example counts low so the module stays well under a minute
on 2 cores. Tests marked ``gpu`` use realistic shapes (16 query heads, 8 KV heads, head dim
128, float16/bfloat16, block sizes 16 and 256) and are skipped without CUDA.

Tolerances (output vs the float32 reference, rounded to the output dtype):
float32 atol = rtol = 1e-5; float16 atol = rtol = 2e-3 (one fp16 ulp near 1 is 9.8e-4, and P
is rounded to fp16 before the P @ V product); bfloat16 atol = rtol = 2e-2 (same, 8x coarser).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.machinery
import itertools
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_engine.kernels.paged_decode_attention import (
    choose_num_splits,
    is_interpreted,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from paged_engine.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from paged_engine.kernels.store_kv import store_kv, store_kv_ref
from paged_engine.layers.attention.base import AttentionMetadata
from paged_engine.layers.attention.flash import FlashAttnBackend
from paged_engine.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernel_mutants import MUTANTS, PREFILL_MUTANTS, KernelMutant

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRETED = is_interpreted()

pytestmark = pytest.mark.skipif(
    not (CUDA or INTERPRETED),
    reason="no CUDA, and the kernels were compiled (not interpreted): some module imported "
    "paged_engine.kernels before TRITON_INTERPRET=1 was set",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not CUDA or INTERPRETED, reason="needs CUDA and compiled kernels (TRITON_INTERPRET unset)"
)

TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
CPU_DTYPES = (torch.float32, torch.float16)
FEW = settings(max_examples=40, deadline=None)


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A batch layout: per-sequence context and new-token counts plus the head geometry."""

    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_size: int = 16
    num_kv_heads: int = 2
    group: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    seed: int = 0
    strided_query: bool = False
    share_blocks: bool = True


@dataclass
class Tensors:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float


def make_tensors(case: Case, device: torch.device = DEVICE) -> Tensors:
    """Materialise ``case``: shuffled physical blocks, shared prefix blocks, NaN elsewhere.

    Sequence ``i > 0`` reuses sequence 0's first full blocks that lie inside both contexts'
    cached prefixes (as a prefix-cache hit would); every other block comes from a shuffled
    pool larger than needed. Cache slots outside every context are NaN.
    """
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [math.ceil(s / bs) for s in case.seq_lens]
    num_blocks = sum(needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables: list[list[int]] = []
    for i, (s, q) in enumerate(zip(case.seq_lens, case.query_lens, strict=True)):
        shared: list[int] = []
        if case.share_blocks and i > 0:
            n_shared = min(case.seq_lens[0] - case.query_lens[0], s - q) // bs
            shared = tables[0][: min(n_shared, 2)]
        tables.append(shared + [pool.pop() for _ in range(needed[i] - len(shared))])
    width = max(needed, default=0) + 1  # at least one -1 of padding per row
    padded = [row + [-1] * (width - len(row)) for row in tables]

    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"))
    v_cache = torch.full((num_blocks, bs, kvh, d), float("nan"))
    for row, s in zip(tables, case.seq_lens, strict=True):
        for pos in range(s):
            blk, off = row[pos // bs], pos % bs
            k_cache[blk, off] = torch.randn(kvh, d, generator=gen)
            v_cache[blk, off] = torch.randn(kvh, d, generator=gen)

    num_tokens, num_heads = sum(case.query_lens), kvh * case.group
    if case.strided_query:  # a slice of a fused QKV projection output
        fused = torch.randn(num_tokens, num_heads + 2 * kvh, d, generator=gen)
        query = fused.to(device=device, dtype=case.dtype)[:, :num_heads]
    else:
        query = torch.randn(num_tokens, num_heads, d, generator=gen).to(device, case.dtype)
    i32 = {"dtype": torch.int32, "device": device}
    return Tensors(
        query=query,
        k_cache=k_cache.to(device, case.dtype),
        v_cache=v_cache.to(device, case.dtype),
        block_tables=torch.tensor(padded, **i32).view(len(tables), width),
        seq_lens=torch.tensor(case.seq_lens, **i32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(case.query_lens)], **i32),
        scale=d**-0.5,
    )


def decode_case(seq_lens: tuple[int, ...], **kw: Any) -> Case:
    return Case(seq_lens=seq_lens, query_lens=(1,) * len(seq_lens), **kw)


def run_decode(
    t: Tensors, launch: Callable[..., torch.Tensor] = paged_decode_attention, **kw: Any
) -> torch.Tensor:
    return launch(t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale, **kw)


def ref_decode(t: Tensors) -> torch.Tensor:
    return paged_decode_attention_ref(
        t.query, t.k_cache, t.v_cache, t.block_tables, t.seq_lens, t.scale
    )


def run_prefill(
    t: Tensors, launch: Callable[..., torch.Tensor] = paged_prefill_attention, **kw: Any
) -> torch.Tensor:
    max_q = int((t.query_start_loc[1:] - t.query_start_loc[:-1]).max())
    return launch(
        t.query,
        t.k_cache,
        t.v_cache,
        t.block_tables,
        t.query_start_loc,
        t.seq_lens,
        max_q,
        t.scale,
        **kw,
    )


def ref_prefill(t: Tensors) -> torch.Tensor:
    return paged_prefill_attention_ref(
        t.query, t.k_cache, t.v_cache, t.block_tables, t.query_start_loc, t.seq_lens, t.scale
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any(), "NaN in output: a kernel read an unused (NaN) slot"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[expected.dtype])


# Hand-picked layouts, each run by the decode or prefill test, and by the mutant test.
DECODE_CASES = [
    decode_case((37, 1, 70, 16), block_size=16, group=1),  # lens around block edges
    decode_case((37, 1, 70, 16), block_size=16, group=2),
    decode_case((33, 64, 5), block_size=32, group=2, strided_query=True),
    decode_case((33, 64, 5), block_size=32, group=3, num_kv_heads=1),
    decode_case((100, 9), block_size=8, group=2, head_dim=16),
]
PREFILL_CASES = [
    Case(seq_lens=(37, 20, 70), query_lens=(37, 20, 23), block_size=16, group=1),  # fresh + hit
    Case(seq_lens=(37, 20, 70), query_lens=(37, 3, 23), block_size=16, group=2),  # mid-block
    Case(seq_lens=(45, 64, 40, 10), query_lens=(45, 1, 27, 0), block_size=32, group=2),
    Case(seq_lens=(19, 50), query_lens=(19, 33), block_size=32, group=3, strided_query=True),
]


def cpu_id(case: Case) -> str:
    return f"bs{case.block_size}-kvh{case.num_kv_heads}-g{case.group}-d{case.head_dim}"


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_store_kv_matches_ref_and_skips_minus_one(
    dtype: torch.dtype, block_size: int, slot_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, kvh, d, n = 6, 2, 32, 23
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(DEVICE, dtype)
    fused = torch.randn(n, 3 * kvh, d, generator=gen).to(DEVICE, dtype)  # strided views
    key, value = fused[:, kvh : 2 * kvh], fused[:, 2 * kvh :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[::4] = -1
    slot_mapping = slots.to(DEVICE, slot_dtype)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slot_mapping)
    k_before = k_cache.clone()
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # Rows with slot -1 changed nothing: every slot not named by the mapping is untouched.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0].to(DEVICE)] = True
    flat_before = k_before.view(-1, kvh, d)
    assert torch.equal(k_cache.view(-1, kvh, d)[~written], flat_before[~written])


def test_store_kv_no_tokens_is_a_no_op() -> None:
    cache = torch.zeros(2, 16, 2, 32, device=DEVICE)
    empty = torch.empty(0, 2, 32, device=DEVICE)
    store_kv(empty, empty, cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not cache.any()


def _store_args() -> dict[str, torch.Tensor]:
    cache = torch.zeros(4, 16, 2, 32, device=DEVICE)
    return {
        "key": torch.zeros(5, 2, 32, device=DEVICE),
        "value": torch.zeros(5, 2, 32, device=DEVICE),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "slot_mapping": torch.arange(5, device=DEVICE),
    }


STORE_BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("key 2-D", lambda a: a.update(key=a["key"].flatten(1)), r"key must be \[N, 2, 32\]"),
    ("key heads", lambda a: a.update(key=a["key"][:, :1]), r"key must be \[N, 2, 32\]"),
    (
        "key stride",
        lambda a: a.update(key=a["key"].transpose(1, 2).contiguous().transpose(1, 2)),
        "unit stride",
    ),
    ("key dtype", lambda a: a.update(key=a["key"].half()), "key dtype"),
    ("value shape", lambda a: a.update(value=a["value"][:4]), "value shape"),
    ("cache 3-D", lambda a: a.update(k_cache=a["k_cache"].flatten(0, 1)), "k_cache must be"),
    (
        "cache strided",
        lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "contiguous",
    ),
    ("cache mismatch", lambda a: a.update(v_cache=a["v_cache"][:3]), "v_cache shape"),
    ("cache dtypes", lambda a: a.update(v_cache=a["v_cache"].half()), "v_cache dtype"),
    ("slots float", lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "int32 or int64"),
    ("slots length", lambda a: a.update(slot_mapping=a["slot_mapping"][:4]), r"shape \[5\]"),
    (
        "float64",
        lambda a: a.update({k: v.double() for k, v in a.items() if k != "slot_mapping"}),
        "not supported",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "match"), [c[1:] for c in STORE_BAD], ids=[c[0] for c in STORE_BAD]
)
def test_store_kv_rejects_bad_arguments(
    mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    args = _store_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        store_kv(**args)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=cpu_id)
def test_decode_matches_ref_single_pass_and_split(case: Case, dtype: torch.dtype) -> None:
    t = make_tensors(replace(case, dtype=dtype))
    expected = ref_decode(t)
    assert_close(run_decode(t, num_splits=1), expected)
    assert_close(run_decode(t, num_splits=3, block_n=16), expected)


@st.composite
def decode_cases(draw: st.DrawFn) -> tuple[Case, dict[str, Any]]:
    batch = draw(st.integers(1, 4))
    case = decode_case(
        tuple(draw(st.lists(st.integers(1, 90), min_size=batch, max_size=batch))),
        block_size=draw(st.sampled_from([8, 16, 24, 32, 48])),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([16, 32, 48])),
        dtype=draw(st.sampled_from(CPU_DTYPES)),
        seed=draw(st.integers(0, 2**16)),
        strided_query=draw(st.booleans()),
        share_blocks=draw(st.booleans()),
    )
    knobs = {
        "num_splits": draw(st.sampled_from([None, 1, 2, 5])),
        "block_n": draw(st.sampled_from([16, 32])),
    }
    return case, knobs


@FEW
@given(decode_cases())
def test_decode_matches_ref_on_drawn_layouts(drawn: tuple[Case, dict[str, Any]]) -> None:
    case, knobs = drawn
    t = make_tensors(case)
    assert_close(run_decode(t, **knobs), ref_decode(t))


def test_decode_zero_length_context_gives_zeros_and_fills_out() -> None:
    t = make_tensors(decode_case((5, 20)))
    t.seq_lens[0] = 0
    out = torch.full_like(t.query, float("nan"))
    result = run_decode(t, out=out, num_splits=2, block_n=16)
    assert result is out
    assert not out[0].any()
    assert_close(out, ref_decode(t))


def test_decode_split_policy() -> None:
    """``choose_num_splits`` against its docstring's rule, restated as a search, plus its
    bounds and monotonicity over a grid, and the launcher's outputs split and unsplit.

    The rule: split a sequence's context over more programs while ``batch * num_kv_heads``
    programs leave fewer than ``_PROGRAMS_PER_SM`` per SM, or while one program would
    stream more than ``_MAX_PARTITION`` tokens; never give a split fewer than
    ``_MIN_PARTITION`` tokens, nor exceed ``_MAX_SPLITS``. Restated: the fewest splits that
    reach both goals among the allowed counts, else the most allowed. The constants are
    read from the module that defines the function (tuning, not the rule)."""
    plan = sys.modules[choose_num_splits.__module__]
    per_sm, longest = plan._PROGRAMS_PER_SM, plan._MAX_PARTITION
    shortest, cap = plan._MIN_PARTITION, plan._MAX_SPLITS

    def by_search(batch: int, kv_heads: int, context: int, sms: int) -> int:
        allowed = [n for n in range(1, cap + 1) if n == 1 or context / n >= shortest]
        enough = [
            n for n in allowed if batch * kv_heads * n >= per_sm * sms and n * longest >= context
        ]
        return enough[0] if enough else allowed[-1]

    batches, heads, sms = (1, 2, 3, 7, 64, 100, 512, 4096), (1, 2, 8), (1, 80, 132)
    contexts = (1, 100, 255, 256, 511, 512, 1000, 1024, 1025, 2048, 3000, 8192, 10**5, 10**6)
    grid = {
        key: choose_num_splits(*key) for key in itertools.product(batches, heads, contexts, sms)
    }
    for (b, h, c, m), n in grid.items():
        assert n == by_search(b, h, c, m), ((b, h, c, m), n)
        assert 1 <= n <= cap and (n == 1 or c // n >= shortest)
        if b * h >= per_sm * m and c <= longest:
            assert n == 1, "split without a reason"
    # more context or more SMs never fewer splits; more sequences or KV heads never more
    axes = (batches, heads, contexts, sms)
    for key, n in grid.items():
        for i, axis in enumerate(axes):
            at = axis.index(key[i])
            if at + 1 < len(axis):
                after = grid[(*key[:i], axis[at + 1], *key[i + 1 :])]
                assert after >= n if i >= 2 else after <= n, (key, i, n, after)
    # By hand, H200 (132 SMs) at B=64, KVH=8: 512 programs for 1056 wanted (8 x 132) need 3
    # splits, context 2048 needs 2, and 2048 // 256 = 8 are allowed: 3. At 8192 tokens the
    # length needs 8 (of 32 allowed): 8.
    assert choose_num_splits(64, 8, 2048, 132) == 3
    assert choose_num_splits(64, 8, 8192, 132) == 8

    # One 600-token sequence, one KV head: a 624-token table allows 624 // 256 = 2 splits,
    # and one program is below any SM count's target, so the policy splits in 2 whatever
    # the device; the launcher's default (the policy) and forced splits all agree with the
    # unsplit pass and the reference.
    t = make_tensors(decode_case((600,), block_size=16, num_kv_heads=1, group=2, head_dim=16))
    capacity = t.block_tables.shape[1] * 16
    assert capacity == 624 and {choose_num_splits(1, 1, capacity, m) for m in sms} == {2}
    unsplit = run_decode(t, num_splits=1)
    assert_close(unsplit, ref_decode(t))
    for splits in (None, 2, 5):
        assert_close(run_decode(t, num_splits=splits), unsplit)


def _decode_args() -> dict[str, Any]:
    t = make_tensors(decode_case((5, 20)))
    return {
        "query": t.query,
        "k_cache": t.k_cache,
        "v_cache": t.v_cache,
        "block_tables": t.block_tables,
        "seq_lens": t.seq_lens,
        "scale": t.scale,
    }


DECODE_BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("query 2-D", lambda a: a.update(query=a["query"].flatten(1)), r"query must be \[B, H, D\]"),
    ("head_dim", lambda a: a.update(query=a["query"][..., :16]), "query head_dim 16 != cache"),
    ("heads", lambda a: a.update(query=a["query"][:, :3]), "not a multiple of num_kv_heads"),
    (
        "query stride",
        lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)),
        "unit stride",
    ),
    ("query dtype", lambda a: a.update(query=a["query"].half()), "query dtype"),
    (
        "cache strided",
        lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "contiguous",
    ),
    ("table int64", lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
    ("table batch", lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables must"),
    ("seq_lens len", lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens must have shape"),
    ("seq_lens int64", lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be"),
    ("out shape", lambda a: a.update(out=a["query"][:1].clone()), "out must be"),
    ("block_n", lambda a: a.update(block_n=8), "block_n must be"),
    (
        "tiny head_dim",
        lambda a: a.update(
            query=a["query"][..., :8].contiguous(),
            k_cache=a["k_cache"][..., :8].contiguous(),
            v_cache=a["v_cache"][..., :8].contiguous(),
        ),
        r"head_dim must be in \[16, 256\]",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "match"), [c[1:] for c in DECODE_BAD], ids=[c[0] for c in DECODE_BAD]
)
def test_decode_rejects_bad_arguments(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    args = _decode_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args)


@pytest.mark.skipif(not INTERPRETED, reason="bfloat16 is only refused under the interpreter")
def test_launchers_refuse_bfloat16_under_the_interpreter() -> None:
    args = _decode_args()
    args.update({k: args[k].bfloat16() for k in ("query", "k_cache", "v_cache")})
    with pytest.raises(ValueError, match="bfloat16 is unsupported under TRITON_INTERPRET"):
        paged_decode_attention(**args)
    store = _store_args()
    store.update({k: v.bfloat16() for k, v in store.items() if k != "slot_mapping"})
    with pytest.raises(ValueError, match="bfloat16"):
        store_kv(**store)


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


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


def make_meta(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Build the step's metadata directly from the interface dataclass."""
    slots = [
        tables[i][pos // block_size] * block_size + pos % block_size
        for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True))
        for pos in range(s - q, s)
    ]
    width = max(len(r) for r in tables)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return AttentionMetadata(
        is_prefill=max(query_lens) > 1,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], **i32),
        seq_start_loc=torch.tensor([0, *itertools.accumulate(seq_lens)], **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=torch.tensor([r + [-1] * (width - len(r)) for r in tables], **i32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unpaged oracle: ``q`` are the last ``len(q)`` of the ``len(k)`` context tokens."""
    group = q.shape[1] // k.shape[1]
    kf, vf = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    pos = torch.arange(len(k) - len(q), len(k), device=q.device)
    scores = scores.masked_fill(
        torch.arange(len(k), device=q.device)[None, :] > pos[:, None], -math.inf
    )
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


BACKEND_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


Step = list[tuple[int, int]]
"""One engine step: (sequence index, new tokens) for each scheduled sequence."""

SMALL_STEPS: list[Step] = [
    [(0, 12), (1, 35), (2, 7)],  # fresh prompts (seq 0 only its first chunk)
    [(0, 8)],  # second chunk: a 12-token prefix, ending mid-block
    [(0, 1), (1, 1), (2, 1)],  # decode
    [(0, 1), (1, 1), (2, 1)],
]


def run_engine_steps(
    backend: Any, steps: list[Step], block_size: int, dtype: torch.dtype, seed: int = 7
) -> None:
    """Drive ``backend`` through ``steps`` like the model runner; check every output.

    Blocks come from a shuffled pool; the oracle is ``dense_causal`` over each sequence's
    K/V history kept here, unpaged, so it shares nothing with the code under test.
    """
    kvh, group, d = 2, 2, 32
    num_seqs = 1 + max(i for step in steps for i, _ in step)
    final = [sum(n for step in steps for i, n in step if i == s) for s in range(num_seqs)]
    needed = [math.ceil(n / block_size) for n in final]
    pool = list(range(sum(needed) + 2))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    k_cache = torch.zeros(sum(needed) + 2, block_size, kvh, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    gen = torch.Generator().manual_seed(seed)
    history: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in final]
    lengths = [0] * num_seqs
    for step in steps:
        seqs, query_lens = [i for i, _ in step], [n for _, n in step]
        for i, n in step:
            lengths[i] += n
        meta = make_meta(
            query_lens, [lengths[i] for i in seqs], [tables[i] for i in seqs], block_size
        )
        q, k, v = (
            torch.randn(sum(query_lens), heads, d, generator=gen).to(DEVICE, dtype)
            for heads in (kvh * group, kvh, kvh)
        )
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attend(q, k, v, k_cache, v_cache, meta, d**-0.5)
        starts = [0, *itertools.accumulate(query_lens)]
        for j, i in enumerate(seqs):
            s, e = starts[j], starts[j + 1]
            history[i][0].append(k[s:e])
            history[i][1].append(v[s:e])
            keys, values = (torch.cat(h) for h in history[i])
            assert_close(out[s:e], dense_causal(q[s:e], keys, values, d**-0.5))


@pytest.mark.parametrize("dtype", BACKEND_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_triton_backend_chunked_prefill_then_decode(dtype: torch.dtype) -> None:
    """Fresh prompts, a second chunk after a mid-block prefix, then two decode steps."""
    run_engine_steps(TritonAttentionBackend(block_size=16, dtype=dtype), SMALL_STEPS, 16, dtype)


def test_triton_backend_empty_cache_is_plain_causal_attention() -> None:
    backend = TritonAttentionBackend(block_size=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    query_lens = [5, 12, 1]
    n = sum(query_lens)
    q = torch.randn(n, 4, 32, generator=gen).to(DEVICE)
    k = torch.randn(n, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(n, 2, 32, generator=gen).to(DEVICE)
    meta = make_meta(query_lens, query_lens, [[0], [1], [2]], 16)
    empty = torch.empty(0, device=DEVICE)
    backend.store_kv(k, v, empty, empty, meta.slot_mapping)  # warm-up: nothing to store
    out = backend.attend(q, k, v, empty, empty, meta, 0.3)
    starts = [0, *itertools.accumulate(query_lens)]
    for s, e in itertools.pairwise(starts):
        assert_close(out[s:e], dense_causal(q[s:e], k[s:e], v[s:e], 0.3))
    prefix_meta = make_meta([2], [9], [[0]], 16)
    with pytest.raises(ValueError, match="cached prefix needs a KV cache"):
        backend.attend(q[:2], k[:2], v[:2], empty, empty, prefix_meta, 0.3)


@pytest.mark.parametrize("block_size", [24, 48])
def test_triton_backend_takes_block_sizes_that_are_not_powers_of_two(block_size: int) -> None:
    """Fresh prompts, a mid-block second chunk, then decode, at block sizes 24 and 48: the
    kernels gather per token and mask past each context, so any block size works."""
    backend = TritonAttentionBackend(block_size=block_size, dtype=torch.float16)
    run_engine_steps(backend, SMALL_STEPS, block_size, torch.float16)


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


@pytest.mark.parametrize(
    ("block_size", "dtype", "head_dim", "match"),
    [
        (0, torch.float16, None, "positive int"),
        (16, torch.float64, None, "not supported"),
        (16, torch.float16, 8, "head_dim 16..256"),
        (16, torch.float16, 320, "head_dim 16..256"),
    ],
)
def test_triton_backend_rejects_bad_configuration(
    block_size: int, dtype: torch.dtype, head_dim: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        TritonAttentionBackend(block_size=block_size, dtype=dtype, head_dim=head_dim)


@pytest.mark.skipif(not INTERPRETED, reason="bfloat16 is only refused under the interpreter")
def test_triton_backend_refuses_bfloat16_under_the_interpreter() -> None:
    with pytest.raises(ValueError, match="bfloat16 is unsupported under TRITON_INTERPRET=1"):
        TritonAttentionBackend(block_size=16, dtype=torch.bfloat16)


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


FLASH = CUDA and _flash_attn_importable()


@pytest.mark.parametrize(
    ("block_size", "dtype", "head_dim", "match"),
    [
        (256, torch.float32, None, "float16 and bfloat16 only"),
        (16, torch.float16, None, "% 256 == 0"),
        (384, torch.bfloat16, None, "% 256 == 0"),
        (256, torch.float16, 100, "head_dim a multiple of 8"),
        (256, torch.float16, 264, "head_dim a multiple of 8 up to 256"),
    ],
)
def test_flash_backend_rejects_unsupported_configuration(
    block_size: int, dtype: torch.dtype, head_dim: int | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        FlashAttnBackend(block_size=block_size, dtype=dtype, head_dim=head_dim)


@pytest.mark.skipif(FLASH, reason="flash-attn runs here")
def test_flash_backend_says_why_it_cannot_run_here() -> None:
    match = "flash-attn is not installed" if CUDA else "needs a CUDA device"
    with pytest.raises(ValueError, match=match):
        FlashAttnBackend(block_size=256, dtype=torch.float16)


def test_flash_backend_refuses_gpus_before_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability 8\.0\+ .* this device is 7\.5"):
        FlashAttnBackend(block_size=256, dtype=torch.float16, head_dim=128)


def _fake_flash_attn() -> Any:
    """A torch stand-in for flash-attn 2.6+'s two entry points, same parameter names.

    It follows flash-attn's documented semantics (bottom-right-aligned causal mask; with
    ``block_table``, ``k``/``v`` are the paged caches and ``cu_seqlens_k`` counts context
    tokens), and has no ``**kwargs``: a misspelt argument raises TypeError. It lets the
    backend's wiring (which function, which lengths, which tables) be tested without CUDA.
    """

    def paged(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
        assert cache.shape[1] % 256 == 0, "flash-attn needs page_block_size % 256 == 0"
        blocks = table[: math.ceil(length / cache.shape[1])].long()
        return cache[blocks].flatten(0, 1)[:length]

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        assert causal and dropout_p == 0.0 and softmax_scale is not None
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
            if block_table is None:
                kk, vv = k[ks:ke], v[ks:ke]
            else:
                kk, vv = paged(k, block_table[i], ke - ks), paged(v, block_table[i], ke - ks)
            out[qs:qe] = dense_causal(q[qs:qe], kk, vv, softmax_scale)
        return out

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    ):  # fmt: skip
        assert k is None and v is None and causal and softmax_scale is not None
        assert q.dim() == 4 and block_table is not None and cache_seqlens.dtype == torch.int32
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            length = int(cache_seqlens[b])
            kk, vv = paged(k_cache, block_table[b], length), paged(v_cache, block_table[b], length)
            out[b] = dense_causal(q[b], kk, vv, softmax_scale)
        return out

    module = type(sys)("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # find_spec sees it
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def test_flash_backend_wiring_against_a_fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh prompts (plain varlen), prefixed chunks (block_table varlen), decode (kvcache)."""
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend = FlashAttnBackend(block_size=256, dtype=torch.float16, head_dim=32)
    steps: list[Step] = [
        [(0, 300), (1, 40), (2, 7)],
        [(0, 230), (1, 260)],  # prefixes of 300 (past a block edge) and 40 tokens
        [(0, 1), (1, 1), (2, 1)],
    ]
    run_engine_steps(backend, steps, 256, torch.float16)


# --------------------------------------------------------------------------------------------
# GPU: realistic shapes (16 query heads, 8 KV heads, head dim 128)
# --------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.float16, torch.bfloat16]
GPU_GEOMETRY = {"num_kv_heads": 8, "group": 2, "head_dim": 128}


def _random_lens(seed: int, n: int, lo: int, hi: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


def make_tensors_fast(case: Case) -> Tensors:
    """``make_tensors`` for GPU-sized cases: bulk fill on the device, NaN in unused slots.

    Blocks are shuffled but not shared (sharing is covered at CPU sizes).
    """
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    bs, kvh, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [math.ceil(s / bs) for s in case.seq_lens]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(case.seed)).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(perm[at : at + n])
        at += n
    width = max(needed) + 1
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=DEVICE).to(case.dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=DEVICE).to(case.dtype)
    used = torch.zeros(num_blocks * bs, dtype=torch.bool, device=DEVICE)
    for row, s in zip(tables, case.seq_lens, strict=True):
        slots = torch.tensor(row, device=DEVICE)[:, None] * bs + torch.arange(bs, device=DEVICE)
        used[slots.flatten()[:s]] = True
    k_cache.view(-1, kvh, d)[~used] = float("nan")
    v_cache.view(-1, kvh, d)[~used] = float("nan")
    num_tokens, num_heads = sum(case.query_lens), kvh * case.group
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return Tensors(
        query=torch.randn(num_tokens, num_heads, d, generator=gen, device=DEVICE).to(case.dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor([r + [-1] * (width - len(r)) for r in tables], **i32),
        seq_lens=torch.tensor(case.seq_lens, **i32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(case.query_lens)], **i32),
        scale=d**-0.5,
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_decode_realistic(dtype: torch.dtype, block_size: int) -> None:
    seq_lens = (*_random_lens(1, 14, 1, 3000), 2048, 8192)
    t = make_tensors_fast(decode_case(seq_lens, block_size=block_size, dtype=dtype, **GPU_GEOMETRY))
    expected = ref_decode(t)
    for num_splits in (None, 1, 7):
        assert_close(run_decode(t, num_splits=num_splits), expected)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_prefill_realistic(dtype: torch.dtype, block_size: int) -> None:
    case = Case(
        seq_lens=(700, 1500, 2049, 530, 300),
        query_lens=(700, 300, 1, 17, 300),
        block_size=block_size,
        dtype=dtype,
        **GPU_GEOMETRY,
    )
    t = make_tensors_fast(case)
    assert_close(run_prefill(t), ref_prefill(t))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_store_kv_realistic(dtype: torch.dtype) -> None:
    k_cache = torch.randn(64, 256, 8, 128, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(3000, 32, 128, device=DEVICE).to(dtype)
    key, value = qkv[:, 16:24], qkv[:, 24:]
    slots = torch.randperm(64 * 256, device=DEVICE)[:3000]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@gpu
@needs_cuda
@pytest.mark.skipif(not FLASH, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["fp16", "bf16"])
def test_gpu_flash_backend_matches_refs(dtype: torch.dtype) -> None:
    backend = FlashAttnBackend(block_size=256, dtype=dtype)
    geometry = {"block_size": 256, "dtype": dtype, **GPU_GEOMETRY}
    scale = 128**-0.5

    # Decode over a paged context.
    t = make_tensors_fast(decode_case((1, 255, 256, 257, 3000), **geometry))
    meta = _meta_from_tensors(t, is_prefill=False)
    k, v = _step_rows(t.k_cache, meta), _step_rows(t.v_cache, meta)
    out = backend.attend(t.query, k, v, t.k_cache, t.v_cache, meta, scale)
    assert_close(out, ref_decode(t))

    # Prefill with cached prefixes (the block_table path), then fresh prompts (plain varlen).
    for seq_lens, query_lens in [((700, 1500, 530), (700, 300, 17)), ((700, 33, 530),) * 2]:
        t = make_tensors_fast(Case(seq_lens=seq_lens, query_lens=query_lens, **geometry))
        meta = _meta_from_tensors(t, is_prefill=True)
        k, v = _step_rows(t.k_cache, meta), _step_rows(t.v_cache, meta)
        out = backend.attend(t.query, k, v, t.k_cache, t.v_cache, meta, scale)
        assert_close(out, ref_prefill(t))


def _meta_from_tensors(t: Tensors, is_prefill: bool) -> AttentionMetadata:
    seq_lens = [int(x) for x in t.seq_lens]
    qsl = [int(x) for x in t.query_start_loc]
    query_lens = [b - a for a, b in itertools.pairwise(qsl)]
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc=t.query_start_loc,
        seq_start_loc=torch.tensor(
            [0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=DEVICE
        ),
        seq_lens=t.seq_lens,
        block_tables=t.block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def _step_rows(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The step's own K (or V) rows, packed: each context's last ``q_len`` tokens."""
    bs = cache.shape[1]
    rows = []
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        blocks = meta.block_tables[i, : math.ceil(s / bs)].long()
        rows.append(cache[blocks].flatten(0, 1)[s - q : s])
    return torch.cat(rows)
