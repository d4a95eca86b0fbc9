"""Deliberately broken attention kernels, each named after the bug it plants.

Each mutant is the real launcher with one of the real kernel's ``MUTANT_*`` constexpr flags
switched on (the flags default to the correct behaviour), so there is no second copy of a
kernel to drift from the first. tests/test_kernels.py requires every mutant to disagree with
its ``*_ref`` on some layout: proof that the layouts the tests draw can catch that class of
bug, e.g. that they include sequence lengths that are not multiples of the block size and
GQA ratios above 1 with several KV heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_engine.kernels.paged_decode_attention import _paged_decode_attention
from paged_engine.kernels.paged_prefill_attention import _paged_prefill_attention


@dataclass(frozen=True)
class KernelMutant:
    """A broken launcher and which kernel (``"decode"`` or ``"prefill"``) it stands in for."""

    name: str
    kind: str
    launch: Callable[..., torch.Tensor]
    bug: str


MUTANTS: tuple[KernelMutant, ...] = (
    KernelMutant(
        name="decode_block_walk_off_by_one",
        kind="decode",
        launch=functools.partial(
            _paged_decode_attention, kernel_flags={"MUTANT_BLOCK_WALK_FLOOR": True}
        ),
        bug="walks seq_len // block_size blocks instead of cdiv: drops a partial last block",
    ),
    KernelMutant(
        name="prefill_missing_causal_mask",
        kind="prefill",
        launch=functools.partial(
            _paged_prefill_attention, kernel_flags={"MUTANT_NO_CAUSAL_MASK": True}
        ),
        bug="new tokens attend to the whole context, including later new tokens",
    ),
    KernelMutant(
        name="decode_gqa_wrong_kv_head",
        kind="decode",
        launch=functools.partial(
            _paged_decode_attention, kernel_flags={"MUTANT_GQA_INTERLEAVED": True}
        ),
        bug="query head h reads KV head h % num_kv_heads instead of h // (H // KVH)",
    ),
)
