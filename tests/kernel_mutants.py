"""Deliberately broken attention kernels, each named after the bug it plants.

Each mutant is the real launcher with one of the real kernel's ``MUTANT_*`` constexpr flags
switched on (the flags default to the correct behaviour), so there is no second copy of a
kernel to drift from the first. tests/test_kernels.py requires every mutant to disagree with
its ``*_ref`` on some layout: proof that the layouts the tests draw can catch that class of
bug, e.g. that they include sequence lengths that are not multiples of the block size and
GQA ratios above 1 with several KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paged_engine.kernels.paged_decode_attention import _paged_decode_attention
from paged_engine.kernels.paged_prefill_attention import _paged_prefill_attention

_LAUNCHERS = {"decode": _paged_decode_attention, "prefill": _paged_prefill_attention}


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
