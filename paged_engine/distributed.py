"""vLLM's ``vllm.distributed.cleanup_dist_env_and_memory``, which its examples call
between two ``LLM`` objects: here nothing global holds a process group (each ``LLM``'s
workers end with ``LLM.close``), so it frees what garbage collection can and, on CUDA,
the allocator's cached blocks."""

from __future__ import annotations

import gc
import sys


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Collect garbage and empty CUDA's cache (when torch is loaded and CUDA is up).
    ``shutdown_ray`` must be a bool; with True, ``ray.shutdown()`` runs if ray is loaded."""
    if not isinstance(shutdown_ray, bool):
        raise TypeError(f"shutdown_ray must be a bool, got {shutdown_ray!r}")
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    ray = sys.modules.get("ray")
    if shutdown_ray and ray is not None:
        ray.shutdown()


__all__ = ["cleanup_dist_env_and_memory"]
