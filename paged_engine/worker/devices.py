"""The device and dtype a runner uses, from the config's names ("auto" included), and its
share of the CPU's threads.

Kept apart from the runner so that tensor-parallel workers and tests can resolve them
without building one.
"""

from __future__ import annotations

import logging

import torch

from paged_engine.layers.parallel import TPGroup
from paged_engine.platform import openmp_waits_passively, threads_per_rank

__all__ = ["resolve_device", "resolve_dtype", "resolve_tp_device", "set_cpu_threads"]

logger = logging.getLogger("paged_engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a torch device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: only cpu and cuda are supported")
    return device


def resolve_tp_device(name: str, ranks: int) -> torch.device:
    """The device of a tensor-parallel group of ``ranks`` (rank r on ``cuda:r`` under
    CUDA): refused when the name picks one CUDA device or the machine has too few."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    if device.index is not None:
        raise ValueError(
            f"device={name!r} names one device, but tensor_parallel_size={ranks} "
            "puts rank r on cuda:r: use device='cuda' or 'auto'"
        )
    if torch.cuda.device_count() < ranks:
        raise ValueError(
            f"tensor_parallel_size={ranks} needs {ranks} CUDA devices, this machine has "
            f"{torch.cuda.device_count()}"
        )
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: object) -> torch.dtype:
    """'auto' on CPU: bfloat16 for a 16-bit checkpoint on a CPU with AMX-BF16 or
    AVX512-BF16, else float32 (``paged_decode_cpu.auto_cpu_dtype``; logged). On CUDA: the
    checkpoint's half dtype, else bfloat16."""
    if name != "auto":
        return _DTYPES[name]
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
    if device.type == "cpu":
        from paged_engine.kernels.paged_decode_cpu import auto_cpu_dtype, cpu_bf16_features

        stated = checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else None
        dtype, why = auto_cpu_dtype(stated, cpu_bf16_features())
        logger.info("dtype 'auto' chose %s: %s", str(dtype).removeprefix("torch."), why)
        return dtype
    if checkpoint_dtype is torch.float16 or checkpoint_dtype is torch.bfloat16:
        return checkpoint_dtype
    return torch.bfloat16


def set_cpu_threads(num_threads: int, device: torch.device, tp: TPGroup) -> None:
    """torch's intra-op threads for this process (process-wide): ``num_threads``, except
    that the ranks of a tensor-parallel group on the CPU share this machine's cores, so
    each takes at most its share (``platform.threads_per_rank``)."""
    ranks = tp.size if device.type == "cpu" else 1
    threads = threads_per_rank(num_threads, ranks)
    torch.set_num_threads(threads)
    shared = f", rank {tp.rank} of {ranks} sharing this CPU ({num_threads} asked)"
    logger.info(
        "torch CPU threads: %d%s; OpenMP waits %s",
        threads,
        shared if ranks > 1 else "",
        "passively" if openmp_waits_passively() else "actively: spins",
    )
