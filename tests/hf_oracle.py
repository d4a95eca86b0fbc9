"""transformers' own model class (the one config.json names) as the oracle for greedy
generation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TIE_MARGIN = 1e-4
"""Below this top-2 logit margin transformers' own choice is a coin toss between two
tokens; a difference there is a tie, counted and reported, not a failure."""


@dataclass(frozen=True, slots=True)
class Reference:
    tokens: list[int]
    margins: list[float]
    """transformers' top-2 logit margin at each generated position."""


class HFOracle:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int) -> Reference:
        """Argmax decoding, recomputing the whole sequence each step: no KV cache and no
        generation config involved, so nothing but the model itself is trusted."""
        tokens: list[int] = []
        margins: list[float] = []
        while len(tokens) < max_tokens:
            logits = self.model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits
            last = logits[0, -1].float()
            top2 = last.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            tokens.append(int(last.argmax()))
        return Reference(tokens, margins)


def compare(ours: list[int], ref: Reference) -> str:
    """'same', 'tie' (first difference where transformers' margin < TIE_MARGIN) or a
    description of a real difference."""
    if ours == ref.tokens:
        return "same"
    i = next(i for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)) if a != b)
    if ref.margins[i] < TIE_MARGIN:
        return "tie"
    return (
        f"differs at {i}: ours {ours[i]}, transformers {ref.tokens[i]} "
        f"(margin {ref.margins[i]:.3g})"
    )
