"""Mixed steps through the attention machine (tests/attention_machine_mixed.py): the "cpu"
backend, whose mixed steps run their decode rows on the compiled kernel and their chunks on
the torch backend (float32, and bfloat16 in every compiled variant), the torch backend
alongside with and without shared-prefix cascades (its decode rows gathered together), each
step's every row against the naive oracle; and a broken split the machine must catch.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from paged_engine.layers.attention import AttentionMetadata, TorchAttentionBackend
from paged_engine.layers.attention.cpu import CpuAttentionBackend
from paged_engine.layers.attention.mixed import MixedSplit
from tests.attention_machine import Lane, MachineConfig
from tests.attention_machine_mixed import make_mixed_machine
from tests.test_attention_machine import (
    BASE,
    BF16_LANE_VARIANTS,
    FP32,
    WITH_RUNS,
    cpu_backend,
    lane,
    one_torch_thread,  # noqa: F401  (its autouse fixture: one torch thread here too)
    torch_backend,
)

BF16 = torch.bfloat16
HUNT = settings(BASE, max_examples=40, stateful_step_count=40)


class SplitCounter(CpuAttentionBackend):
    """The "cpu" backend, counting the mixed steps it cut in two, so the test can tell the
    kernel really took decode rows of mixed steps."""

    def __init__(self, block_size: int, dtype: torch.dtype, seen: list[int]) -> None:
        super().__init__(block_size, dtype)
        self.seen = seen

    def _mixed_split(self, meta: AttentionMetadata) -> MixedSplit | None:
        fresh = self._mixed_memo is None or self._mixed_memo[0] is not meta
        split = super()._mixed_split(meta)
        if fresh and split is not None:
            self.seen.append(split.rows)
        return split


def test_mixed_steps_machine() -> None:
    """Every row of every step, mixed ones included, against the oracle (~10 s)."""
    seen: list[int] = []
    lanes = (
        Lane("cpu-split-fp32", functools.partial(SplitCounter, seen=seen), FP32),
        *(
            Lane(f"cpu-bf16-{v}", functools.partial(CpuAttentionBackend, bf16_variant=v), BF16)
            for v in BF16_LANE_VARIANTS
        ),
        lane("torch", torch_backend, FP32),
        Lane(
            "torch-cascade-fp32",
            functools.partial(TorchAttentionBackend, shared_prefix_min_tokens=0),
            FP32,
        ),
    )
    config = MachineConfig(lanes=lanes, geometries=WITH_RUNS)
    run_state_machine_as_test(make_mixed_machine(config), settings=HUNT)
    if HUNT.derandomize:  # the ci profile's replay; a random seed's count is chance
        assert len(seen) >= 20, f"only {len(seen)} mixed steps had decode rows for the kernel"


class NewestTokenDropped(CpuAttentionBackend):
    """A broken split: the kernel's context lengths for the decode rows are one short, so
    each decode attends to everything but its own new token (an off-by-one where the
    lengths are cut out of the step's)."""

    def _mixed_split(self, meta: AttentionMetadata) -> MixedSplit | None:
        if self._mixed_memo is not None and self._mixed_memo[0] is meta:
            return self._mixed_memo[1]
        split = super()._mixed_split(meta)
        if split is not None:
            short = replace(split.decode, seq_lens=split.decode.seq_lens - 1)
            split = replace(split, decode=short)
            self._mixed_memo = (meta, split)
        return split


def test_the_machine_catches_a_broken_split() -> None:
    config = MachineConfig(lanes=(Lane("mutant-newest-token-dropped", NewestTokenDropped, FP32),))
    with pytest.raises(AssertionError, match="differs from naive attention"):
        run_state_machine_as_test(make_mixed_machine(config), settings=HUNT)


def test_the_real_split_passes_the_same_hunt() -> None:
    config = MachineConfig(lanes=(lane("cpu", cpu_backend, FP32),))
    run_state_machine_as_test(make_mixed_machine(config), settings=HUNT)
