"""Launcher for the sampler's compiled per-row pass (``csrc/sample_ops.c``): each row's
argmax and whether it is all finite, for float32 and bfloat16 logits on the CPU.

The kernel reads raw addresses, so ``argmax_finite_cpu`` checks what it could misread
first (device, dtype, shape, strides) and a bad argument raises ``ValueError`` before
anything is computed. The sampler calls ``argmax_finite`` once a step: this pass where
``argmax_finite_ok`` says the logits qualify, the reference (``sample_ops_ref``)
elsewhere. The module lives in the ``_cpu_kernels`` library (``cpu_library``), compiled
once per instruction-set level (csrc/isa.h); a call runs the best level here unless it
names one (``isa``, for tests).
"""

from __future__ import annotations

import torch

from paged_engine import platform
from paged_engine.kernels.cpu_library import level_code, load_sample_module
from paged_engine.kernels.sample_ops_ref import argmax_finite_ref

__all__ = [
    "DTYPES",
    "MAX_VOCAB",
    "PARALLEL_MIN_ELEMENTS",
    "argmax_finite",
    "argmax_finite_cpu",
    "argmax_finite_ok",
    "isa_levels",
    "sample_ops_problem",
]

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes the kernel takes, with the code its entry point reads."""
MAX_VOCAB = (1 << 31) - 1
"""The longest row the kernel takes: it keeps each row's argmax as an int32 index."""
PARALLEL_MIN_ELEMENTS = 1 << 16
"""Below this many elements a call runs on one thread (as the fused ops: a choice, not a
tuned figure); above it, ``torch.get_num_threads()`` threads, each row whole on one."""

_COMPILED, _PROBLEM = load_sample_module()
"""The compiled module (``_sample_ops``), bound once; or None, and why."""


def sample_ops_problem() -> str | None:
    """Why the compiled pass cannot be used, or None when it can."""
    return _PROBLEM


def isa_levels() -> tuple[str, ...]:
    """The instruction-set levels the pass runs at here, best first (as
    ``fused_ops_cpu.isa_levels``); empty without the module."""
    if _COMPILED is None:
        return ()
    return _COMPILED.levels_allowed(platform.cpu_info().isa_levels)


def argmax_finite_ok(logits: torch.Tensor) -> bool:
    """Whether ``argmax_finite_cpu`` takes ``logits``: the module is here, and they are a
    2-D float32 or bfloat16 CPU tensor with rows of 1 to ``MAX_VOCAB`` unit-stride
    elements."""
    return (
        _COMPILED is not None
        and logits.dtype in DTYPES
        and logits.is_cpu
        and logits.dim() == 2
        and 1 <= logits.shape[1] <= MAX_VOCAB
        and logits.stride(1) == 1
        and logits.stride(0) >= 0
        and not logits.is_neg()
    )


def argmax_finite_cpu(
    logits: torch.Tensor, *, isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, ok)`` as ``sample_ops_ref.argmax_finite_ref`` gives them, bit for bit
    (``ok`` exactly; ``tokens`` in every row where ``ok`` holds), at every ``isa`` (None:
    the best here). ValueError, before anything runs, for logits the kernel cannot take."""
    what = "argmax_finite_cpu"
    if _COMPILED is None:
        raise RuntimeError(f"{what}: {_PROBLEM}")
    if not argmax_finite_ok(logits):
        negated = " (lazily negated)" if logits.is_neg() else ""
        raise ValueError(
            f"{what}: needs [rows, 1 <= vocab <= {MAX_VOCAB}] float32 or bfloat16 logits on "
            f"the CPU with unit-stride rows, got {logits.dtype} {tuple(logits.shape)} on "
            f"{logits.device} with strides {logits.stride()}{negated}"
        )
    return _launch(logits, level_code(what, isa, isa_levels()))


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the sampler calls: the compiled pass where it takes the logits (on the CPU,
    float32 or bfloat16: ``argmax_finite_ok``, asked once), else the torch reference, on
    any device and dtype."""
    if argmax_finite_ok(logits):
        return _launch(logits, level_code("argmax_finite", None, isa_levels()))
    return argmax_finite_ref(logits)


def _launch(logits: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on logits ``argmax_finite_ok`` accepted, at level code ``level``."""
    assert _COMPILED is not None
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    ok = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows:
        threads = torch.get_num_threads() if rows * vocab >= PARALLEL_MIN_ELEMENTS else 1
        _COMPILED.module.argmax_finite(
            logits.data_ptr(),
            logits.stride(0),
            rows,
            vocab,
            tokens.data_ptr(),
            ok.data_ptr(),
            DTYPES[logits.dtype],
            threads,
            level,
        )
    return tokens, ok
