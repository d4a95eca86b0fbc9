"""Broken cascade (shared-prefix) decode attention in the torch backend, each named after
its bug: planted in the step's ``CascadePlan``, so the real ``cascade_decode`` runs on the
broken plan (no second copy of the maths, no patch file). tests/test_attention_machine.py
shows the oracle machine catching each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from paged_engine.layers.attention.torch_backend import TorchAttentionBackend
from paged_engine.layers.cascade import CascadePlan


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
