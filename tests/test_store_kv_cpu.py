"""The compiled CPU store (``store_kv_cpu``, csrc/store_kv_cpu.c) against its reference,
``store_kv_ref``: the same pool, bit for bit, on drawn layouts; bad arguments refused with
the pool untouched; the CPU backend storing through it; its mutant caught."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_engine.kernels import store_kv_cpu as launcher
from paged_engine.kernels.paged_decode_cpu import cpu_kernels_problem
from paged_engine.kernels.store_kv_cpu import check_store_kv_cpu, store_kv_cpu
from paged_engine.kernels.store_kv_ref import store_kv_ref
from paged_engine.layers.attention.base import make_attention_metadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.layers.attention.torch_backend import TorchAttentionBackend
from tests.kernel_mutants import STORE_MUTANTS, CpuKernelMutant

pytestmark = pytest.mark.skipif(cpu_kernels_problem() is not None, reason="no compiled kernels")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pool(blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype) -> Any:
    g = torch.Generator().manual_seed(blocks * 131 + heads)
    return [torch.randn(blocks, block_size, heads, dim, generator=g).to(dtype) for _ in "kv"]


def _rows(n: int, heads: int, dim: int, dtype: torch.dtype, extra: int) -> Any:
    """key and value as views of one qkv-like projection output: rows ``extra`` wider."""
    width = 2 * heads * dim + extra
    qkv = torch.randn(n, width, generator=torch.Generator().manual_seed(n)).to(dtype)
    k = qkv[:, extra : extra + heads * dim].view(n, heads, dim)
    v = qkv[:, extra + heads * dim :].view(n, heads, dim)
    return k, v


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    blocks, block_size = draw(st.integers(1, 6)), draw(st.sampled_from((1, 4, 16)))
    heads, dim = draw(st.integers(1, 4)), draw(st.sampled_from((1, 8, 64)))
    slots_total = blocks * block_size
    n = draw(st.integers(0, min(slots_total, 12)))
    slots = draw(st.permutations(range(slots_total)))[:n]
    skip = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mapping = [-1 if s else slot for slot, s in zip(slots, skip, strict=True)]
    return dict(
        shape=(blocks, block_size, heads, dim),
        n=n,
        mapping=mapping,
        dtype=draw(st.sampled_from(DTYPES)),
        extra=draw(st.sampled_from((0, 3, 64))),
    )


@given(layouts())
def test_matches_the_reference_bit_for_bit(layout: dict[str, Any]) -> None:
    blocks, block_size, heads, dim = layout["shape"]
    dtype = layout["dtype"]
    k, v = _rows(layout["n"], heads, dim, dtype, layout["extra"])
    slots = torch.tensor(layout["mapping"], dtype=torch.int64)
    got = _pool(blocks, block_size, heads, dim, dtype)
    want = [t.clone() for t in got]
    stored = store_kv_cpu(k, v, *got, slots)
    store_kv_ref(k, v, *want, slots)
    assert stored == sum(s >= 0 for s in layout["mapping"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _args() -> dict[str, Any]:
    k, v = _rows(3, 2, 8, torch.float32, 5)
    kc, vc = _pool(2, 4, 2, 8, torch.float32)
    return dict(key=k, value=v, k_cache=kc, v_cache=vc, slot_mapping=torch.tensor([0, -1, 7]))


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("slot past the pool", lambda a: a["slot_mapping"].fill_(8), r"slot 8 is outside .* 8 slots"),
    ("int32 slots", lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "must be int64"),
    ("slots too few", lambda a: a.update(slot_mapping=torch.tensor([0, 1])), r"shape \[3\]"),
    ("dtype", lambda a: a.update(key=a["key"].double()), "dtype torch.float64 != cache"),
    (
        "heads apart",
        lambda a: a.update(key=a["key"].transpose(0, 1).contiguous().transpose(0, 1)),
        "heads must be contiguous",
    ),
    ("rows overlap", lambda a: a.update(key=a["key"][:1].expand(3, 2, 8)), "token rows overlap"),
    ("negated", lambda a: a.update(value=a["value"]._neg_view()), "lazy negated"),
    ("cache shape", lambda a: a.update(v_cache=a["v_cache"][:1]), "v_cache shape"),
]


@pytest.mark.parametrize(("label", "mutate", "match"), BAD, ids=[b[0] for b in BAD])
def test_refuses_bad_arguments_and_leaves_the_pool_alone(
    label: str, mutate: Callable[[dict[str, Any]], None], match: str
) -> None:
    args = _args()
    mutate(args)
    before = [args["k_cache"].clone(), args["v_cache"].clone()]
    with pytest.raises(ValueError, match=match):
        store_kv_cpu(**args)
    assert torch.equal(args["k_cache"], before[0]), f"{label}: a refused store wrote K"
    assert torch.equal(args["v_cache"], before[1]), f"{label}: a refused store wrote V"


def test_a_missing_library_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_COMPILED", None)
    monkeypatch.setattr(launcher, "_PROBLEM", "not built here")
    with pytest.raises(RuntimeError, match="store_kv_cpu: not built here"):
        check_store_kv_cpu(**_args())


@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_the_cpu_backend_stores_as_the_torch_backend_checking_once_per_step(
    dtype: torch.dtype,
) -> None:
    """Two layers' stores of one step: both pools equal the torch backend's (index_copy_),
    and the launcher's checks ran once for the step."""
    meta = make_attention_metadata([3, 1], [5, 9], [[1, 0], [3, 2, 4]], 4)
    k, v = _rows(4, 2, 8, dtype, 16)
    cpu, torch_backend = CpuAttentionBackend(4, dtype), TorchAttentionBackend(4, dtype)
    pools = {name: _pool(5, 4, 2, 8, dtype) for name in ("cpu", "torch")}
    for _layer in range(2):
        cpu.store_kv(k, v, *pools["cpu"], meta.slot_mapping, meta)
        torch_backend.store_kv(k, v, *pools["torch"], meta.slot_mapping, meta)
    assert meta.slot_mapping.tolist() == [6, 7, 0, 16]
    for got, want in zip(pools["cpu"], pools["torch"], strict=True):
        assert torch.equal(got, want)
    assert cpu._store_checks.misses == 1


@pytest.mark.parametrize("mutant", STORE_MUTANTS, ids=[m.name for m in STORE_MUTANTS])
def test_each_store_mutant_differs_from_the_reference(mutant: CpuKernelMutant) -> None:
    k, v = _rows(3, 2, 8, torch.float32, 5)
    slots = torch.tensor([0, 6, 3])
    got, want = _pool(2, 4, 2, 8, torch.float32), _pool(2, 4, 2, 8, torch.float32)
    with mutant.active():
        store_kv_cpu(k, v, *got, slots)
    store_kv_ref(k, v, *want, slots)
    assert not torch.equal(got[0], want[0]), f"mutant {mutant.name} ({mutant.bug}) not caught"
