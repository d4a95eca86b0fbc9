"""The device and dtype a runner uses, from the config's names ("auto" included), and its
share of the CPU's threads.

Kept apart from the runner so that tensor-parallel workers and tests can resolve them
without building one.
"""

from __future__ import annotations

import logging

import torch

from paged_engine.cpu_bind import (
    bind_process,
    default_cpu_bind,
    format_cpu_lists,
    parse_cpu_bind,
    rank_plan,
)
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


def set_cpu_threads(
    num_threads: int, device: torch.device, tp: TPGroup, cpu_bind: str | None = None
) -> None:
    """torch's intra-op threads for this process (process-wide): ``num_threads``, except
    that the ranks of a tensor-parallel group on the CPU share this machine's cores, so
    each takes at most its share (``platform.threads_per_rank``).

    On the CPU, ``cpu_bind`` (None: ``cpu_bind.default_cpu_bind()``, the environment's)
    binds every thread of the process to this rank's CPUs (``cpu_bind.bind_process``),
    and the rank then takes one thread per CPU. Under "auto" rank 0 plans for the whole
    group and sends the plan to the others: a worker spawned by a process that an
    earlier engine bound sees fewer CPUs than rank 0 does, and would plan otherwise."""
    ranks = tp.size if device.type == "cpu" else 1
    threads = threads_per_rank(num_threads, ranks)
    setting = default_cpu_bind() if cpu_bind is None else cpu_bind
    cpus: tuple[int, ...] | None = None
    if device.type == "cpu":
        auto = parse_cpu_bind(setting).mode == "auto"
        plan = rank_plan(setting, ranks, threads) if tp.rank == 0 or not auto else None
        if auto and ranks > 1:
            box: list[object] = [plan]
            torch.distributed.broadcast_object_list(box, src=0)
            plan = box[0]  # type: ignore[assignment]
        cpus = None if plan is None else plan[tp.rank]
    if cpus:
        try:
            bind_process(cpus)
        except OSError as err:
            raise ValueError(
                f"cpu_bind={setting!r}: binding to CPUs {cpus} failed: {err}"
            ) from None
        threads = len(cpus)
    torch.set_num_threads(threads)
    shared = f", rank {tp.rank} of {ranks} sharing this CPU ({num_threads} asked)"
    logger.info(
        "torch CPU threads: %d%s%s; OpenMP waits %s",
        threads,
        shared if ranks > 1 else "",
        f", bound to CPUs {format_cpu_lists([cpus])} (cpu_bind {setting!r})" if cpus else "",
        "passively" if openmp_waits_passively() else "actively: spins",
    )
