"""The CPU decode kernel's shared-prefix groups (csrc/paged_decode_share.h).

A call with groups must give the same bits as the call without them, in every copy (each
float32 level, each bfloat16 variant), where ``decode_share.same_bits`` says so (within
float32 rounding elsewhere), and both must match the readable reference. The
layouts mix groups of several sizes with sequences in no group, put a group's rows out of
batch order, give members contexts that end mid-block or right after the shared blocks,
and cover runs of kv heads (head_dim 64, 2-4 kv heads), one kv head per item, generic head
dims and group sizes up to 16 query heads per kv head (so the virtual heads of a group
span several passes). Unused pool slots hold NaN. Bad groups are refused before anything is
read or written. The mutants at the end plant bugs in the share pass and the resume.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from paged_engine.kernels import paged_decode_cpu as pdc
from paged_engine.kernels.decode_share import DecodeShare, decode_share, same_bits
from paged_engine.kernels.paged_attention_ref import paged_decode_attention_ref
from paged_engine.layers.attention import cpu as cpu_module
from paged_engine.layers.attention import make_attention_metadata
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from tests.kernel_mutants import SHARE_MUTANTS, CpuKernelMutant, decode_module_bound

pytestmark = pytest.mark.skipif(
    pdc.cpu_kernels_problem() is not None, reason=f"{pdc.cpu_kernels_problem()}"
)


@dataclass(frozen=True, slots=True)
class Layout:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    groups: tuple[tuple[int, int], ...]
    """Per group: its members and its shared blocks."""
    alone: int = 1
    """Sequences in no group."""


LAYOUTS = (
    Layout(8, 4, 64, 32, ((8, 3), (5, 2))),  # the 29M model: runs of 4 kv heads
    Layout(9, 3, 64, 16, ((3, 2), (2, 1)), alone=2),  # SmolLM2: groups of 3
    Layout(4, 1, 128, 16, ((4, 2),)),  # one kv head per item, head_dim 128
    Layout(2, 2, 32, 4, ((3, 3), (2, 1))),  # groups of 1 query head, small blocks
    Layout(6, 1, 80, 8, ((2, 2),)),  # a head dim without its own copy
    Layout(16, 2, 64, 16, ((3, 1),)),  # 8 heads per kv head: 24 virtual heads, 2 passes
    Layout(32, 2, 32, 16, ((3, 2),), alone=0),  # 16 per kv head: 48 virtual heads, 3 passes
    Layout(4, 2, 16, 8, ((3, 2),)),  # head_dim 16: the generic share copy
)


def _copies() -> list[tuple[torch.dtype, dict[str, str]]]:
    """Every compiled copy this machine runs: float32 per level, bfloat16 per variant."""
    f32 = [(torch.float32, {"isa": isa}) for isa in pdc.isa_levels()]
    return f32 + [(torch.bfloat16, {"bf16_variant": v}) for v in pdc.bf16_variants()]


COPIES = _copies()


@dataclass(frozen=True, slots=True)
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    share: DecodeShare


def make_call(layout: Layout, dtype: torch.dtype, seed: int = 0) -> Call:
    """The layout's batch, its rows shuffled, its blocks scattered over a NaN-filled pool."""
    rng = random.Random(seed)
    bs, kvh, d = layout.block_size, layout.kv_heads, layout.head_dim
    members: list[tuple[int | None, int]] = []  # (group, own tokens) per sequence
    for g, (count, _) in enumerate(layout.groups):
        members += [(g, rng.choice((0, 1, bs - 1, bs + 3, 2 * bs))) for _ in range(count)]
    members += [(None, rng.randint(1, 3 * bs)) for _ in range(layout.alone)]
    rng.shuffle(members)
    next_id = 0
    shared_ids: list[list[int]] = []
    for _, blocks in layout.groups:
        shared_ids.append(list(range(next_id, next_id + blocks)))
        next_id += blocks
    rows, lens = [], []
    for g, own in members:
        prefix = shared_ids[g] if g is not None else []
        length = len(prefix) * bs + own
        if length == 0:
            own, length = 1, 1
        own_blocks = -(-length // bs) - len(prefix)
        rows.append(prefix + list(range(next_id, next_id + own_blocks)))
        next_id += own_blocks
        lens.append(length)
    pool = next_id + 3
    perm = list(range(pool))
    rng.shuffle(perm)  # scatter the ids over the pool
    width = max(map(len, rows))
    table = torch.full((len(rows), width), -1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((pool, bs, kvh, d), float("nan"), dtype=dtype)
    v = torch.full((pool, bs, kvh, d), float("nan"), dtype=dtype)
    for b, (ids, n) in enumerate(zip(rows, lens, strict=True)):
        for j, block in enumerate(ids):
            table[b, j] = perm[block]
            used = min(bs, n - j * bs)
            if torch.isnan(k[perm[block], :used].float()).any():
                k[perm[block], :used] = torch.randn(used, kvh, d, generator=gen).to(dtype)
                v[perm[block], :used] = torch.randn(used, kvh, d, generator=gen).to(dtype)
    q = torch.randn(len(rows), layout.heads, d, generator=gen).to(dtype)
    groups = [
        ([b for b, (g2, _) in enumerate(members) if g2 == g], blocks * bs)
        for g, (_, blocks) in enumerate(layout.groups)
    ]
    share = decode_share(groups, len(rows), bs)
    assert share is not None
    return Call(q, k, v, table, torch.tensor(lens, dtype=torch.int32), share)


def run(call: Call, kw: dict[str, str], share: DecodeShare | None, **more: int) -> torch.Tensor:
    launch = pdc.check_paged_decode_cpu(call.q, call.k, call.v, call.table, call.lens, **kw, **more)  # type: ignore[arg-type]
    scale = call.q.shape[-1] ** -0.5
    return pdc.run_paged_decode_cpu(
        launch, call.q, call.k, call.v, call.table, call.lens, scale, share=share
    )


def copy_id(copy: tuple[torch.dtype, dict[str, str]]) -> str:
    return f"{str(copy[0]).removeprefix('torch.')}-{next(iter(copy[1].values()))}"


def layout_id(layout: Layout) -> str:
    return f"h{layout.heads}kv{layout.kv_heads}d{layout.head_dim}bs{layout.block_size}"


@pytest.mark.parametrize("copy", COPIES, ids=copy_id)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_groups_give_the_same_bits_and_match_the_reference(
    layout: Layout, copy: tuple[torch.dtype, dict[str, str]]
) -> None:
    dtype, kw = copy
    call = make_call(layout, dtype)
    plain, shared = run(call, kw, None), run(call, kw, call.share)
    assert not shared.isnan().any()
    if same_bits(layout.heads, layout.kv_heads, layout.head_dim):
        assert torch.equal(shared, plain), f"max difference {(shared - plain).abs().max()}"
    else:  # the plain copies order their sums their own way (same_bits' docstring)
        torch.testing.assert_close(
            shared, plain, atol=1e-6, rtol=2e-7 if dtype == torch.float32 else 2**-8
        )
    ref = paged_decode_attention_ref(
        call.q.float(),
        call.k.float(),
        call.v.float(),
        call.table,
        call.lens,
        call.q.shape[-1] ** -0.5,
    )
    tol = (
        {"atol": 1e-5, "rtol": 1e-5}
        if dtype == torch.float32
        else {"atol": 1e-5, "rtol": 2**-8 + 1e-5}
    )
    torch.testing.assert_close(shared.float(), ref, **tol)


@pytest.mark.skipif(not pdc.cpu_kernels_threaded(), reason="the build has no OpenMP")
@pytest.mark.parametrize("copy", COPIES[-1:] + COPIES[:1], ids=copy_id)
def test_the_same_bits_on_two_threads(copy: tuple[torch.dtype, dict[str, str]]) -> None:
    dtype, kw = copy
    for layout in (LAYOUTS[0], LAYOUTS[1], LAYOUTS[-2]):  # runs, groups of 3, 3 passes
        call = make_call(layout, dtype, seed=1)
        one = run(call, kw, call.share, num_threads=1)
        assert torch.equal(run(call, kw, call.share, num_threads=2), one)
        assert torch.equal(run(call, kw, None, num_threads=1), one)


# ---- bad groups: refused before anything is read or written ---------------------------------


def _raw(starts: list[int], rows: list[int], bounds: list[int]) -> DecodeShare:
    """Groups as given, past decode_share's own checks (the kernel must check them too)."""
    i32 = torch.int32
    return DecodeShare(
        torch.tensor(starts, dtype=i32),
        torch.tensor(rows, dtype=i32),
        torch.tensor(bounds, dtype=i32),
    )


def _bad_groups(call: Call) -> dict[str, DecodeShare]:
    """Broken versions of ``call``'s groups (LAYOUTS[0]: rows of two groups and one alone)."""
    starts = call.share.starts.tolist()
    rows, bounds = call.share.rows.tolist(), call.share.bounds.tolist()
    first = rows[bounds[0]]
    alone = next(b for b in range(len(starts)) if starts[b] == 0)
    s = call.table.shape[0]

    def with_start(b: int, n: int) -> list[int]:
        return [n if i == b else x for i, x in enumerate(starts)]

    return {
        "in two groups": _raw(starts, [*rows[:-1], first], bounds),
        "outside the batch": _raw(starts, [*rows[:-1], s], bounds),
        "in no group": _raw(with_start(alone, 32), rows, bounds),
        "starts at 16": _raw(with_start(rows[bounds[1] + 1], 16), rows, bounds),
        "starts at 9984": _raw(
            [9984 if i in rows[bounds[1] :] else x for i, x in enumerate(starts)], rows, bounds
        ),
        "the first from row 1": _raw(starts, rows, [1, *bounds[1:]]),
    }


@pytest.mark.parametrize("copy", COPIES[:1] + COPIES[-1:], ids=copy_id)
def test_bad_groups_are_refused_and_out_is_left_alone(
    copy: tuple[torch.dtype, dict[str, str]],
) -> None:
    dtype, kw = copy
    call = make_call(LAYOUTS[0], dtype)
    launch = pdc.check_paged_decode_cpu(call.q, call.k, call.v, call.table, call.lens, **kw)  # type: ignore[arg-type]
    for problem, share in _bad_groups(call).items():
        out = torch.full_like(call.q, 7.0)
        with pytest.raises(ValueError, match=problem):
            pdc.run_paged_decode_cpu(
                launch, call.q, call.k, call.v, call.table, call.lens, 0.125, out, share=share
            )
        assert torch.equal(out, torch.full_like(call.q, 7.0)), problem
    # a member whose table leaves its group's blocks: the second block of group 0's last row
    table = call.table.clone()
    rows, bounds = call.share.rows.tolist(), call.share.bounds.tolist()
    first, last = rows[bounds[0]], rows[bounds[1] - 1]
    table[last, 1] = table[rows[bounds[1]], 0]
    out = torch.full_like(call.q, 7.0)
    with pytest.raises(
        ValueError, match=f"sequence {last}'s block 1 differs from sequence {first}'s"
    ):
        pdc.run_paged_decode_cpu(
            launch, call.q, call.k, call.v, table, call.lens, 0.125, out, share=call.share
        )
    assert torch.equal(out, torch.full_like(call.q, 7.0))
    # and the good groups still run, into the same out
    pdc.run_paged_decode_cpu(
        launch,
        call.q,
        call.k,
        call.v,
        call.table,
        call.lens,
        call.q.shape[-1] ** -0.5,
        out,
        share=call.share,
    )
    assert torch.equal(out, run(call, kw, None))


def test_decode_share_checks_its_groups_on_the_host() -> None:
    assert decode_share([], 4, 16) is None
    share = decode_share([([2, 0], 32), ([3], 16)], 4, 16)
    assert share is not None
    assert share.starts.tolist() == [32, 0, 32, 16]
    assert share.rows.tolist() == [2, 0, 3]
    assert share.bounds.tolist() == [0, 2, 3]
    assert share.groups == 2
    for groups, problem in (
        ([([0], 20)], "multiple of the block size 16"),
        ([([0], 0)], "multiple of the block size"),
        ([([], 16)], "group 0 has 0 rows"),
        ([([0, 4], 16)], "row 4 lies outside the batch of 4"),
        ([([0, 1], 16), ([1], 16)], "group 1's row 1 lies outside the batch of 4 or in another"),
    ):
        with pytest.raises(ValueError, match=problem):
            decode_share(groups, 4, 16)
    with pytest.raises(ValueError, match="starts has 4 rows for a batch of 5"):
        share.kernel_args(5)
    i32 = torch.int32
    with pytest.raises(ValueError, match="1-D contiguous int32 on the CPU"):
        DecodeShare(share.starts.long(), share.rows, share.bounds)
    with pytest.raises(ValueError, match="1-D contiguous int32 on the CPU"):
        DecodeShare(share.starts, share.rows.view(1, 3), share.bounds)
    with pytest.raises(ValueError, match="bounds must hold one group at least"):
        DecodeShare(share.starts, share.rows, share.bounds[:1])
    with pytest.raises(ValueError, match="bounds reach row 3 of 2"):
        DecodeShare(share.starts, share.rows[:2], share.bounds)
    assert DecodeShare(share.starts, share.rows, torch.tensor([0, 2, 3], dtype=i32)).groups == 2


# ---- the backend plans the groups from the host tables --------------------------------------


TABLES = [[5, 6, 1], [5, 6, 2], [9, 3], [5, 7, 4], [9, 8]]
SEQ_LENS = [40, 33, 20, 35, 17]


def test_the_backend_plans_groups_once_per_step_and_keeps_the_bits() -> None:
    bs = 16
    meta = make_attention_metadata([1] * 5, SEQ_LENS, TABLES, bs)
    bf16 = CpuAttentionBackend(bs, torch.bfloat16)
    share = bf16._share(meta, bs)
    assert share is not None
    # rows 0, 1 and 3 share block 5 (row 3 leaves block 6); rows 2 and 4 share block 9
    assert share.rows.tolist() == [0, 1, 3, 2, 4]
    assert share.bounds.tolist() == [0, 3, 5]
    assert share.starts.tolist() == [16, 16, 16, 16, 16]
    assert bf16._share(meta, bs) is share  # once per step
    assert CpuAttentionBackend(bs, torch.float32)._share(meta, bs) is None
    assert CpuAttentionBackend(bs, torch.bfloat16, share_prefixes=False)._share(meta, bs) is None
    assert CpuAttentionBackend(bs, torch.float32, share_prefixes=True)._share(meta, bs) is not None

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, bs, 2, 64, generator=gen).to(torch.bfloat16)

    q = torch.randn(5, 4, 64, generator=gen).to(torch.bfloat16)
    new = torch.zeros(5, 2, 64, dtype=torch.bfloat16)
    args = (q, new, new, k, v, meta, 0.125)
    plain = CpuAttentionBackend(bs, torch.bfloat16, share_prefixes=False)
    assert torch.equal(bf16.attend(*args), plain.attend(*args))


def test_the_backend_shares_only_where_the_bits_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    bs = 16
    meta = make_attention_metadata([1] * 5, SEQ_LENS, TABLES, bs)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 10, bs, 2, 64, generator=gen).to(torch.bfloat16)
    # the kernel receives the plan only for head layouts that keep the bits (same_bits)
    passed: list[DecodeShare | None] = []
    kernel = cpu_module.run_paged_decode_cpu

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        passed.append(kwargs.get("share"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cpu_module, "run_paged_decode_cpu", spy)
    for heads in (2, 4):  # 1 and 2 query heads per kv head
        q = torch.randn(5, heads, 64, generator=gen).to(torch.bfloat16)
        new = torch.zeros(5, 2, 64, dtype=torch.bfloat16)
        CpuAttentionBackend(bs, torch.bfloat16).attend(q, new, new, k, v, meta, 0.125)
    assert passed[0] is None and passed[1] is not None
    assert passed[1].rows.tolist() == [0, 1, 3, 2, 4]


# ---- mutants --------------------------------------------------------------------------------


@pytest.mark.parametrize("mutant", SHARE_MUTANTS, ids=[m.name for m in SHARE_MUTANTS])
def test_each_share_mutant_is_caught(mutant: CpuKernelMutant) -> None:
    module = mutant.module()
    caught = []
    for copy in COPIES:
        dtype, kw = copy
        for layout in LAYOUTS:
            call = make_call(layout, dtype)
            plain = run(call, kw, None)
            with decode_module_bound(module):
                shared = run(call, kw, call.share)
                assert torch.equal(run(call, kw, None), plain)  # no groups: untouched
            if not torch.equal(shared, plain):
                caught.append((copy_id(copy), layout_id(layout)))
    # a bug in the template's share pass shows in every copy
    assert {c for c, _ in caught} == {copy_id(c) for c in COPIES}, (
        f"{mutant.name} ({mutant.bug}) is caught only in {caught}"
    )
