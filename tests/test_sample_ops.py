"""The sampler's compiled per-row pass (csrc/sample_ops.c through
kernels/sample_ops_cpu.py) against its torch reference (``sample_ops_ref``): each row's
argmax, the first index on ties, and whether the row is all finite.

At every instruction-set level this CPU runs, in float32 and bfloat16: ``ok`` equal to the
reference's in every row, the token equal in every row where ``ok`` holds (elsewhere it
means nothing and the sampler discards it). Drawn rows mix ties, signed zeros, infinities
and NaNs of either sign, and lengths on both sides of the kernel's 16 lanes. Each mutant
in tests/sample_mutants/ fails the same comparison on the fixed ``CASES``. Bad input
raises ValueError naming it and leaves the logits as they were.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_engine import LLM
from paged_engine.kernels import sample_ops_cpu
from paged_engine.kernels.sample_ops_cpu import argmax_finite_cpu, isa_levels
from paged_engine.kernels.sample_ops_ref import argmax_finite_ref
from paged_engine.layers.sampler import Sampler
from paged_engine.sampling_params import SamplingParams
from tests.sample_mutants import MUTANTS, PATCH_DIR, mutant_active

pytestmark = pytest.mark.skipif(
    sample_ops_cpu.sample_ops_problem() is not None,
    reason=f"no compiled pass: {sample_ops_cpu.sample_ops_problem()}",
)

DTYPES = [torch.float32, torch.bfloat16]
INF, NAN = math.inf, math.nan


def check_pass(logits: torch.Tensor, isa: str | None = None) -> None:
    """The compiled pass agrees with the reference on ``logits`` (see the module)."""
    before = logits.clone()
    tokens, ok = argmax_finite_cpu(logits, isa=isa)
    want_tokens, want_ok = argmax_finite_ref(logits)
    assert tokens.dtype == torch.int64 and ok.dtype == torch.bool
    assert torch.equal(ok, want_ok), (isa, logits.dtype, ok.tolist(), want_ok.tolist())
    assert torch.equal(tokens[ok], want_tokens[ok]), (isa, tokens.tolist(), want_tokens.tolist())
    assert torch.equal(logits.view(torch.uint8), before.view(torch.uint8))  # read only


def _row(n: int, at: dict[int, float], fill: float = 0.0) -> list[float]:
    row = [fill] * n
    for j, v in at.items():
        row[j] = v
    return row


CASES = [
    [_row(40, {3: 1.0, 19: 1.0})],  # a tie within one lane (3 and 19 are lane 3)
    [_row(40, {5: 1.0, 17: 1.0})],  # a tie across lanes: lane 1 holds 17, lane 5 holds 5
    [_row(37, {36: 2.0}), _row(37, {35: NAN}, fill=1.0)],  # the tail after 32
    [_row(20, {2: -INF}, fill=1.0), _row(20, {7: -NAN}, fill=1.0), _row(20, {4: 3.0})],
]
"""Fixed rows, each catching at least one mutant (the comments say where to look)."""


def check_cases(isa: str | None = None) -> None:
    for dtype in DTYPES:
        for rows in CASES:
            check_pass(torch.tensor(rows, dtype=dtype), isa)


@pytest.mark.parametrize("isa", isa_levels())
def test_the_fixed_cases_at_every_level(isa: str) -> None:
    check_cases(isa)


VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -3e38, 3e38, INF, -INF, NAN, -NAN])


@given(
    rows=st.integers(1, 3),
    vocab=st.integers(1, 70),
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    pad=st.integers(0, 5),
)
def test_drawn_rows_agree_with_the_reference_at_every_level(
    rows: int, vocab: int, data: st.DataObject, dtype: torch.dtype, pad: int
) -> None:
    values = data.draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab))
    # Half the examples all finite (their argmax then counts); the others have a non-finite
    # value at about a third of their positions.
    finite = data.draw(st.booleans())
    if finite:
        values = [v if math.isfinite(v) else 0.5 for v in values]
    wide = torch.zeros(rows, vocab + pad, dtype=dtype)  # rows at a stride beyond their length
    wide[:, :vocab] = torch.tensor(values, dtype=torch.float32).view(rows, vocab).to(dtype)
    for isa in isa_levels():
        check_pass(wide[:, :vocab], isa)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_logits_on_two_threads(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 5000, generator=gen).to(dtype)  # above the parallel threshold
    logits[3, 4999] = NAN
    logits[7, 1234] = 99.0
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_pass(logits)
    finally:
        torch.set_num_threads(threads)


def test_the_outputs_are_cpu_tensors_under_another_default_device() -> None:
    """``with torch.device("meta")`` (the sampler's kill tests run under it): the outputs are
    still allocated on the CPU, never as meta tensors the kernel would write through."""
    logits = torch.tensor([_row(40, {5: 1.0, 17: 1.0}), _row(40, {3: NAN})])
    with torch.device("meta"):
        tokens, ok = argmax_finite_cpu(logits)
    assert tokens.is_cpu and ok.is_cpu
    assert ok.tolist() == [True, False] and int(tokens[0]) == 5


def test_no_rows() -> None:
    tokens, ok = argmax_finite_cpu(torch.zeros(0, 10))
    assert tokens.shape == (0,) and ok.shape == (0,)


BAD = [
    (lambda: torch.zeros(2, 5, dtype=torch.float16), "float16"),
    (lambda: torch.zeros(5), r"\(5,\)"),
    (lambda: torch.zeros(2, 3, 4), r"\(2, 3, 4\)"),
    (lambda: torch.zeros(5, 2).t(), "strides"),
    (lambda: torch.zeros(2, 0), r"\(2, 0\)"),
    (lambda: torch.zeros(2, 5, device="meta"), "meta"),
    (lambda: torch._neg_view(torch.zeros(2, 5)), "negated"),
    # no rows, so nothing is allocated: a vocabulary past the kernel's int32 index
    (lambda: torch.empty(0, 1 << 31), r"\(0, 2147483648\)"),
]


@pytest.mark.parametrize("make, names", BAD, ids=[n for _, n in BAD])
def test_bad_logits_are_refused_by_name_and_left_alone(make: object, names: str) -> None:
    logits = make()  # type: ignore[operator]
    before = None if logits.is_meta else logits.clone()
    with pytest.raises(ValueError, match=names):
        argmax_finite_cpu(logits)
    if before is not None:
        assert torch.equal(logits, before)


def test_the_sampler_takes_the_reference_past_the_kernels_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``argmax_finite`` (the sampler's call) leaves such logits to the torch reference."""
    launched: list[int] = []
    monkeypatch.setattr(sample_ops_cpu, "_launch", lambda *a: launched.append(1))
    tokens, ok = sample_ops_cpu.argmax_finite(torch.empty(0, 1 << 31))
    assert launched == [] and tokens.shape == (0,) and ok.shape == (0,)
    sample_ops_cpu.argmax_finite(torch.zeros(1, 5))
    assert launched == [1]  # the spy sees the kernel where it does take the logits


def test_an_unknown_level_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="avx9000"):
        argmax_finite_cpu(torch.zeros(2, 5), isa="avx9000")


