"""Why each backend cannot run here: one function per backend, written once.

``selection`` reads them to pick "auto"'s backend (flash-attn, then Triton, then torch on
CUDA; the compiled CPU kernel, then torch on CPU) and to explain a refusal; each backend's
constructor calls its own, so a backend built directly refuses the same configurations
with the same words. Nothing here imports a backend, Triton or flash-attn (only
``importlib.util.find_spec`` looks for them), so the checks are cheap and import-safe.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from paged_engine.kernels.paged_decode_cpu import cpu_kernels_problem

__all__ = [
    "FLASH_ATTN_BLOCK_MULTIPLE",
    "KERNEL_HEAD_DIMS",
    "cpu_problem",
    "flash_attn_problem",
    "torch_problem",
    "triton_problem",
]

FLASH_ATTN_BLOCK_MULTIPLE = 256
"""flash-attn's paged KV cache needs ``page_block_size % 256 == 0``."""
FLASH_ATTN_MIN_CAPABILITY = (8, 0)
"""flash-attn 2 runs on Ampere (sm_80) and newer."""
KERNEL_HEAD_DIMS = (16, 256)
"""Head dims the Triton launchers take (inclusive); ``kernels.checks`` enforces the same."""


def _block_size_problem(block_size: object) -> str | None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        return f"block_size must be a positive int, got {block_size!r}"
    return None


def torch_problem(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """The torch backend runs everywhere torch does: the last fallback."""
    del device, dtype, head_dim
    return _block_size_problem(block_size)


def cpu_problem(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """The compiled CPU decode kernel (float32 and bfloat16; other steps and head dims go to
    torch)."""
    del head_dim  # head dims the kernel lacks are routed to the torch path, not refused
    if device.type != "cpu":
        return f"the CPU attention backend runs on the CPU; this device is {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the CPU decode kernel takes bfloat16 or float32 only; got {dtype}"
    return _block_size_problem(block_size) or cpu_kernels_problem()


def triton_problem(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Our Triton kernels: any block size, head dims 16-256, on CUDA or the interpreter."""
    if (problem := _block_size_problem(block_size)) is not None:
        return problem
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not supported; use float16, bfloat16 or float32"
    lo, hi = KERNEL_HEAD_DIMS
    if head_dim is not None and not lo <= head_dim <= hi:
        return f"the Triton kernels take head_dim {lo}..{hi}, got {head_dim}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    off_gpu = device.type != "cuda" or not torch.cuda.is_available()
    if off_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        # Checked before importing the kernels: an import now would fix them as compiled.
        return (
            f"triton attention needs CUDA (or TRITON_INTERPRET=1, set before "
            f"paged_engine.kernels is first imported); this device is {device.type}"
        )
    from paged_engine.kernels.paged_decode_attention import is_interpreted

    interpreted = is_interpreted()
    if off_gpu and not interpreted:
        return (
            f"triton attention needs CUDA, and this device is {device.type}: TRITON_INTERPRET=1 "
            "was set after paged_engine.kernels was first imported, so the kernels were built "
            "for the GPU, not the interpreter"
        )
    if interpreted and dtype == torch.bfloat16:
        return (
            f"dtype {dtype} is unsupported under TRITON_INTERPRET=1 (the interpreter's "
            "bfloat16 arithmetic is broken); use float16 or float32 there, or run on CUDA"
        )
    return None


def flash_attn_problem(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """flash-attn 2.6+ (``block_table``): CUDA sm_80+, 16-bit, pages a multiple of 256 tokens,
    head dims a multiple of 8 up to 256."""
    if device.type != "cuda":
        return f"flash-attn needs CUDA; this device is {device.type}"
    if (problem := _block_size_problem(block_size)) is not None:
        return problem
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (
            f"flash-attn's paged KV cache needs kvcache_block_size % "
            f"{FLASH_ATTN_BLOCK_MULTIPLE} == 0; got {block_size}"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn supports float16 and bfloat16 only; got {dtype}"
    if head_dim is not None and (head_dim % 8 or not 0 < head_dim <= 256):
        return f"flash-attn needs head_dim a multiple of 8 up to 256; got {head_dim}"
    if not torch.cuda.is_available():
        return "flash-attn needs a CUDA device; none is available"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLASH_ATTN_MIN_CAPABILITY:
        major, minor = FLASH_ATTN_MIN_CAPABILITY
        return (
            f"flash-attn needs compute capability {major}.{minor}+ (Ampere or newer); "
            f"this device is {capability[0]}.{capability[1]}"
        )
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install flash-attn)"
    return None
