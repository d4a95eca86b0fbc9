"""Deliberately broken attention kernels, each named after the bug it plants.

Each mutant is the real code with one bug switched on, so there is no second copy of a
kernel to drift from the first:

* Triton kernels: one of the kernel's ``MUTANT_*`` constexpr flags (they default to the
  correct behaviour). tests/test_kernels.py requires every mutant to disagree with its
  ``*_ref`` on some layout: proof that the layouts the tests draw can catch that class of
  bug, e.g. that they include sequence lengths that are not multiples of the block size
  and GQA ratios above 1 with several KV heads;
* the compiled CPU decode kernel: a bit of its ``kernel_flags`` (tests/test_cpu_kernel.py
  holds them to the same standard);
* cascade decode attention: a rewrite of the step's ``CascadePlan``.

tests/test_attention_machine.py shows the oracle machine catching each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from paged_engine.kernels.paged_decode_attention import paged_decode_attention
from paged_engine.kernels.paged_decode_cpu import paged_decode_attention_cpu
from paged_engine.kernels.paged_prefill_attention import paged_prefill_attention
from paged_engine.layers.attention import TorchAttentionBackend
from paged_engine.layers.attention_cpu import CpuAttentionBackend
from paged_engine.layers.cascade import CascadePlan

_LAUNCHERS = {"decode": paged_decode_attention, "prefill": paged_prefill_attention}


@dataclass(frozen=True)
class KernelMutant:
    """Which kernel (``"decode"`` or ``"prefill"``) a mutant stands in for, and its flag."""

    name: str
    kind: str
    flag: str
    bug: str

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The real launcher of ``kind``, same arguments, with ``flag`` switched on."""
        return _LAUNCHERS[self.kind](*args, **kwargs, kernel_flags={self.flag: True})


MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        name="decode_block_walk_off_by_one",
        kind="decode",
        flag="MUTANT_BLOCK_WALK_FLOOR",
        bug="walks seq_len // block_size blocks instead of cdiv: drops a partial last block",
    ),
    KernelMutant(
        name="prefill_missing_causal_mask",
        kind="prefill",
        flag="MUTANT_NO_CAUSAL_MASK",
        bug="new tokens attend to the whole context, including later new tokens",
    ),
    KernelMutant(
        name="decode_gqa_wrong_kv_head",
        kind="decode",
        flag="MUTANT_GQA_INTERLEAVED",
        bug="query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)


# --------------------------------------------------------------------------------------------
# Cascade (shared-prefix) decode attention in the torch backend: bugs planted in the step's
# plan, so the real ``cascade_decode`` runs on them (again no second copy of the maths).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CascadeMutant:
    """A broken ``CascadePlan``: ``mutate`` turns the real plan into the buggy one."""

    name: str
    mutate: Callable[[CascadePlan], CascadePlan]
    bug: str


def _swap_members(plan: CascadePlan) -> CascadePlan:
    return replace(plan, member_slots=plan.member_slots.flip(0))


def _unmask_rest(plan: CascadePlan) -> CascadePlan:
    return replace(plan, rest_mask=torch.zeros_like(plan.rest_mask))


def _drop_first_rest(plan: CascadePlan) -> CascadePlan:
    # Each sequence's first non-shared position is masked out, as if the split were made
    # one token too late.
    mask = plan.rest_mask.clone()
    mask[..., 0] = float("-inf")
    last_real = (plan.rest_mask == 0).sum(-1).squeeze(-1) == 1
    mask[last_real, :, 0] = 0  # a one-token rest keeps its token (no all-masked row)
    return replace(plan, rest_mask=mask)


CASCADE_MUTANTS: tuple[CascadeMutant, ...] = (
    CascadeMutant(
        "cascade_members_swapped",
        _swap_members,
        "members' rows are paired with another member's prefix attention in the merge",
    ),
    CascadeMutant(
        "cascade_rest_padding_unmasked",
        _unmask_rest,
        "the padding of shorter rests (copies of their first position) is attended",
    ),
    CascadeMutant(
        "cascade_rest_first_position_dropped",
        _drop_first_rest,
        "the first position after the shared prefix is in neither part",
    ),
)


class CascadeMutantBackend(TorchAttentionBackend):
    """The torch backend, cascading every shared prefix, with ``mutant``'s plan bug."""

    def __init__(self, mutant: CascadeMutant, block_size: int, dtype: torch.dtype) -> None:
        super().__init__(block_size, dtype, shared_prefix_min_tokens=0)
        self.mutant = mutant

    def _decode_plan(  # type: ignore[no-untyped-def]
        self, meta, block_size, dtype, num_kv_heads
    ):
        plan = super()._decode_plan(meta, block_size, dtype, num_kv_heads)
        return self.mutant.mutate(plan) if isinstance(plan, CascadePlan) else plan


# --------------------------------------------------------------------------------------------
# The compiled CPU decode kernel (csrc/paged_decode_cpu.c): the same bug classes, planted
# through its ``kernel_flags`` bits (the real kernel with one bug switched on).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuKernelMutant:
    """A ``KernelMutant`` for the CPU decode kernel: ``flag`` is a bit of ``kernel_flags``."""

    name: str
    flag: int
    bug: str
    kind: str = "decode"

    def launch(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return paged_decode_attention_cpu(*args, **kwargs, kernel_flags=self.flag)


CPU_MUTANTS: tuple[CpuKernelMutant, ...] = (
    CpuKernelMutant(
        name="cpu_decode_block_walk_floor",
        flag=1,
        bug="reads seq_len // block_size whole blocks: drops a partial last block",
    ),
    CpuKernelMutant(
        name="cpu_decode_gqa_wrong_kv_head",
        flag=2,
        bug="query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)


class CpuMutantBackend(CpuAttentionBackend):
    """The CPU backend with ``mutant``'s decode kernel."""

    def __init__(self, mutant: CpuKernelMutant, block_size: int, dtype: torch.dtype) -> None:
        super().__init__(block_size, dtype)
        self._decode = mutant.launch
