"""A batch's grammar masks applied to its logits: the one place structured outputs touch the
numbers the sampler reads.

Why a bitmask: the grammar library fills one bit per token (int32 words, bit ``j`` of word
``w`` is token ``32 * w + j``, xgrammar's and llguidance's layout), 32 times smaller than
a boolean row, and that is what crosses from the matchers to the device. It is unpacked
here with plain tensor ops, so the same code runs on the CPU and on CUDA, byte by byte (a
byte per token at most: the rows of a large batch over a 150k vocabulary stay small).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["BITS", "TokenMask", "apply_token_bitmask", "unpack_bitmask"]

BITS = 32

TokenMask = tuple[torch.Tensor, Sequence[int]]
"""``(bitmask [R, W] int32, rows)``: row ``r`` of the bitmask is logits row ``rows[r]``."""


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """``bitmask`` ``[R, W]`` as booleans ``[R, width]`` (True: allowed). A mask narrower
    than the logits (a tokenizer smaller than the model's padded vocabulary) allows none of
    the tokens past its end; a wider one is cut."""
    words = bitmask.to(torch.int32).contiguous()
    device = bitmask.device  # the shifts are made there: no host-to-device copy per step
    if sys.byteorder == "little":  # the bytes of a word, lowest first: a byte per 8 tokens
        parts, shifts = words.view(torch.uint8), torch.arange(8, dtype=torch.uint8, device=device)
    else:
        parts, shifts = words, torch.arange(BITS, dtype=torch.int32, device=device)
    bits = (parts[:, :, None] >> shifts) & 1  # one byte per token
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    have = allowed.shape[1]
    if have >= width:
        return allowed[:, :width]
    pad = torch.zeros((allowed.shape[0], width - have), dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]
) -> torch.Tensor:
    """``logits`` ``[B, V]`` with every token that ``bitmask`` disallows in ``rows`` set to
    -inf: a new tensor (the caller's logits stay the model's, which logprobs report); the
    other rows are copied untouched."""
    out = logits.clone()
    if not rows:
        return out
    at = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    out[at] = logits[at].masked_fill(~allowed, float("-inf"))
    return out
