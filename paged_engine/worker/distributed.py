"""torch.distributed for the tensor-parallel ranks: the store they meet at, the process
group (gloo on CPU, NCCL on CUDA, one device per rank), and the one value they must agree
on before serving, the KV pool's size in blocks.

All ranks run on this machine: rank 0 in the caller's process, ranks 1..N-1 in workers it
spawns (``tp_worker.py``). They meet at a ``TCPStore`` that rank 0 opens on a free
loopback port (port 0: the kernel picks one, so two engines never race for a port).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paged_engine.layers.parallel import TPGroup

TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # not in torch's stubs' exports

COLLECTIVE_TIMEOUT_S = 300.0
"""The longest a rank waits in one collective, or for the others to join the group. A
worker that dies is noticed sooner (gloo reports the closed connection at once, and rank 0
checks its workers before each step); this bounds the wait on one that hangs."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def refuse_existing_group() -> None:
    """One tensor-parallel group per process: torch.distributed's default group is
    process-wide state."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process (another "
            "tensor-parallel LLM, or torchrun's): close that LLM, or destroy the group, first"
        )


def open_store(world_size: int) -> Any:
    """Rank 0's store, on a loopback port the kernel picks (``.port``)."""
    return TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def connect_store(port: int, world_size: int) -> Any:
    """A worker's connection to rank 0's store."""
    return TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def join_group(rank: int, world_size: int, store: Any, backend: str) -> TPGroup:
    """Create this process's default process group; blocks until every rank has joined
    (at most ``COLLECTIVE_TIMEOUT_S``)."""
    refuse_existing_group()
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        # NCCL binds rank r to cuda:r, whatever the process's current device
        device_id=torch.device("cuda", rank) if backend == "nccl" else None,
    )
    return TPGroup(rank, world_size)


def leave_group() -> None:
    """Destroy the default process group, if any (safe after a peer died, under gloo)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_min(value: int, device: torch.device) -> int:
    """The smallest ``value`` over the ranks (every rank must call it)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
