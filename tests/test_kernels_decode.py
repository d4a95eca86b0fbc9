"""The Triton store_kv and paged decode kernels against their torch refs, and the split policy.

Each launcher on tests/kernel_cases.py's hand-picked layouts (NaN outside every context) and
on drawn ones, both the single-pass and the split-K decode paths; ``choose_num_splits``
against its documented rule; and the launchers' refusals of bad arguments.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_engine.kernels.paged_decode_attention import choose_num_splits, paged_decode_attention
from paged_engine.kernels.store_kv import store_kv
from paged_engine.kernels.store_kv_ref import store_kv_ref
from tests.kernel_cases import (
    CPU_DTYPES,
    DECODE_CASES,
    DEVICE,
    FEW,
    INTERPRETED,
    Case,
    assert_close,
    cpu_id,
    decode_case,
    make_tensors,
    ref_decode,
    requires_kernels,
    run_decode,
)

pytestmark = requires_kernels

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