@pytest.mark.parametrize("name", MUTANTS)
def test_each_mutant_fails_the_comparison(name: str) -> None:
    with mutant_active(name), pytest.raises(AssertionError):
        check_cases()


def test_every_patch_has_a_mutant_and_every_mutant_a_patch() -> None:
    assert sorted(p.stem for p in PATCH_DIR.glob("*.patch")) == sorted(MUTANTS)


# ---- the sampler on the pass ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_greedy_sampler_takes_the_first_argmax_and_refuses_non_finite_rows(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    launch = sample_ops_cpu._launch

    def spy(logits: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(logits.dtype)
        return launch(logits, level)

    monkeypatch.setattr(sample_ops_cpu, "_launch", spy)
    copies = widening_copies(monkeypatch)
    rows = [_row(50, {10: 4.0, 40: 4.0}), _row(50, {33: INF}), _row(50, {49: 7.0, 2: NAN})]
    rows.append(_row(50, {20: -1.0}, fill=-2.0))
    logits = torch.tensor(rows, dtype=dtype)
    params = [SamplingParams(temperature=0.0)] * len(rows)
    got = Sampler()(logits, params, [None] * len(rows))
    assert got == [10, None, None, 20]
    assert calls == [dtype]  # one pass, on the model's own dtype
    assert copies == []  # and no float32 copy of the logits


def widening_copies(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Records the dtype of every tensor ``.float()`` is called on from now on."""
    seen: list[torch.dtype] = []
    widen = torch.Tensor.float

    def recording(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(self.dtype)
        return widen(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "float", recording)
    return seen


def test_a_sampled_row_beside_greedy_ones_still_draws_from_its_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copies = widening_copies(monkeypatch)
    logits = torch.full((3, 30), -50.0, dtype=torch.bfloat16)
    logits[0, 4] = logits[1, 9] = logits[2, 27] = 10.0
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1, seed=3),
        SamplingParams(temperature=0.0),
    ]
    gens = [None, torch.Generator().manual_seed(3), None]
    assert Sampler()(logits, params, gens) == [4, 9, 27]
    assert torch.bfloat16 in copies  # the draw needs float32 logits: the recorder sees it


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_pass_raising_mid_step_leaves_the_engine_serving(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """The pass fails at the 3rd step's sampling (the model has written that step's K/V):
    ``generate`` raises, and the engine is idle, its pool whole, and the next ``generate``
    gives the tokens of a run without the fault."""
    llm = LLM(tiny_model_dir, num_kvcache_blocks=16, kvcache_block_size=4, max_model_len=32)
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [20, 21, 22]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    launch, calls = sample_ops_cpu._launch, [0]

    def faulty(logits: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        if calls[0] == 3:
            raise error("injected fault in the sampler's pass")
        return launch(logits, level)

    monkeypatch.setattr(sample_ops_cpu, "_launch", faulty)
    with pytest.raises(error, match="injected"):
        llm.generate(prompts, params, use_tqdm=False)
    assert calls[0] == 3
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    llm.engine.block_manager.check_invariants([])  # type: ignore[attr-defined]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == clean
