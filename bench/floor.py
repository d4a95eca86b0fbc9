"""The matmul floor of a paged_engine run: its own projections, replayed with nothing else.

Why it exists: issue 13 asks for 1.5x vLLM's output tok/s on models whose steps are mostly
``Linear``s. Those matmuls are oneDNN GEMMs on packed weights on both sides, already near
the core's FMA rate (``bench/test_linear_bench.py``), so an engine cannot be faster than
the time its matmuls take alone. This module measures that time for one run: ``record``
hooks the model to log each step's rows (the packed tokens the layers see, and the rows the
LM head sees), and ``replay`` runs every ``Linear`` of the model, then the LM head, on
those row counts, in model order, with the same weights, dtype and threads, and no
attention, norms, sampling or bookkeeping. ``vLLM's seconds / floor seconds`` is then the
best ratio over vLLM that any engine computing paged_engine's matmuls could reach.

Cost: one forward pre-hook on the decoder stack and one on the LM head while recording
(done in an untimed round), and one replay (a few seconds on the 29M model) after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paged_engine.layers.linear import Linear

__all__ = ["Floor", "StepShapes", "record", "replay"]


@dataclass(slots=True)
class StepShapes:
    """Rows per forward: ``tokens[i]`` through the decoder layers, ``logits[i]`` through
    the LM head (one per sampled sequence)."""

    tokens: list[int] = field(default_factory=list)
    logits: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Floor:
    """``seconds``: the fastest replay; ``flops``: 2 x rows x in x out, summed."""

    seconds: float
    flops: int

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.seconds / 1e9


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder stack and the LM head of a paged_engine CausalLM."""
    stack, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if not isinstance(stack, nn.Module) or not isinstance(head, nn.Module):
        raise TypeError(f"{type(model).__name__} has no .model and .lm_head modules")
    return stack, head


@contextmanager
def record(model: nn.Module) -> Iterator[StepShapes]:
    """Log the rows of every forward while the block runs; the hooks always come off."""
    stack, head = _parts(model)
    shapes = StepShapes()

    def on_stack(_: nn.Module, args: tuple[Any, ...]) -> None:
        shapes.tokens.append(int(args[0].shape[0]))

    def on_head(_: nn.Module, args: tuple[Any, ...]) -> None:
        shapes.logits.append(int(args[0].shape[0]))

    handles = [stack.register_forward_pre_hook(on_stack), head.register_forward_pre_hook(on_head)]
    try:
        yield shapes
    finally:
        for h in handles:
            h.remove()


def _head_size(head: nn.Module) -> tuple[int, int]:
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"{type(head).__name__} has no 2-D weight")
    return int(weight.shape[1]), int(weight.shape[0])


def replay(model: nn.Module, shapes: StepShapes, repeats: int = 2) -> Floor:
    """Run the model's ``Linear``s and LM head on ``shapes``' rows, ``repeats`` times; the
    fastest wall time. Inputs are random (a GEMM's time does not depend on the values)."""
    if len(shapes.tokens) != len(shapes.logits):
        raise ValueError(
            f"{len(shapes.tokens)} decoder forwards but {len(shapes.logits)} LM-head ones"
        )
    if not shapes.tokens:
        raise ValueError("no steps were recorded")
    stack, head = _parts(model)
    linears = [m for m in stack.modules() if isinstance(m, Linear)]
    if not linears:
        raise TypeError(f"{type(stack).__name__} has no paged_engine Linear")
    hidden, vocab = _head_size(head)
    param = next(iter(head.parameters()))
    dtype, device = param.dtype, param.device
    top = max(max(shapes.tokens), max(shapes.logits))
    inputs = {
        k: torch.randn(top, k, dtype=dtype, device=device)
        for k in {m.input_size for m in linears} | {hidden}
    }
    per_row = sum(m.input_size * m.output_size for m in linears)
    flops = 2 * (per_row * sum(shapes.tokens) + hidden * vocab * sum(shapes.logits))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for rows, sampled in zip(shapes.tokens, shapes.logits, strict=True):
                for m in linears:
                    m(inputs[m.input_size][:rows])
                head(inputs[hidden][:sampled])
            best = min(best, time.perf_counter() - start)
    return Floor(seconds=best, flops=flops)
