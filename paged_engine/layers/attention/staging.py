"""Host-to-device copies of a step's small integer arrays, through reused pinned buffers.

Every step moves a few kilobytes of ints to the GPU (token ids, positions, slots, block
tables, lengths). ``tensor.to("cuda", non_blocking=True)`` from ordinary (pageable) host
memory is synchronous: CUDA first copies pageable memory into a pinned bounce buffer, and
the call returns only when that is done. From pinned memory the copy is queued and the
call returns at once, so the host builds the next layer's launches while the copy runs.

``HostStaging`` keeps one pinned arena per dtype, grown as needed and reused across steps
(allocating pinned memory is a slow driver call), and packs all of a step's arrays of one
dtype into it, so the step costs one copy per dtype instead of one per array. Reuse has one
hazard: the arena must not be overwritten while the previous step's copy out of it is still
queued. Each arena remembers an event recorded after its copy, and the next ``stage`` waits
on it first (normally long finished: the previous step's results were read back since).

On a CPU device nothing is copied: the arrays become tensors sharing their memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["HostStaging"]


class HostStaging:
    """Pinned, reused host buffers for a device's per-step copies (see the module docstring).

    ``event_factory`` makes the event recorded after each copy (``torch.cuda.Event`` on
    CUDA); tests pass a stand-in to check the ordering without a GPU.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        pin: bool | None = None,
        event_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._event_factory = event_factory or (torch.cuda.Event if self.pin else None)
        self._arenas: dict[torch.dtype, torch.Tensor] = {}
        self._pending: dict[torch.dtype, Any] = {}
        self.copies = 0
        """Host-to-device copies issued so far (one per dtype per ``stage`` call)."""

    def _arena(self, dtype: torch.dtype, size: int) -> torch.Tensor:
        arena = self._arenas.get(dtype)
        if arena is None or arena.numel() < size:
            # Grow geometrically: a run's first steps settle the size, later ones reuse it.
            capacity = max(size, 2 * (arena.numel() if arena is not None else 0), 1024)
            arena = torch.empty(capacity, dtype=dtype, pin_memory=self.pin)
            self._arenas[dtype] = arena
            self._pending.pop(dtype, None)  # a fresh buffer has no copy in flight
        return arena

    def stage(self, arrays: Sequence[tuple[np.ndarray, torch.dtype]]) -> list[torch.Tensor]:
        """Device tensors holding ``arrays`` (each cast to its dtype, shape kept), in order."""
        if self.device.type == "cpu" and self._event_factory is None:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=_np(d))) for a, d in arrays]
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype in dict.fromkeys(d for _, d in arrays):
            members = [i for i, (_, d) in enumerate(arrays) if d == dtype]
            sizes = [int(np.size(arrays[i][0])) for i in members]
            # Each array starts 16 bytes into its own line: the kernels' loads of it are then
            # aligned, and Triton specialises them as it does for freshly allocated tensors.
            align = max(1, 16 // torch.empty(0, dtype=dtype).element_size())
            starts = [0]
            for n in sizes[:-1]:
                starts.append(starts[-1] + -(-n // align) * align)
            end = starts[-1] + sizes[-1]
            arena = self._arena(dtype, end)
            pending = self._pending.pop(dtype, None)
            if pending is not None:
                pending.synchronize()  # the previous copy out of this arena has finished
            host = arena.numpy()
            for i, at, n in zip(members, starts, sizes, strict=True):
                host[at : at + n] = np.ravel(arrays[i][0])
            # copy=True: on a CPU device (tests) ``to`` would otherwise alias the arena.
            device = arena[:end].to(self.device, non_blocking=True, copy=True)
            self.copies += 1
            if self._event_factory is not None:
                event = self._event_factory()
                event.record()
                self._pending[dtype] = event
            for i, at, n in zip(members, starts, sizes, strict=True):
                out[i] = device[at : at + n].view(np.shape(arrays[i][0]))
        return [t for t in out if t is not None]


def _np(dtype: torch.dtype) -> Any:
    return {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}[dtype]
