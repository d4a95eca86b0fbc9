"""Which attention backend runs: the fallback order, and every backend's "why not here".

``attention_backend="auto"`` takes the first backend of ``FALLBACK_ORDER`` for the device
whose requirements hold: on CUDA flash-attn, then Triton, then torch; on the CPU the
compiled decode kernel, then torch. torch runs everywhere, so "auto" never refuses a legal
configuration (any positive block size, any dtype and head dim the model has); a backend
named explicitly that cannot run is refused before anything is allocated, with its reason.
The reasons are ``requirements``' functions, the ones each backend's constructor calls.

Backends are imported only when built: Triton and flash-attn are optional packages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from paged_engine.layers.attention.base import AttentionBackend
from paged_engine.layers.attention.requirements import (
    cpu_problem,
    flash_attn_problem,
    torch_problem,
    triton_problem,
)

__all__ = [
    "BACKEND_NAMES",
    "FALLBACK_ORDER",
    "backend_problems",
    "choose_backend",
    "get_attention_backend",
]

logger = logging.getLogger("paged_engine")

Problem = Callable[[torch.device, int, torch.dtype, "int | None"], "str | None"]

REQUIREMENTS: dict[str, Problem] = {
    "torch": torch_problem,
    "cpu": cpu_problem,
    "triton": triton_problem,
    "flash-attn": flash_attn_problem,
}
BACKEND_NAMES: tuple[str, ...] = tuple(REQUIREMENTS)

FALLBACK_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash-attn", "triton", "torch"),
    "cpu": ("cpu", "torch"),
}
""""auto"'s preference per device type, best first; the last entry always runs."""


def backend_problems(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int | None = None
) -> dict[str, str | None]:
    """Every backend's reason it cannot run with this configuration (None: it can)."""
    device = torch.device(device)
    return {
        name: problem(device, block_size, dtype, head_dim) for name, problem in REQUIREMENTS.items()
    }


def choose_backend(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int | None = None
) -> str:
    """ "auto"'s choice: the first backend of the device's fallback order that can run."""
    device = torch.device(device)
    order = FALLBACK_ORDER.get(device.type, ("torch",))
    skipped: list[str] = []
    for name in order:
        problem = REQUIREMENTS[name](device, block_size, dtype, head_dim)
        if problem is None:
            if skipped:
                logger.info("attention backend 'auto' chose %s (%s)", name, "; ".join(skipped))
            return name
        skipped.append(f"not {name}: {problem}")
    raise ValueError(f"no attention backend can run here: {'; '.join(skipped)}")


def get_attention_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    *,
    head_dim: int | None = None,
) -> AttentionBackend:
    """Build the named backend ("auto": ``choose_backend``), or fail before anything is
    allocated, saying why. ``head_dim`` (the model's, when known) lets "auto" pass over a
    backend that cannot take it."""
    device = torch.device(device)
    if name == "auto":
        name = choose_backend(device, block_size, dtype, head_dim)
    if name not in REQUIREMENTS:
        choices = ", ".join(repr(n) for n in ("auto", *BACKEND_NAMES))
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices}")
    problem = REQUIREMENTS[name](device, block_size, dtype, head_dim)
    if problem is not None:
        raise ValueError(f"attention backend {name!r} cannot run: {problem}")
    backend: AttentionBackend
    if name == "torch":
        from paged_engine.layers.attention.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend(block_size=block_size, dtype=dtype)
    elif name == "cpu":
        from paged_engine.layers.attention.cpu import CpuAttentionBackend

        backend = CpuAttentionBackend(block_size=block_size, dtype=dtype)
    elif name == "triton":
        from paged_engine.layers.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend(block_size, dtype, head_dim=head_dim, device=device)
    else:
        from paged_engine.layers.attention.flash import FlashAttnBackend

        backend = FlashAttnBackend(block_size, dtype, head_dim=head_dim, device=device)
    return backend
